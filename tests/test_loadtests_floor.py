"""The load tool measures honestly (issue 15 §5): an nginx TLS proxy hop in front of the same backend is
the floor line of a proxy (a third row, ``--nginx``), and ``--profile`` writes a py-spy flame graph of the
gateway during the measured phase — or says at once what is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
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


def _collapsed_stacks(text: str) -> bool:
    """Every line is ``frame;frame;… count`` (py-spy's raw format; a stack py-spy could not unwind
    past the process is that one frame alone)."""
    lines = text.splitlines()
    return bool(lines) and all(
        (parts := line.rpartition(" "))[0] and parts[2].isdigit() and line.startswith("process ")
        for line in lines
    )


@pytest.mark.slow
@pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed (the loadtest extra)")
@pytest.mark.parametrize(
    ("name", "shape", "said"),
    [
        pytest.param(
            "profile.svg",
            lambda text: text.lstrip().startswith("<?xml"),
            "wrote the flame graph",
            id="PATH.svg: a flame graph",
        ),
        pytest.param(
            "profile.txt",
            _collapsed_stacks,
            "wrote the collapsed stacks",
            id="PATH.txt: collapsed stacks, one line per stack",
        ),
    ],
)
def test_profile_records_the_gateway(
    tmp_path: Path, name: str, shape: Callable[[str], bool], said: str
) -> None:
    out = tmp_path / name
    proc, doc = quick(tmp_path, "--profile", str(out), "--no-direct")
    assert doc["points"][0]["median"]["gateway"]["errors"] == {}
    text = out.read_text()
    assert shape(text), proc.stderr + text[:500]
    assert f"{said} {out}" in proc.stderr
    assert "gateway/server" in text, "the gateway's own frames are in the profile"


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


def _baseline_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A second source checkout of the gateway (a copy of this one) that leaves a mark when it runs."""
    tree = tmp_path / "base"
    shutil.copytree(ROOT / "gateway", tree / "gateway", ignore=shutil.ignore_patterns("__pycache__"))
    mark = tmp_path / "ran-from-copy"
    init = tree / "gateway" / "__init__.py"
    init.write_text(
        init.read_text()
        + f"\nimport os\nwith open({str(mark)!r}, 'a') as _f:\n    _f.write(f'{{os.getpid()}}\\n')\n"
    )
    return tree, mark


@pytest.mark.slow
def test_baseline_tree_is_measured_beside_the_gateway_with_the_same_load(tmp_path: Path) -> None:
    tree, mark = _baseline_copy(tmp_path)
    proc, doc = quick(tmp_path, "--baseline-tree", str(tree))
    rows = doc["points"][0]["median"]
    assert list(rows) == ["direct", "gateway", "baseline"], "the baseline row comes right after the gateway's"
    base, gw = rows["baseline"], rows["gateway"]
    assert base["ok"] > 0 and base["errors"] == {}, "the baseline's answers are verified like the gateway's"
    assert base["cpu_us_per_review"] > 0
    assert len(mark.read_text().split()) == 1, "exactly one gateway ran from the baseline checkout"
    row = next(line for line in proc.stdout.splitlines() if line.startswith("÷ baseline"))
    assert row.split()[-1] == f"{gw['cpu_us_per_review'] / base['cpu_us_per_review']:.2f}x", row
    assert f"baseline: the gateway of {tree}" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--baseline-tree", "/nonexistent"],
            "--baseline-tree /nonexistent: no gateway/__main__.py there (a source checkout)",
            id="--baseline-tree that is no checkout is refused before any work",
        ),
        pytest.param(
            ["--baseline-tree", str(ROOT), "--direct-only"],
            "--baseline-tree needs a gateway this run starts",
            id="--baseline-tree with no gateway run is refused",
        ),
    ],
)
async def test_baseline_tree_refusals(args: list[str], message: str) -> None:
    code, out = await loadtool("passthrough", *args)
    assert code == 2
    assert message in out
    assert "starting" not in out
