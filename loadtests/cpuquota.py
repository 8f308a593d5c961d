"""A measured process on a share of one CPU (``overload --gateway-cpu F``): a CFS quota in a cgroup.

Why: one backend's overload at 3× needs a caller that sends three times what the gateway answers
on a CPU of its own, and on a 2-CPU machine the caller has only the other CPU. Giving the gateway
half a CPU halves its capacity, so the caller can offer 3× of it — and half a CPU is what a pod
with ``resources.limits.cpu: 500m`` gets, throttled the same way (the CFS bandwidth controller).
The period is 10 ms, so a throttled gateway waits at most ~10 ms for its next share (Kubernetes
uses 100 ms: its stalls are longer).

cgroup v2 (a ``cpu.max`` file) where the ``cpu`` controller is available, else v1
(``cpu.cfs_quota_us`` under the ``cpu`` hierarchy). Needs write access to the hierarchy (root, or
a delegated subtree); without it the run stops with one line before anything starts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

PERIOD_US: Final = 10_000


class CpuQuotaError(RuntimeError):
    """No cgroup hierarchy with a CPU controller this process may write to."""


def _hierarchy(root: Path) -> tuple[Path, str]:
    """Where to make the group, and its kind ("v2" or "v1")."""
    for v2 in (root, root / "unified"):
        controllers = v2 / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return v2, "v2"
    v1 = root / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, "v1"
    raise CpuQuotaError(
        f"--gateway-cpu: no cgroup CPU controller under {root} (v2 cpu.max or v1 cpu.cfs_quota_us)"
    )


@contextlib.contextmanager
def cpu_quota(name: str, fraction: float, *, root: Path = Path("/sys/fs/cgroup")) -> Iterator[Path]:
    """A cgroup that lets its processes use ``fraction`` of one CPU; removed afterwards.

    Put a process in it with ``join(group, pid)``. The group is removed once empty (its processes
    ended or moved out); a group still busy at exit is left for the kernel to clean up with them.
    """
    if not 0.01 <= fraction <= 64:
        raise CpuQuotaError(f"--gateway-cpu {fraction:g}: give a share of CPUs between 0.01 and 64")
    base, kind = _hierarchy(root)
    group = base / f"webhook-gateway-loadtest-{name}-{os.getpid()}"
    quota = max(1000, round(fraction * PERIOD_US))
    try:
        group.mkdir(exist_ok=True)
        if kind == "v2":
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
        else:
            (group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    except OSError as exc:
        raise CpuQuotaError(
            f"--gateway-cpu: cannot set a CPU quota in {group}: {exc.strerror or exc}"
        ) from exc
    try:
        yield group
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


def join(group: Path, pid: int) -> None:
    """Move ``pid`` (all its threads) into ``group``."""
    (group / "cgroup.procs").write_text(f"{pid}\n")


def throttled_seconds(group: Path) -> float:
    """How long the group's processes were held back by the quota so far (``cpu.stat``)."""
    fields = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines() if " " in line)
    if "throttled_usec" in fields:  # v2
        return int(fields["throttled_usec"]) / 1e6
    return int(fields.get("throttled_time", 0)) / 1e9  # v1: nanoseconds
