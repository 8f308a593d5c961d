"""The load tool measures honestly (issue 15 §5): an nginx TLS proxy hop in front of the same backend is
the floor line of a proxy (a third row, ``--nginx``), and ``--profile`` writes a py-spy flame graph of the
gateway during the measured phase — or says at once what is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtests.processes import nginx, py_spy
from tests.test_loadtool_cli import loadtool

ROOT = Path(__file__).resolve().parent.parent


def quick(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtests",
            "passthrough",
            "--quick",
            "--duration",
            "1",
            "--no-progress",
            "--json",
            str(out),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(nginx() is None, reason="nginx is not installed (Debian: apt-get install nginx-light)")
def test_nginx_proxy_hop_is_a_third_row_with_its_cpu_and_latency(tmp_path: Path) -> None:
    proc, doc = quick(tmp_path, "--nginx")
    rows = doc["points"][0]["median"]
    assert set(rows) == {"direct", "nginx", "gateway"}
    hop = rows["nginx"]
    assert hop["ok"] > 0 and hop["errors"] == {}, "every answer through nginx is the backend's, verified"
    assert hop["cpu_us_per_review"] > 0
    assert hop["latency"]["p50_ms"] > 0
    assert any(line.startswith("nginx ") for line in proc.stdout.splitlines()), proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed (the loadtest extra)")
def test_profile_writes_a_flame_graph_of_the_gateway(tmp_path: Path) -> None:
    svg = tmp_path / "profile.svg"
    proc, doc = quick(tmp_path, "--profile", str(svg), "--no-direct")
    assert doc["points"][0]["median"]["gateway"]["errors"] == {}
    assert svg.read_text().lstrip().startswith("<?xml"), proc.stderr
    assert "gateway" in svg.read_text(), "the gateway's own frames are in the graph"


@pytest.mark.parametrize(
    ("args", "prelude", "message"),
    [
        pytest.param(
            ["--profile", "x.svg"],
            "import loadtests.processes as p\np.py_spy = lambda: None",
            "--profile needs py-spy: pip install 'webhook-gateway[loadtest]'",
            id="--profile without py-spy says so before any work",
        ),
        pytest.param(
            ["--nginx"],
            "import loadtests.processes as p\np.nginx = lambda: None",
            "--nginx needs nginx: apt-get install nginx-light",
            id="--nginx without nginx says so before any work",
        ),
        pytest.param(
            ["--profile", "x.svg", "--direct-only"],
            "",
            "--profile needs a gateway this run starts",
            id="--profile with no gateway to profile is refused",
        ),
    ],
)
async def test_missing_tool_fails_before_any_work(args: list[str], prelude: str, message: str) -> None:
    code, out = await loadtool("passthrough", *args, prelude=prelude)
    assert code == 2
    assert message in out
    assert "starting" not in out
    assert len([line for line in out.splitlines() if "error:" in line]) == 1
