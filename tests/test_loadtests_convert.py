"""The ``convert`` load-test scenario: answer verification, the report, and a tiny real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gateway.devtools.conversion import convert_object
from loadtests.convert import DESIRED, Phase, check, review, table

ROOT = Path(__file__).resolve().parent.parent


def _answer(objects: list[object], *, uid: str = "u", status: str = "Success") -> bytes:
    return msgspec.json.encode(
        {"response": {"uid": uid, "result": {"status": status}, "convertedObjects": objects}}
    )


CONVERTED = convert_object(json.loads(review(1))["request"]["objects"][0], DESIRED)


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        pytest.param(
            200, _answer([CONVERTED]), None, id="a converted object of the desired version is right"
        ),
        pytest.param(500, b"", "http-500", id="an HTTP error is an error"),
        pytest.param(200, _answer([CONVERTED], uid="other"), "wrong-uid", id="another uid is an error"),
        pytest.param(200, _answer([], status="Failure"), "failure", id="a Failure result is an error"),
        pytest.param(200, _answer([]), "wrong-count", id="a missing object is an error"),
        pytest.param(
            200,
            _answer([{"apiVersion": "stable.example.com/v1"}]),
            "not-converted",
            id="an unconverted object is an error",
        ),
        pytest.param(200, b"{", "undecodable", id="an undecodable answer is an error"),
    ],
)
def test_answers_are_verified(status, body, expected):
    assert check(status, body, "u", 1) == expected


def test_review_sizes_and_the_report():
    assert len(json.loads(review(500))["request"]["objects"]) == 500
    phases = [Phase("direct", 10, 100.0, 2.0, 4.0, 100), Phase("gateway", 10, 50.0, 4.0, 8.0, 50)]
    lines = table(phases).splitlines()
    assert "2.00x" in lines[2] and "0.50x" in lines[2]


@pytest.mark.slow
def test_a_tiny_real_run(tmp_path):
    """Fleet and gateway as processes, every answer verified, gateway and direct side by side."""
    out = tmp_path / "convert.json"
    result = subprocess.run(
        [sys.executable, "-m", "loadtests", "convert", "--objects", "1,10", "--duration", "0.3", "--warmup", "0",
         "--concurrency", "2", "--no-tls", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    phases = json.loads(out.read_text())
    assert [(p["objects"], p["name"]) for p in phases] == [
        (n, name) for n in (1, 10) for name in ("direct", "gateway", "gateway+cache")
    ]
    assert all(p["ok"] > 0 and not p["errors"] for p in phases)
