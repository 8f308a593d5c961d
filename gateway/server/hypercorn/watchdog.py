"""``Watchdog`` replaces the keep-alive idle task of hypercorn's ``TCPServer`` (a ``TrioSingleTask``
cancelled and restarted around every request): one deadline per connection that moves — the request
head's, the keep-alive idle one, or none while a request is in flight — kept by one timer task for
the whole listener (``Deadlines``).

Reasons:

- **Limits.** It enforces ``--header-read-timeout`` (the TLS handshake and a request head must
  arrive in time) and ``--idle-timeout``, and it is how the listener reaches a connection when it
  starts draining or terminating (``poke``).
- **Measured speed.** hypercorn cancelled a task and started a new one (under a lock, with
  ``nursery.start``) twice per request; moving one deadline cost ~40 µs less per review
  (docs/performance.md, "The keep-alive idle timer is one task per connection"). A timer task per
  connection still cost every new connection a task start, a cancel scope, a wait on the
  listener's termination event and a cancellation when it closed; one task for all of them, with
  the deadlines in buckets of ``RESOLUTION`` seconds, costs a new connection a set insertion
  (``python benchmarks/bench_connection.py``; docs/inbound.md, "What a new connection costs").
  A deadline fires at most ``RESOLUTION`` late.

Byte-level tests: tests/test_server_hypercorn.py (keep-alive over real sockets) and
tests/test_server_inbound.py (slow heads, idle connections, draining).
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Final

import trio

if TYPE_CHECKING:
    from gateway.server.hypercorn.tcp_server import GatewayTCPServer

__all__ = ["RESOLUTION", "Deadlines", "Watchdog"]

# Deadlines are kept in buckets this many seconds wide; one fires at the end of its bucket.
RESOLUTION: Final = 0.05


class Watchdog:
    """The deadline of one connection: header, idle, or none while busy; ``poke`` for draining."""

    __slots__ = ("_bucket", "_deadlines", "_server", "deadline", "reason")

    def __init__(self, server: GatewayTCPServer, deadlines: Deadlines | None) -> None:
        self._server: GatewayTCPServer | None = server
        self._deadlines = deadlines
        self._bucket = 0  # the bucket it is in (``Deadlines``); 0: none
        self.deadline = math.inf
        self.reason = ""

    def set(self, deadline: float, reason: str) -> None:
        self.deadline, self.reason = deadline, reason
        if self._deadlines is not None:
            self._deadlines.schedule(self, deadline)

    def poke(self) -> None:
        """The listener started draining or terminating: the connection reacts (``lifecycle``)."""
        server = self._server
        if server is not None:
            server.spawn_lifecycle()

    def release(self) -> None:
        """The connection has closed: forget it (``GatewayTCPServer._release``)."""
        self.stop()
        self._server = None

    def stop(self) -> None:
        """Nothing is left to time out (the client went away, or the connection closed)."""
        self.deadline, self.reason = math.inf, ""
        if self._deadlines is not None:
            self._deadlines.schedule(self, math.inf)

    def expired(self) -> None:
        """Its bucket's time has come (``Deadlines.run``): its deadline, in that bucket, has passed."""
        server = self._server
        if server is not None:
            server.abort(self.reason)


class Deadlines:
    """The connections' deadlines of one listener, and the one task that enforces them.

    A deadline goes into the bucket of ``RESOLUTION`` seconds it falls in (a set per bucket, the
    buckets' numbers in a heap); moving it is a set removal and insertion, and only a bucket new to
    the heap is a heap push (at most one per ``RESOLUTION``). The task sleeps until the earliest
    bucket's end, then tells each watchdog in it (``Watchdog.expired``).
    """

    __slots__ = ("_buckets", "_heap", "_scope")

    def __init__(self) -> None:
        self._buckets: dict[int, set[Watchdog]] = {}
        self._heap: list[int] = []
        self._scope: trio.CancelScope | None = None

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def schedule(self, watchdog: Watchdog, deadline: float) -> None:
        bucket = 0 if deadline == math.inf else math.ceil(deadline / RESOLUTION)
        old = watchdog._bucket
        if old == bucket:
            return
        if old:
            members = self._buckets.get(old)
            if members is not None:
                members.discard(watchdog)
        watchdog._bucket = bucket
        if not bucket:
            return
        members = self._buckets.get(bucket)
        if members is None:
            members = self._buckets[bucket] = set()
            heapq.heappush(self._heap, bucket)
            scope = self._scope
            if scope is not None and bucket * RESOLUTION < scope.deadline:
                scope.deadline = bucket * RESOLUTION
        members.add(watchdog)

    async def run(self) -> None:
        """Enforce the deadlines until cancelled (the listener's lifetime)."""
        heap, buckets = self._heap, self._buckets
        while True:
            with trio.CancelScope(deadline=heap[0] * RESOLUTION if heap else math.inf) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None
            now = trio.current_time()
            while heap and heap[0] * RESOLUTION <= now:
                for watchdog in buckets.pop(heapq.heappop(heap), ()):
                    watchdog._bucket = 0
                    watchdog.expired()
