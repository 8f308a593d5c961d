"""The suite's own contract with CI: a missing tool skips with one line locally and fails under .ci/run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.processes import free_port
from tests.support.tools import STRICT_ENV

ROOT = Path(__file__).resolve().parent.parent

_PROBE = """
from tests.support.tools import require_kube_assets, require_tool

def test_needs_a_tool():
    require_tool("surely-not-installed-tool")

def test_needs_the_control_plane():
    require_kube_assets()
"""


@pytest.mark.parametrize(
    ("strict", "code", "summary"),
    [
        pytest.param("", 0, "2 skipped", id="locally a missing tool or control plane skips the test"),
        pytest.param("1", 1, "2 failed", id="under .ci/run (strict) every skip fails the run"),
    ],
)
def test_missing_tools_skip_locally_and_fail_in_ci(
    tmp_path: Path, strict: str, code: int, summary: str
) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "KUBEBUILDER_ASSETS"}
    env[STRICT_ENV] = strict
    done = subprocess.run(
        # the project's settings and its conftest (as a plugin), for a test file outside the tree
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            "pyproject.toml",
            "--rootdir",
            ".",
            "-p",
            "tests.conftest",
            str(probe),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == code, out
    assert summary in out, out
    assert "apt-get install surely-not-installed-tool" in out or strict, out
    assert "setup-envtest use 1.36" in out, out


def test_a_free_port_is_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    """A port from ``bind(0)`` is one an outgoing connection may take before the server binds it
    (kube-apiserver failed CI with "address already in use" that way): the suite's ports come from
    below the kernel's ephemeral range, each once."""
    low, _high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < port < low for port in ports)
