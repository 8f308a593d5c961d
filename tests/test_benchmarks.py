"""The benchmarks run and report what their docstrings promise (the figures themselves live in
docs/performance.md: no timing is asserted here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "key_type",
    [
        pytest.param(
            "ecdsa",
            id="bench_connection --nginx: the gateway's and nginx's cost of a new connection, same run, ECDSA",
        ),
        pytest.param(
            "rsa",
            id="bench_connection --nginx: the gateway's and nginx's cost of a new connection, same run, RSA",
        ),
    ],
)
def test_bench_connection_beside_nginx(key_type: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_connection.py",
            "--nginx",
            "--key-type",
            key_type,
            "--connections",
            "200",
            "--clients",
            "2",
            "--repeat",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(rf"^{key_type}: server CPU per request: new connection \d+ µs", proc.stdout, re.M), (
        proc.stdout
    )
    assert re.search(
        rf"^{key_type}: nginx: new connection \d+ µs, keep-alive \d+ µs; a new connection costs -?\d+ µs; "
        r"the gateway's = (-?[\d.]+x|- \(too few connections to tell\)) nginx's$",
        proc.stdout,
        re.M,
    ), proc.stdout
