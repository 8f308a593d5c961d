"""A per-backend circuit breaker: a pure state machine over an injected clock.

Closed → (``consecutive_failures`` call errors in a row) → Open for ``open_seconds`` → Half-open:
exactly one probe call; its success closes the circuit, its failure opens it again. Only call
errors count (timeout, transport, HTTP status, malformed reply); a backend that *rejects* a review
has answered and is healthy. Every transition is returned to the caller, which reports it.

Why epochs: a call admitted while closed may finish after the circuit opened (or during the probe);
its result describes a past state of the backend and must not close or re-open the circuit. Each
permission carries the epoch it was granted in, and results from an older epoch are ignored.

Where the state lives: in a ``Cell`` (``gateway.resilience.cells``), one ``CircuitWord`` replaced
whole. The breaker reads the word on the hot path and writes only when something changes (a call
error, a transition, an answer after errors), through ``Cell.update`` with a pure change. With
``--workers N`` every worker's breaker of one backend has the same cell, so they are one circuit:
failures add up across workers, a circuit opened by one is open in all, and the half-open probe
is one call in total. The clock must then be the same in every process (``time.monotonic``).

A probe whose result never comes (its worker was killed) would keep the circuit half-open and
refusing for ever: a probe is given up after ``probe_lease`` seconds (longer than any call, whose
``timeoutSeconds`` is at most 30), and the next review probes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Final, NamedTuple

from gateway.resilience.cells import Cell, LocalCell

Clock = Callable[[], float]  # monotonic seconds (trio.current_time in the server, a counter in tests)

_MAX_ERROR_TEXT: Final = 200  # the last error is repeated in every refusal: keep it short
PROBE_LEASE_SECONDS: Final = 35.0  # > the longest call (timeoutSeconds <= 30): only a lost probe outlives it


class CircuitState(enum.IntEnum):
    """The gauge value of each state: 0 closed, 1 open, 2 half-open."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


class CircuitWord(NamedTuple):
    """A circuit's whole state, as its cell stores it (replaced whole, never changed in place)."""

    state: CircuitState = CircuitState.CLOSED
    epoch: int = 0  # +1 at every transition: results of permits from an older epoch are ignored
    failures: int = 0  # consecutive call errors (while closed), or those that opened the circuit
    opened_at: float = 0.0  # clock seconds when it last opened
    probe_until: float = 0.0  # half-open with a probe out: when the probe is given up (0: none out)
    last_error: str = ""


CLOSED_WORD: Final = CircuitWord()


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
    """One backend's circuit: the rules, over the word in ``cell``. Used from one event loop."""

    __slots__ = ("_clock", "cell", "consecutive_failures", "open_seconds", "probe_lease")

    def __init__(
        self,
        consecutive_failures: int,
        open_seconds: float,
        clock: Clock,
        cell: Cell[CircuitWord] | None = None,
        *,
        probe_lease: float = PROBE_LEASE_SECONDS,
    ) -> None:
        if consecutive_failures < 1 or open_seconds <= 0:
            raise ValueError("consecutive_failures must be >= 1 and open_seconds > 0")
        self.consecutive_failures = consecutive_failures
        self.open_seconds = open_seconds
        self.probe_lease = probe_lease
        self._clock = clock
        self.cell: Cell[CircuitWord] = cell if cell is not None else LocalCell(CLOSED_WORD)

    # --- reading ---

    @property
    def state(self) -> CircuitState:
        """The state as of now: an open circuit whose time is up reads as half-open."""
        word = self.cell.read()
        if word.state is CircuitState.OPEN and self._clock() >= word.opened_at + self.open_seconds:
            return CircuitState.HALF_OPEN
        return word.state

    @property
    def failures(self) -> int:
        """Consecutive call errors counted so far (while closed), or that opened the circuit."""
        return self.cell.read().failures

    @property
    def epoch(self) -> int:
        return self.cell.read().epoch

    # --- the protocol: admit, then record exactly one result per permit ---

    def admit(self) -> tuple[CallPermit | CircuitOpen, Transition | None]:
        """May a call be made now? Also returns the open → half-open transition when time is up."""
        word = self.cell.read()
        if word.state is CircuitState.CLOSED:
            return CallPermit(word.epoch), None  # the hot path: a read, no write
        now = self._clock()
        if word.state is CircuitState.OPEN and now < word.opened_at + self.open_seconds:
            return _refusal(word, word.opened_at + self.open_seconds), None
        if word.state is CircuitState.HALF_OPEN and word.probe_until > now:
            return _refusal(word, word.probe_until), None  # the probe is out
        return self.cell.update(partial(self._admit, now))

    def record_success(self, permit: CallPermit) -> Transition | None:
        """The backend answered (allowed, denied or patched): it is healthy."""
        word = self.cell.read()
        if permit.epoch != word.epoch or (word.failures == 0 and not permit.probe):
            return None  # the hot path: nothing to write
        return self.cell.update(partial(self._succeeded, permit))

    def record_failure(self, permit: CallPermit, error: str) -> Transition | None:
        """The call ended in a call error; ``error`` is its one-line message."""
        if permit.epoch != self.cell.read().epoch:
            return None
        error = error if len(error) <= _MAX_ERROR_TEXT else error[: _MAX_ERROR_TEXT - 1] + "…"
        return self.cell.update(partial(self._failed, permit, error))

    def record_abandoned(self, permit: CallPermit) -> None:
        """The call was cancelled before it had a result (caller gone, shadow call cut short).

        Says nothing about the backend; a probe's slot is freed so that the next review probes.
        """
        if permit.probe and permit.epoch == self.cell.read().epoch:
            self.cell.update(partial(_probe_abandoned, permit))

    def reconfigure(self, consecutive_failures: int, open_seconds: float) -> None:
        """New thresholds from a reload; the state (and an open period in progress) is kept."""
        if consecutive_failures < 1 or open_seconds <= 0:
            raise ValueError("consecutive_failures must be >= 1 and open_seconds > 0")
        self.consecutive_failures = consecutive_failures
        self.open_seconds = open_seconds

    # --- the changes (pure: word in, word and result out; they re-check what the caller read) ---

    def _admit(
        self, now: float, word: CircuitWord
    ) -> tuple[CircuitWord, tuple[CallPermit | CircuitOpen, Transition | None]]:
        transition = None
        if word.state is CircuitState.OPEN:
            retry_at = word.opened_at + self.open_seconds
            if now < retry_at:
                return word, (_refusal(word, retry_at), None)
            word = word._replace(state=CircuitState.HALF_OPEN, epoch=word.epoch + 1, probe_until=0.0)
            transition = Transition(CircuitState.OPEN, CircuitState.HALF_OPEN, now)
        if word.state is CircuitState.HALF_OPEN:
            if word.probe_until > now:
                return word, (_refusal(word, word.probe_until), transition)
            word = word._replace(probe_until=now + self.probe_lease)
            return word, (CallPermit(word.epoch, probe=True), transition)
        return word, (CallPermit(word.epoch), transition)  # closed by another process meanwhile

    def _succeeded(self, permit: CallPermit, word: CircuitWord) -> tuple[CircuitWord, Transition | None]:
        if permit.epoch != word.epoch:
            return word, None
        if permit.probe:
            now = self._clock()
            closed = CircuitWord(CircuitState.CLOSED, word.epoch + 1, 0, word.opened_at, 0.0, word.last_error)
            return closed, Transition(word.state, CircuitState.CLOSED, now)
        return (word._replace(failures=0) if word.failures else word), None

    def _failed(
        self, permit: CallPermit, error: str, word: CircuitWord
    ) -> tuple[CircuitWord, Transition | None]:
        if permit.epoch != word.epoch:
            return word, None
        failures = word.failures + 1  # consecutive since the circuit last closed: a failed probe adds one
        if permit.probe or failures >= self.consecutive_failures:
            now = self._clock()
            opened = CircuitWord(CircuitState.OPEN, word.epoch + 1, failures, now, 0.0, error)
            return opened, Transition(word.state, CircuitState.OPEN, now)
        return word._replace(failures=failures, last_error=error), None


def _refusal(word: CircuitWord, retry_at: float) -> CircuitOpen:
    return CircuitOpen(word.failures, word.last_error, retry_at)


def _probe_abandoned(permit: CallPermit, word: CircuitWord) -> tuple[CircuitWord, None]:
    if permit.epoch != word.epoch or not word.probe_until:
        return word, None
    return word._replace(probe_until=0.0), None
