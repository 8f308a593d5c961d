"""A per-backend circuit breaker: a pure state machine over an injected clock.

Closed → (``consecutive_failures`` call errors in a row) → Open for ``open_seconds`` → Half-open:
exactly one probe call; its success closes the circuit, its failure opens it again. Only call
errors count (timeout, transport, HTTP status, malformed reply); a backend that *rejects* a review
has answered and is healthy. Every transition is returned to the caller, which reports it.

Why epochs: a call admitted while closed may finish after the circuit opened (or during the probe);
its result describes a past state of the backend and must not close or re-open the circuit. Each
permission carries the epoch it was granted in, and results from an older epoch are ignored.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

Clock = Callable[[], float]  # monotonic seconds (trio.current_time in the server, a counter in tests)

_MAX_ERROR_TEXT: Final = 200  # the last error is repeated in every refusal: keep it short


class CircuitState(enum.IntEnum):
    """The gauge value of each state: 0 closed, 1 open, 2 half-open."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


@dataclass(frozen=True, slots=True)
class Transition:
    """The circuit moved ``previous`` → ``state`` at ``at`` (clock seconds)."""

    previous: CircuitState
    state: CircuitState
    at: float


@dataclass(slots=True, eq=False)  # not frozen: made once per call, and frozen init costs ~1 µs
class CallPermit:
    """Permission for one call; hand it back with ``record_*``. ``probe`` marks the half-open probe."""

    epoch: int
    probe: bool = False


@dataclass(frozen=True, slots=True)
class CircuitOpen:
    """No call now; ``message`` is the call error the review sees for this backend."""

    failures: int
    last_error: str
    retry_at: float  # clock seconds when a probe may be made (or the probe outstanding now ends)

    @property
    def message(self) -> str:
        return f"circuit open after {self.failures} consecutive failures (last: {self.last_error})"


class CircuitBreaker:
    """One backend's circuit. Not thread-safe: used from one event loop."""

    __slots__ = (
        "_clock",
        "_epoch",
        "_failures",
        "_last_error",
        "_opened_at",
        "_probe_out",
        "_state",
        "consecutive_failures",
        "open_seconds",
    )

    def __init__(self, consecutive_failures: int, open_seconds: float, clock: Clock) -> None:
        if consecutive_failures < 1 or open_seconds <= 0:
            raise ValueError("consecutive_failures must be >= 1 and open_seconds > 0")
        self.consecutive_failures = consecutive_failures
        self.open_seconds = open_seconds
        self._clock = clock
        self._state = CircuitState.CLOSED
        self._epoch = 0
        self._failures = 0
        self._last_error = ""
        self._opened_at = 0.0
        self._probe_out = False

    # --- reading ---

    @property
    def state(self) -> CircuitState:
        """The state as of now: an open circuit whose time is up reads as half-open."""
        if self._state is CircuitState.OPEN and self._clock() >= self._opened_at + self.open_seconds:
            return CircuitState.HALF_OPEN
        return self._state

    @property
    def failures(self) -> int:
        """Consecutive call errors counted so far (while closed), or that opened the circuit."""
        return self._failures

    # --- the protocol: admit, then record exactly one result per permit ---

    def admit(self) -> tuple[CallPermit | CircuitOpen, Transition | None]:
        """May a call be made now? Also returns the open → half-open transition when time is up."""
        transition = None
        if self._state is CircuitState.OPEN:
            now = self._clock()
            if now < self._opened_at + self.open_seconds:
                return self._refusal(self._opened_at + self.open_seconds), None
            transition = self._move(CircuitState.HALF_OPEN, now)
        if self._state is CircuitState.HALF_OPEN:
            if self._probe_out:
                return self._refusal(self._clock()), transition
            self._probe_out = True
            return CallPermit(self._epoch, probe=True), transition
        return CallPermit(self._epoch), transition

    def record_success(self, permit: CallPermit) -> Transition | None:
        """The backend answered (allowed, denied or patched): it is healthy."""
        if permit.epoch != self._epoch:
            return None
        self._failures = 0
        if permit.probe:
            self._probe_out = False
            return self._move(CircuitState.CLOSED, self._clock())
        return None

    def record_failure(self, permit: CallPermit, error: str) -> Transition | None:
        """The call ended in a call error; ``error`` is its one-line message."""
        if permit.epoch != self._epoch:
            return None
        self._last_error = error if len(error) <= _MAX_ERROR_TEXT else error[: _MAX_ERROR_TEXT - 1] + "…"
        self._failures += 1  # consecutive since the circuit last closed: a failed probe adds one
        if permit.probe:
            self._probe_out = False
            return self._open()
        if self._failures >= self.consecutive_failures:
            return self._open()
        return None

    def record_abandoned(self, permit: CallPermit) -> None:
        """The call was cancelled before it had a result (caller gone, shadow call cut short).

        Says nothing about the backend; a probe's slot is freed so that the next review probes.
        """
        if permit.epoch == self._epoch and permit.probe:
            self._probe_out = False

    def reconfigure(self, consecutive_failures: int, open_seconds: float) -> None:
        """New thresholds from a reload; the state (and an open period in progress) is kept."""
        if consecutive_failures < 1 or open_seconds <= 0:
            raise ValueError("consecutive_failures must be >= 1 and open_seconds > 0")
        self.consecutive_failures = consecutive_failures
        self.open_seconds = open_seconds

    # --- internals ---

    def _open(self) -> Transition:
        now = self._clock()
        self._opened_at = now
        return self._move(CircuitState.OPEN, now)

    def _refusal(self, retry_at: float) -> CircuitOpen:
        return CircuitOpen(self._failures, self._last_error, retry_at)

    def _move(self, state: CircuitState, now: float) -> Transition:
        previous = self._state
        self._state = state
        self._epoch += 1
        if state is CircuitState.CLOSED:
            self._failures = 0
        return Transition(previous, state, now)
