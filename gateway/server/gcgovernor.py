"""When the serving gateway makes its full garbage collections: when it is quiet, or at a bound.

A full (generation-2) collection scans every object the cyclic collector tracks outside the frozen
start-up set, and with 1,000-4,000 connections open that is 300-800 ms of the event loop
(docs/performance.md, "Garbage collection"). CPython starts one by itself after every N collections
of the middle generation, whatever the process is doing, and under load that is every few seconds:
a stall that delays every review due meanwhile and makes the apiserver dial new connections.
Closed connections leave no reference cycles (tests/test_server_memory.py), so such a collection
finds almost nothing.

So once serving, CPython's own full collections are off (the oldest generation's threshold out of
reach) and this governor makes them instead:

- ``quiet``: no request in flight, no connection being established (a TLS handshake under way:
  under a dial storm the loop is busy with those while no request is in flight), no request read
  for ``quiet_seconds``, and at least ``min_young_collections`` collections of the middle
  generation since the last full one (as many allocations as CPython's own threshold before: a
  full collection is not worth making for less);
- ``interval``: ``max_interval`` seconds since the last full collection, busy or not;
- ``growth``: the resident set grew above its lowest point since the last full collection by
  ``max_growth_bytes`` or by ``max_growth_ratio`` of that low point, whichever is more, beyond
  what the connections explain, busy or not — so a real reference-cycle leak still cannot grow
  memory without bound, while a burst of connections (whose memory the connection bounds already
  limit, ``limits.connection_bounds``) does not force a collection at its peak, when it would take
  longest. The connections explain ``connection_cost`` (the bounds' 64 KiB) for each one by which
  their *peak* since that low point exceeds their number then: memory a closed connection freed
  stays resident in malloc for the next one, so counting the connections open *now* would call
  every close growth (measured: a full collection every ~0.5 s at 80 % of capacity, each finding
  nothing).

The bounds apply only when something reached the oldest generation since the last full collection
(a collection of the middle generation happened): otherwise a full one could free nothing new.

``GcGovernor`` is the decision, over the clock and counters it is given; ``govern`` is the task that
feeds it from the listener's counters and ``gc``, and hands the thresholds back when it ends.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

import structlog
import trio

from gateway.server.limits import CONNECTION_COST

GcReason = Literal["quiet", "interval", "growth"]
GC_REASONS: Final[tuple[GcReason, ...]] = ("quiet", "interval", "growth")

# While serving, the youngest generation is collected after 10,000 net allocations (CPython: 700),
# the middle one after 10 of those (as CPython), and the oldest never by CPython itself
# (``gc.get_count()[2]`` counts middle-generation collections: one every ~100,000 allocations).
#
# Speed: with many reviews in flight, a review's objects outlive the young collection that comes
# after them, so their deallocations no longer offset the allocations that count towards the next:
# at 700 a collection came every ~15 reviews and found them alive — 17 % of the CPU with 512 in flight
# over kept connections, 12-19 % in a collapse — and then the middle generation's collection scanned
# them again (up to ~120 ms waiting for a CPU). At 10,000: 0.8 %, with the longest pause no longer
# than the middle generation's was (docs/performance.md, "Garbage collection"). A quiet gateway's
# objects die young whatever the threshold, and reference cycles are rare (closed connections leave
# none), so garbage waits for at most 10,000 allocations more.
GEN0_THRESHOLD: Final = 10_000
GEN1_THRESHOLD: Final = 10
NEVER: Final = 1 << 30

log = structlog.get_logger("gateway.server")


@dataclass(frozen=True, slots=True)
class GcPolicy:
    """When a full collection is made (seconds, bytes); ``poll_interval``: how often it is asked."""

    quiet_seconds: float = 0.1
    min_young_collections: int = 7  # x 10 x GEN0_THRESHOLD: ~700,000 allocations, CPython's own count before
    max_interval: float = 300.0
    max_growth_bytes: int = 64 << 20
    max_growth_ratio: float = 0.5
    connection_cost: int = CONNECTION_COST  # bytes of the resident set one more connection explains
    poll_interval: float = 0.05

    def __post_init__(self) -> None:
        if min(self.quiet_seconds, self.max_interval, self.poll_interval) <= 0:
            raise ValueError("quiet_seconds, max_interval and poll_interval must be > 0")
        if self.min_young_collections < 1 or self.max_growth_bytes < 1:
            raise ValueError("min_young_collections and max_growth_bytes must be >= 1")
        if self.max_growth_ratio < 0 or self.connection_cost < 0:
            raise ValueError("max_growth_ratio and connection_cost must be >= 0")


@dataclass(eq=False, slots=True)
class GcGovernor:
    """The decision: ``observe`` the listener each poll, ask ``due``, report ``collected``. No I/O."""

    policy: GcPolicy
    last_full_at: float  # when the last full collection ended (or the governor started)
    lowest_rss: int  # the lowest resident set seen since then
    connections_at_lowest: int = 0  # inbound connections open at that lowest point
    peak_connections: int = 0  # the most open at once since that lowest point
    busy_at: float = -float("inf")  # the last time a request was seen in flight or read
    collections: dict[GcReason, int] = field(default_factory=lambda: dict.fromkeys(GC_REASONS, 0))
    pause_seconds: float = 0.0  # all full collections' pauses together
    longest_pause: float = 0.0

    @classmethod
    def start(cls, policy: GcPolicy, now: float, rss: int, connections: int = 0) -> GcGovernor:
        governor = cls(policy, last_full_at=now, lowest_rss=rss, busy_at=now)
        governor.connections_at_lowest = governor.peak_connections = connections
        return governor

    def observe(self, now: float, *, in_flight: int, last_request_at: float, establishing: int = 0) -> None:
        """What the listener says now: requests in flight, when the last one was read, connections
        being established."""
        if in_flight or establishing:
            self.busy_at = now
        elif last_request_at > self.busy_at:
            self.busy_at = last_request_at

    def due(self, now: float, *, young: int, rss: int, connections: int = 0) -> GcReason | None:
        """Why a full collection should run now, or None. ``young``: middle-generation collections
        since the last full one (``gc.get_count()[2]``); ``rss``: the resident set in bytes;
        ``connections``: inbound connections open now."""
        if rss < self.lowest_rss:
            self._lowest(rss, connections)
        elif connections > self.peak_connections:
            self.peak_connections = connections
        if young < 1:
            return None  # nothing reached the oldest generation: a full collection frees nothing new
        policy = self.policy
        explained = policy.connection_cost * (self.peak_connections - self.connections_at_lowest)
        bound = max(policy.max_growth_bytes, policy.max_growth_ratio * self.lowest_rss)
        if rss - self.lowest_rss - explained >= bound:
            return "growth"
        if now - self.last_full_at >= policy.max_interval:
            return "interval"
        if young >= policy.min_young_collections and now - self.busy_at >= policy.quiet_seconds:
            return "quiet"
        return None

    def collected(
        self, reason: GcReason, *, now: float, rss: int, pause: float, connections: int = 0
    ) -> None:
        """A full collection ran for ``reason``, ended at ``now`` and took ``pause`` seconds."""
        self.collections[reason] += 1
        self.pause_seconds += pause
        self.longest_pause = max(self.longest_pause, pause)
        self.last_full_at = now
        self._lowest(rss, connections)

    def _lowest(self, rss: int, connections: int) -> None:
        self.lowest_rss = rss
        self.connections_at_lowest = self.peak_connections = connections


async def govern(
    governor: GcGovernor,
    requests: Callable[[], tuple[int, float, int]],
    connections: Callable[[], int],
    *,
    rss: Callable[[], int] | None = None,
    on_collected: Callable[[GcReason, float], object] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Turn CPython's own full collections off and make them when ``governor`` says, until cancelled;
    then give the process its thresholds back. ``requests()``: (requests in flight, trio time the
    last one was read, connections being established); ``connections()``: inbound connections open;
    ``rss()``: the resident set (default: read from ``/proc/self/statm`` through a descriptor opened
    once, so that polling needs none while the process is out of them); ``on_collected(reason, pause
    seconds)``: after each full collection (metrics)."""
    statm = os.open("/proc/self/statm", os.O_RDONLY) if rss is None else -1
    resident = rss if rss is not None else _statm_reader(statm)
    previous = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, NEVER)
    task_status.started()
    try:
        while True:
            await trio.sleep(governor.policy.poll_interval)
            now = trio.current_time()
            in_flight, last_request_at, establishing = requests()
            governor.observe(
                now, in_flight=in_flight, last_request_at=last_request_at, establishing=establishing
            )
            reason = governor.due(now, young=gc.get_count()[2], rss=resident(), connections=connections())
            if reason is None:
                continue
            started = time.perf_counter()
            found = gc.collect(2)
            pause = time.perf_counter() - started
            governor.collected(
                reason, now=trio.current_time(), rss=resident(), pause=pause, connections=connections()
            )
            if on_collected is not None:
                on_collected(reason, pause)
            if reason != "quiet":  # rare by design: say why the loop stalled
                log.info("full garbage collection", reason=reason, ms=round(1e3 * pause, 1), found=found)
    finally:
        gc.set_threshold(*previous)
        if statm >= 0:
            os.close(statm)


def _statm_reader(fd: int) -> Callable[[], int]:
    """The resident set from ``/proc/self/statm`` open as ``fd`` (the file is generated anew at each
    read from offset 0); when a read fails, the last reading stands."""
    page = os.sysconf("SC_PAGE_SIZE")
    last = [0]

    def resident() -> int:
        with contextlib.suppress(OSError, ValueError, IndexError):
            last[0] = int(os.pread(fd, 64, 0).split()[1]) * page
        return last[0]

    return resident
