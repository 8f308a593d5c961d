"""``loadtests.cpuquota``: the CFS quota ``overload --gateway-cpu`` puts a gateway under.

The cgroup files are written into a directory laid out as the kernel lays out each hierarchy (a
stand-in for /sys/fs/cgroup: the test may not write to the machine's); the CLI's refusal runs the
real command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtests import cpuquota

REPO = Path(__file__).resolve().parent.parent


def _v2(root: Path) -> Path:
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    return root


def _v1(root: Path) -> Path:
    (root / "unified").mkdir()
    (root / "unified" / "cgroup.controllers").write_text("\n")  # the hybrid layout: v2 without cpu
    (root / "cpu").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    return root / "cpu"


LAYOUTS = [
    pytest.param(_v2, {"cpu.max": "5000 10000\n"}, id="cgroup v2: cpu.max holds half of a 10 ms period"),
    pytest.param(
        _v1,
        {"cpu.cfs_period_us": "10000\n", "cpu.cfs_quota_us": "5000\n"},
        id="cgroup v1 beside a v2 mount without the cpu controller: period 10 ms, quota 5 ms",
    ),
]


@pytest.mark.parametrize(("layout", "files"), LAYOUTS)
def test_the_gateway_gets_its_share_and_the_group_goes_afterwards(
    tmp_path: Path, layout: object, files: dict[str, str]
) -> None:
    assert callable(layout)
    base = layout(tmp_path)
    with cpuquota.cpu_quota("gateway", 0.5, root=tmp_path) as group:
        assert group.parent == base
        for name, text in files.items():
            assert (group / name).read_text() == text
        cpuquota.join(group, 4242)
        assert (group / "cgroup.procs").read_text() == "4242\n"
        for name in [*files, "cgroup.procs"]:  # the kernel's files vanish with the group
            (group / name).unlink()
    assert not group.exists()


REFUSALS = [
    pytest.param(
        lambda root: None, 0.5, "no cgroup CPU controller", id="no CPU controller anywhere: refused"
    ),
    pytest.param(_v2, 0.0, "between 0.01 and 64", id="a share of 0: refused"),
]


@pytest.mark.parametrize(("layout", "fraction", "message"), REFUSALS)
def test_a_quota_it_cannot_set_is_refused_with_one_line(
    tmp_path: Path, layout: object, fraction: float, message: str
) -> None:
    assert callable(layout)
    layout(tmp_path)
    with (
        pytest.raises(cpuquota.CpuQuotaError, match=message),
        cpuquota.cpu_quota("gateway", fraction, root=tmp_path),
    ):
        pass


def test_overload_refuses_a_bad_share_before_starting_anything() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests", "overload", "--quick", "--gateway-cpu", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --gateway-cpu 0: give a share of CPUs between 0.01 and 64"
    )
    assert "starting" not in proc.stderr
