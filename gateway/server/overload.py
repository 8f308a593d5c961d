"""Overload shedding at the review entrance, and the event-loop lag probe that feeds it.

``OverloadGate.review()`` wraps the deciding of one review and yields the shed decision. When the
``Shedder`` says the gateway cannot start it in time, the review is still decided, but the server
passes the reason to dispatch (``Dispatcher.decide(..., shed=reason)``), which refuses every
backend call at once: each matched backend has a call error under its own failurePolicy, and the
caller gets HTTP 200 with that decision, never a 5xx (which would apply the gateway registration's
policy to every backend at once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

from gateway.resilience import ReviewSlot, Shedder, ShedPolicy


class OverloadGate:
    """The shedder with the trio clock, and its lag probe; ``on_shed(reason)`` counts shed reviews;
    ``cpu_share``: the process's CPU measure (``gateway.server.cgroup.CpuShare.share``)."""

    def __init__(
        self,
        policy: ShedPolicy,
        on_shed: Callable[[str], None] | None = None,
        cpu_share: Callable[[], float] | None = None,
    ) -> None:
        self.policy = policy
        self.shedder = Shedder(policy, trio.current_time, cpu_share)
        self._on_shed = on_shed

    @contextmanager
    def review(self) -> Iterator[str | None]:
        """Decide one review inside; yields the shed reason, or None when it runs normally."""
        decision = self.shedder.try_start()
        if isinstance(decision, ReviewSlot):
            try:
                yield None
            finally:
                self.shedder.finish(decision)
            return
        if self._on_shed is not None:
            self._on_shed(decision)
        yield decision

    def shed_reason(self) -> str | None:
        """Whether a review arriving now would be shed, and why; takes no slot, counts nothing."""
        return self.shedder.assess().reason

    def count_shed(self, reason: str) -> None:
        """A review was shed without ``review()`` (answered where it was read)."""
        if self._on_shed is not None:
            self._on_shed(reason)

    async def run_lag_probe(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sleep ``lag_probe_interval`` over and over; how late each wake-up is, is the loop's lag."""
        interval = self.policy.lag_probe_interval
        # A loop blocked before the first wake-up is lag too (the review may run before the probe).
        self.shedder.probe_started()
        task_status.started()
        while True:
            asked = trio.current_time() + interval
            await trio.sleep_until(asked)
            self.shedder.observe_lag(trio.current_time() - asked)
