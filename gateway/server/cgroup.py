"""The cgroup directories whose limits bind this process (what a container's limits are).

Used for CPU (``cpu_quota``, ``cpu_share``: ``cpu.max`` / ``cpu.cfs_quota_us``; by
``workers.available_cpus``, and as the budget ``CpuShare`` measures the process's CPU against for
the inbound handshake gate and overload shedding, read again while serving by ``CpuBudget``) and
by ``memory.memory_limit`` (``memory.max`` / ``memory.limit_in_bytes``): a limit set on any
ancestor of the process's cgroup binds it, so the tightest on the way up to the root counts. A
container sees its own cgroup as ``/``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import trio

__all__ = ["CpuBudget", "CpuShare", "cpu_quota", "cpu_share", "limit_directories"]

CPU_WINDOW = 0.1  # seconds: what ``CpuShare`` measures over, at least
BUDGET_REFRESH = 1.0  # seconds: how often ``CpuBudget`` reads the limits again, at most

_PROC_CGROUP = Path("/proc/self/cgroup")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota(*, proc_cgroup: Path = _PROC_CGROUP, cgroup_root: Path = _CGROUP_ROOT) -> float | None:
    """The tightest CPU quota (in CPUs) on the way from this process's cgroup up to the root."""
    limits = [
        limit
        for version, directory in limit_directories("cpu", proc_cgroup=proc_cgroup, cgroup_root=cgroup_root)
        for limit in (_v2_limit(directory / "cpu.max") if version == 2 else _v1_limit(directory))
    ]
    return min(limits) if limits else None


def cpu_share(
    processes: int = 1,
    *,
    affinity: int | None = None,
    proc_cgroup: Path = _PROC_CGROUP,
    cgroup_root: Path = _CGROUP_ROOT,
) -> float:
    """The CPU time one of ``processes`` processes may use, in CPUs: the CPUs in its affinity mask,
    capped by the cgroup's quota, shared equally, and at most one (a process runs one event loop)."""
    cpus: float = affinity if affinity is not None else len(os.sched_getaffinity(0))
    quota = cpu_quota(proc_cgroup=proc_cgroup, cgroup_root=cgroup_root)
    if quota is not None:
        cpus = min(cpus, quota)
    return min(1.0, cpus / max(1, processes))


class CpuBudget:
    """The CPUs this process may use now (``cpu_share``), read again at most every ``refresh`` seconds.

    A pod's CPU limit can change while it runs: an in-place resize (``kubectl patch pod ...
    --subresource resize``) rewrites its container's ``cpu.max``, and the CPUs it may run on can
    change with it. Read once at start, a budget would stay what it was: half a CPU measured
    against a whole one never looks busy. Reading costs a few file reads, so it is done when asked
    and at most once per ``refresh`` seconds; ``on_change(before, now)`` is called when it changed.
    Called (``budget()``) by every ``CpuShare`` of the process's listener and overload gate.
    """

    __slots__ = ("_clock", "_on_change", "_read", "_read_at", "_refresh", "_value")

    def __init__(
        self,
        read: Callable[[], float],
        *,
        refresh: float = BUDGET_REFRESH,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[float, float], object] | None = None,
    ) -> None:
        self._read = read
        self._refresh = refresh
        self._clock = clock
        self._on_change = on_change
        self._value = read()
        self._read_at = clock()

    def __call__(self) -> float:
        now = self._clock()
        if now - self._read_at >= self._refresh:
            self._read_at = now
            value = self._read()
            if value != self._value:
                before, self._value = self._value, value
                if self._on_change is not None:
                    self._on_change(before, value)
        return self._value


class CpuShare:
    """How much of the CPU it may use this process used lately: 1.0 is its whole ``budget``.

    ``budget``: the CPUs this process may use (``cpu_share``), or what says it when asked
    (``CpuBudget``: read again while the process runs). The share is the process's CPU time
    (``cpu``, all its threads) over the wall time (``clock``) since it was last measured, measured
    again when at least ``window`` seconds have passed since; so it covers the last ``window``
    seconds or more, and costs one clock read when asked more often. After a quiet spell the first
    measure covers the spell. Asked by the inbound handshake gate (``HandshakeGate``'s ``busy``)
    and by overload shedding (``--shed-max-cpu``).
    """

    __slots__ = ("_budget", "_clock", "_cpu", "_share", "_since", "_spent", "_window")

    def __init__(
        self,
        budget: float | Callable[[], float],
        *,
        window: float = CPU_WINDOW,
        clock: Callable[[], float] = trio.current_time,
        cpu: Callable[[], float] = time.process_time,
    ) -> None:
        if not callable(budget) and budget <= 0:
            raise ValueError("budget must be > 0")
        self._budget = budget if callable(budget) else partial(float, budget)
        self._window = window
        self._clock = clock
        self._cpu = cpu
        self._since = clock()
        self._spent = cpu()
        self._share = 0.0

    def share(self) -> float:
        now = self._clock()
        if now - self._since >= self._window:
            spent = self._cpu()
            self._share = (spent - self._spent) / (now - self._since) / self._budget()
            self._since, self._spent = now, spent
        return self._share


def _v2_limit(cpu_max: Path) -> Iterator[float]:
    try:
        quota, _, period = cpu_max.read_text().strip().partition(" ")
    except OSError:
        return
    if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
        yield int(quota) / int(period)


def _v1_limit(directory: Path) -> Iterator[float]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return
    if quota > 0 and period > 0:
        yield quota / period


def limit_directories(controller: str, *, proc_cgroup: Path, cgroup_root: Path) -> Iterator[tuple[int, Path]]:
    """(cgroup version, directory) for every directory from this process's cgroup up to the root
    where ``controller``'s limits may be set: cgroup v2's unified tree, or v1's mount of the
    controller (``cpu,cpuacct``, ``cpu`` or ``memory``, as mounted). Nothing when unreadable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2: "0::/path"
            for directory in _ancestors(cgroup_root, path):
                yield 2, directory
        elif controller in controllers.split(","):  # cgroup v1: "4:cpu,cpuacct:/path"
            # as the line names it, else the usual mount points ("cpu,cpuacct" is mounted as such)
            mounts = (controllers, "cpu,cpuacct", controller) if controller == "cpu" else (controllers,)
            mount = next((cgroup_root / m for m in mounts if (cgroup_root / m).is_dir()), None)
            if mount is not None:
                for directory in _ancestors(mount, path):
                    yield 1, directory


def _ancestors(root: Path, path: str) -> Iterator[Path]:
    """``root/a/b``, ``root/a``, ``root``."""
    parts = [p for p in path.split("/") if p and p != ".."]
    for depth in range(len(parts), -1, -1):
        yield root.joinpath(*parts[:depth])
