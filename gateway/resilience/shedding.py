"""Overload shedding for the gateway itself: refuse to *start* a review that cannot finish in time.

Three predictors of "the gateway cannot start this review soon enough", kept so that they can be
measured side by side:

- ``in_flight``: more than ``max_in_flight`` reviews are being handled. Cheap and exact, but the
  right bound depends on the backends' latency and the machine.
- ``event_loop_lag``: the event loop runs callbacks later than asked by more than
  ``max_event_loop_lag`` seconds. The lag is what a new review would wait before its first step,
  whatever causes it (CPU, a slow backend's bytes, garbage collection).
- ``cpu``: the process used ``max_cpu_share`` or more of the CPU it may use over the last 100 ms
  (its CPU quota's share, at most one CPU: a pod's ``limits.cpu``). Under a CFS quota the loop
  shows no lag until the quota is spent, and then stops for the rest of the period (up to tens of
  milliseconds), long enough for the kube-apiserver to run out of idle connections and dial; this
  one sheds before that.

A shed review is answered at once as if every matched backend had a call error under its own
failurePolicy (HTTP 200): shedding never produces a decision the backends' policies would not. The
server passes the reason (``try_start``'s answer) to dispatch with the review, which refuses each
of its calls (``gateway.dispatch.invoke``).
The server feeds lag samples from a probe task (``observe_lag``) and gives the CPU measure
(``cpu_share``: the share of its budget the process used lately); this module does no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

from gateway.resilience.breaker import Clock

ShedReason = Literal["in_flight", "event_loop_lag", "cpu"]
SHED_REASONS: Final[tuple[ShedReason, ...]] = ("in_flight", "event_loop_lag", "cpu")

_SAMPLES: Final = 64  # lag samples kept; only those inside the window count


@dataclass(frozen=True, slots=True)
class ShedPolicy:
    """``None`` turns a predictor off; both off means never shed."""

    max_in_flight: int | None = None
    max_event_loop_lag: float | None = None  # seconds
    max_cpu_share: float | None = None  # of the CPU the process may use (1.0: all of it)
    lag_probe_interval: float = 0.05  # how often the server's probe asks to be woken (seconds)
    lag_window: float = 1.0  # how long one lag sample keeps counting (seconds)

    def __post_init__(self) -> None:
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if self.max_event_loop_lag is not None and self.max_event_loop_lag <= 0:
            raise ValueError("max_event_loop_lag must be > 0")
        if self.max_cpu_share is not None and not 0 < self.max_cpu_share <= 1:
            raise ValueError("max_cpu_share must be > 0 and <= 1")
        if self.lag_probe_interval <= 0 or self.lag_window <= 0:
            raise ValueError("lag_probe_interval and lag_window must be > 0")

    @property
    def enabled(self) -> bool:
        return (
            self.max_in_flight is not None
            or self.max_event_loop_lag is not None
            or self.max_cpu_share is not None
        )


@dataclass(eq=False, slots=True)
class ReviewSlot:
    """A review that was started; hand it back with ``Shedder.finish`` (twice is a no-op)."""

    finished: bool = field(default=False)


@dataclass(frozen=True, slots=True)
class Assessment:
    """What each predictor says now (each ``False`` when it is off)."""

    in_flight: bool
    event_loop_lag: bool
    cpu: bool

    @property
    def reason(self) -> ShedReason | None:
        """The first predictor that says shed (in-flight first: it is exact)."""
        if self.in_flight:
            return "in_flight"
        if self.event_loop_lag:
            return "event_loop_lag"
        if self.cpu:
            return "cpu"
        return None


class Shedder:
    """Counts reviews in flight and holds recent event-loop lag. Not thread-safe.

    ``cpu_share``: the share of the CPU it may use the process used lately (1.0: all of it), asked
    when ``policy.max_cpu_share`` is set (never shed for CPU without it)."""

    __slots__ = ("_clock", "_cpu_share", "_last_sample_at", "_samples", "in_flight", "policy")

    def __init__(
        self, policy: ShedPolicy, clock: Clock, cpu_share: Callable[[], float] | None = None
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._cpu_share = cpu_share
        self.in_flight = 0
        self._samples: deque[tuple[float, float]] = deque(maxlen=_SAMPLES)
        self._last_sample_at: float | None = None

    # --- event-loop lag ---

    def probe_started(self) -> None:
        """The probe is running: from now on its first sample can be overdue, like any later one."""
        self._last_sample_at = self._clock()

    def observe_lag(self, lag: float) -> None:
        """One probe result: the probe woke ``lag`` seconds later than it asked to."""
        now = self._clock()
        self._samples.append((now, max(0.0, lag)))
        self._last_sample_at = now

    def lag(self) -> float:
        """The lag a review starting now should expect: the worst recent sample, or how overdue the
        next probe already is (a loop blocked right now has not delivered its sample yet)."""
        if self._last_sample_at is None:
            return 0.0
        now = self._clock()
        horizon = now - self.policy.lag_window
        worst = max((lag for at, lag in self._samples if at >= horizon), default=0.0)
        overdue = now - self._last_sample_at - self.policy.lag_probe_interval
        return max(worst, overdue)

    # --- reviews ---

    def assess(self) -> Assessment:
        policy = self.policy
        cpu = policy.max_cpu_share
        return Assessment(
            in_flight=policy.max_in_flight is not None and self.in_flight >= policy.max_in_flight,
            event_loop_lag=policy.max_event_loop_lag is not None and self.lag() > policy.max_event_loop_lag,
            cpu=cpu is not None and self._cpu_share is not None and self._cpu_share() >= cpu,
        )

    def try_start(self) -> ReviewSlot | ShedReason:
        """Start a review (a slot to ``finish``), or the reason to shed it."""
        reason = self.assess().reason
        if reason is not None:
            return reason
        self.in_flight += 1
        return ReviewSlot()

    def finish(self, slot: ReviewSlot) -> None:
        if not slot.finished:
            slot.finished = True
            self.in_flight -= 1
