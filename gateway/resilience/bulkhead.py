"""A per-backend bulkhead: at most ``max_in_flight`` concurrent calls, the rest refused at once.

A refused call is not queued: queueing would spend the caller's deadline waiting for a backend
that is already saturated, which is exactly the cost bulkheads exist to cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class BulkheadToken:
    """One slot; ``Bulkhead.release`` frees it (a second release is a no-op)."""

    bulkhead: Bulkhead
    released: bool = field(default=False)


class Bulkhead:
    """A counter of calls in flight with a limit. Not thread-safe: used from one event loop."""

    __slots__ = ("in_flight", "max_in_flight")

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def try_acquire(self) -> BulkheadToken | None:
        """A slot, or None when ``max_in_flight`` calls are already in flight."""
        if self.in_flight >= self.max_in_flight:
            return None
        self.in_flight += 1
        return BulkheadToken(self)

    def release(self, token: BulkheadToken) -> None:
        if token.released or token.bulkhead is not self:
            return
        token.released = True
        self.in_flight -= 1

    def resize(self, max_in_flight: int) -> None:
        """A new limit from a reload; calls in flight stay counted (they may exceed it until done)."""
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
