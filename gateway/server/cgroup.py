"""The cgroup directories whose limits bind this process (what a container's limits are).

Used by ``workers.available_cpus`` (``cpu.max`` / ``cpu.cfs_quota_us``) and ``memory.memory_limit``
(``memory.max`` / ``memory.limit_in_bytes``): a limit set on any ancestor of the process's cgroup
binds it, so the tightest on the way up to the root counts. A container sees its own cgroup as ``/``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

__all__ = ["limit_directories"]


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
