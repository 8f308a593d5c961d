"""A per-backend bulkhead: at most ``max_in_flight`` concurrent calls, the rest refused at once.

A refused call is not queued: queueing would spend the caller's deadline waiting for a backend
that is already saturated, which is exactly the cost bulkheads exist to cut.

The count lives in a ``Counter`` (``gateway.resilience.cells``): this process's own, or with
``--workers N`` one shared by every worker, whose total is every worker's calls in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.resilience.cells import Counter, LocalCounter


@dataclass(eq=False, slots=True)
class BulkheadToken:
    """One slot; ``Bulkhead.release`` frees it (a second release is a no-op)."""

    bulkhead: Bulkhead
    counter: Counter  # the one it was counted in (a reload may give the bulkhead another)
    released: bool = field(default=False)


class Bulkhead:
    """A counter of calls in flight with a limit. Not thread-safe: used from one event loop."""

    __slots__ = ("counter", "max_in_flight")

    def __init__(self, max_in_flight: int, counter: Counter | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self.counter: Counter = counter if counter is not None else LocalCounter()

    @property
    def in_flight(self) -> int:
        return self.counter.total()

    def try_acquire(self) -> BulkheadToken | None:
        """A slot, or None when ``max_in_flight`` calls are already in flight."""
        counter = self.counter
        if counter.total() >= self.max_in_flight:
            return None
        counter.add(1)
        return BulkheadToken(self, counter)

    def release(self, token: BulkheadToken) -> None:
        if token.released or token.bulkhead is not self:
            return
        token.released = True
        token.counter.add(-1)

    def resize(self, max_in_flight: int) -> None:
        """A new limit from a reload; calls in flight stay counted (they may exceed it until done)."""
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
