"""The memory the gateway may use, and giving back what a burst of connections left behind.

Two facts about memory decide how many connections the gateway may hold (``limits.connection_bounds``):

- **The limit.** In a container the kernel kills the process when its cgroup goes over
  ``memory.max`` (cgroup v2; ``memory.limit_in_bytes`` in v1), whatever the file-descriptor limit
  allows. ``memory_limit`` reads the tightest limit on the way from this process's cgroup to the
  root (a container sees its own cgroup as ``/``), as ``workers.available_cpus`` does for CPU.
  ``--memory-limit`` overrides it (tests, or a process outside any limit that should behave as
  if it had one).
- **Freed memory is not returned by itself.** Each connection's TLS state (OpenSSL's SSL object and
  its 16 KiB+ record buffers) and most of the Python objects of a connection larger than 512 bytes
  come from glibc's malloc. After a burst of connections ends, that memory is free inside malloc
  but stays resident: glibc gives memory back to the kernel only from the top of its heap, and a
  few objects allocated during the burst and still alive (a grown dict, a log buffer) pin
  everything below them. Measured (docs/inbound.md, "Memory"): 4,000 server-side TLS
  connections with a handshake begun cost 46 KB each; after they were closed, 170 MB stayed
  resident, and ``malloc_trim(0)`` brought it back to 3.6 MB. ``HeapTrimmer`` calls it after a
  burst: when the open connections have fallen well below their peak since the last trim. (The
  handshake no longer allocates that much before a client has sent its ClientHello:
  ``gateway.server.hypercorn.handshake``.)

glibc only: elsewhere (musl, macOS) ``HeapTrimmer`` does nothing and the limit still bounds the
connections.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import trio

from gateway.server.cgroup import limit_directories

# glibc's mallopt parameter: at most this many malloc arenas (-8 is M_ARENA_MAX).
_M_ARENA_MAX: Final = -8
# Values above this mean "no limit" (cgroup v1 writes PAGE_COUNTER_MAX pages as bytes).
_UNLIMITED: Final = 1 << 60


def memory_limit(
    *,
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> int | None:
    """The tightest cgroup memory limit on the way from this process's cgroup to the root, in bytes."""
    directories = limit_directories("memory", proc_cgroup=proc_cgroup, cgroup_root=cgroup_root)
    limits = [
        limit
        for version, directory in directories
        for limit in _read_limit(directory / ("memory.max" if version == 2 else "memory.limit_in_bytes"))
    ]
    return min(limits) if limits else None


def _read_limit(file: Path) -> Iterator[int]:
    try:
        text = file.read_text().strip()
    except OSError:
        return
    if text.isdigit() and 0 < int(text) < _UNLIMITED:
        yield int(text)


def physical_memory() -> int:
    """The machine's memory in bytes (what bounds a process outside any cgroup limit)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resident_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def parse_size(text: str) -> int:
    """``268435456``, ``256Mi``, ``1Gi``, ``512M`` (Kubernetes quantities, binary and decimal) in bytes."""
    units = {
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }
    text = text.strip()
    for suffix, factor in units.items():
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * factor
    if text.isdigit():
        return int(text)
    raise ValueError(f"{text!r} is not a size (bytes, or a number with Ki, Mi, Gi, k, M or G)")


class HeapTrimmer:
    """Gives the memory a burst of connections left inside glibc's malloc back to the kernel.

    ``connections_changed(open)`` is called whenever a connection closes (two comparisons). Once the
    open connections have fallen by ``drop`` or more from their peak since the last trim, and to
    half of it or less, ``run`` calls ``malloc_trim(0)``, at most once a second: it releases every
    free page of every malloc arena, also below the top of the heap. It runs in a thread (ctypes
    releases the GIL), because walking a large heap takes a while: 36 ms for the 170 MB that 4,000
    connections left behind, measured on this machine.
    """

    def __init__(self, *, drop: int = 256) -> None:
        self._trim = _malloc_trim()
        self._drop = drop
        self._peak = 0
        self._due = trio.Event()
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def connections_changed(self, open_connections: int) -> None:
        if open_connections > self._peak:
            self._peak = open_connections
        elif self._peak - open_connections >= self._drop and open_connections * 2 <= self._peak:
            self._peak = open_connections
            self._due.set()

    async def run(self) -> None:
        while True:
            await self._due.wait()
            self._due = trio.Event()
            await trio.to_thread.run_sync(self.trim)
            await trio.sleep(1.0)

    def trim(self) -> None:
        if self._trim is not None:
            self._trim(0)
            self.trims += 1


def _malloc_trim() -> Callable[[int], int] | None:
    libc = _glibc()
    return None if libc is None else libc.malloc_trim


def limit_malloc_arenas(arenas: int = 2) -> None:
    """At most ``arenas`` malloc arenas (glibc's default is 8 per core): threads share them.

    The gateway allocates on its event loop thread; its few helper threads (DNS lookups, the log
    writer) would each get an arena of their own, whose free memory ``malloc_trim`` also has to
    walk. The same as ``MALLOC_ARENA_MAX=2``, which container images of Java and Go programs set.
    """
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_ARENA_MAX, arenas)


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has malloc_trim as a no-op stub)
    except (OSError, AttributeError):
        return None
    return libc
