"""Per-backend guards (circuit breaker + bulkhead + mode), kept across configuration reloads.

The dispatch drivers ask ``BackendGuard.before_call`` before each backend call and report the
result after it; a ``Refusal`` is a call error for that backend under its own failurePolicy, made
at once. ``BackendGuards`` holds one guard per backend identity; ``reconcile`` applies a new
configuration in place, so that a reload keeps the circuit and the in-flight count of every
backend that is still there (the state lives in the backend, not in the configuration).

With a ``CellStore`` (``--workers N``: ``gateway.server.shared_state``), every circuit's word lives
in the store under its ``backend_key``, shared by every worker: ``reconcile`` attaches the backends
with a circuit breaker and releases those gone (or whose breaker was turned off). A backend the
store has no room for keeps a circuit of its own in this process (``circuits`` says which).
Likewise with a ``CounterStore`` for the bulkheads: ``maxInFlight`` then bounds the calls in flight
of all workers together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

from gateway.config.backend_policy import DEFAULT_POLICY, BackendMode, BackendPolicy
from gateway.config.model import Webhook
from gateway.resilience.breaker import (
    CallPermit,
    CircuitBreaker,
    CircuitState,
    CircuitWord,
    Clock,
    Transition,
)
from gateway.resilience.bulkhead import Bulkhead, BulkheadToken
from gateway.resilience.cells import CellStore, CounterStore

RefusalReason = Literal["circuit_open", "max_in_flight"]
REFUSAL_REASONS: Final[tuple[RefusalReason, ...]] = ("circuit_open", "max_in_flight")

BackendKey = tuple[str, ...]
TransitionListener = Callable[[str, Transition], None]  # (webhook name, transition)


def backend_key(webhook: Webhook) -> BackendKey:
    """A backend's identity across reloads: its place in the configuration and where it is called.

    Changing a webhook's URL or service makes it a new backend whose health is not yet known.
    """
    cc = webhook.client_config
    if cc.service is not None:
        s = cc.service
        target = f"service:{s.namespace}/{s.name}:{s.port}{s.path or ''}"
    else:
        target = f"url:{cc.url or ''}"
    return (webhook.kind, webhook.identity, target)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The call is not made; ``message`` is its call error (``failed calling webhook "<name>": …``)."""

    reason: RefusalReason
    message: str


@dataclass(slots=True, eq=False)  # not frozen: made once per call, and frozen init costs ~1 µs
class Pass:
    """A call may be made; give it back to ``BackendGuard.succeeded/failed/abandoned`` once."""

    breaker: CircuitBreaker | None = None
    permit: CallPermit | None = None
    bulkhead: Bulkhead | None = None
    token: BulkheadToken | None = None


_FREE_PASS: Final = Pass()  # a backend without breaker and bulkhead: nothing to hand back


class BackendGuard:
    """One backend's protections; ``policy`` is the configuration in force for it."""

    __slots__ = ("_clock", "_listener", "breaker", "bulkhead", "name", "policy")

    def __init__(
        self, name: str, policy: BackendPolicy, clock: Clock, listener: TransitionListener | None
    ) -> None:
        self.name = name
        self.policy = policy
        self._clock = clock
        self._listener = listener
        self.breaker: CircuitBreaker | None = None
        self.bulkhead: Bulkhead | None = None
        self.reconfigure(policy)

    @property
    def mode(self) -> BackendMode:
        return self.policy.mode

    @property
    def circuit_state(self) -> CircuitState:
        return self.breaker.state if self.breaker is not None else CircuitState.CLOSED

    def before_call(self) -> Pass | Refusal:
        """Check the circuit, then take a bulkhead slot; a refusal costs the backend nothing."""
        breaker, bulkhead = self.breaker, self.bulkhead
        if breaker is None and bulkhead is None:
            return _FREE_PASS
        permit = None
        if breaker is not None:
            admitted, transition = breaker.admit()
            self._report(transition)
            if not isinstance(admitted, CallPermit):
                return Refusal("circuit_open", admitted.message)
            permit = admitted
        token = None
        if bulkhead is not None:
            token = bulkhead.try_acquire()
            if token is None:
                if breaker is not None and permit is not None:
                    breaker.record_abandoned(permit)  # a refused probe must not block the next one
                limit = bulkhead.max_in_flight
                return Refusal("max_in_flight", f"{limit} calls already in flight (maxInFlight {limit})")
        return Pass(breaker, permit, bulkhead, token)

    def succeeded(self, passed: Pass) -> None:
        """The backend answered (allowed, denied, patched): a healthy backend."""
        self._release(passed)
        if passed.breaker is not None and passed.permit is not None:
            self._report(passed.breaker.record_success(passed.permit))

    def failed(self, passed: Pass, error: str) -> None:
        """The call ended in a call error (timeout, transport, status, malformed reply)."""
        self._release(passed)
        if passed.breaker is not None and passed.permit is not None:
            self._report(passed.breaker.record_failure(passed.permit, error))

    def abandoned(self, passed: Pass) -> None:
        """The call was cancelled without a result (caller gone, shadow call cut short)."""
        self._release(passed)
        if passed.breaker is not None and passed.permit is not None:
            passed.breaker.record_abandoned(passed.permit)

    # --- internals ---

    def _release(self, passed: Pass) -> None:
        if passed.bulkhead is not None and passed.token is not None:
            passed.bulkhead.release(passed.token)

    def _report(self, transition: Transition | None) -> None:
        if transition is not None and self._listener is not None:
            self._listener(self.name, transition)

    def reconfigure(self, policy: BackendPolicy) -> None:
        """Install ``policy``, keeping the state of the protections it keeps."""
        clock = self._clock
        self.policy = policy
        cb = policy.circuit_breaker
        if cb is None:
            self.breaker = None
        elif self.breaker is None:
            self.breaker = CircuitBreaker(cb.consecutive_failures, cb.open_seconds, clock)
        else:
            self.breaker.reconfigure(cb.consecutive_failures, cb.open_seconds)
        limit = policy.max_in_flight
        if limit is None:
            self.bulkhead = None
        elif self.bulkhead is None:
            self.bulkhead = Bulkhead(limit)
        else:
            self.bulkhead.resize(limit)


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What a reload did to the guards (for a log line)."""

    added: int
    kept: int
    removed: int


class BackendGuards:
    """The guards of every configured backend, by ``backend_key``. Not thread-safe.

    ``cells``, ``in_flight``: where the circuits' state and the bulkheads' counts live when they are
    shared with other processes.
    """

    def __init__(
        self,
        clock: Clock,
        on_transition: TransitionListener | None = None,
        cells: CellStore[CircuitWord] | None = None,
        in_flight: CounterStore | None = None,
    ) -> None:
        self._clock = clock
        self._listener = on_transition
        self._cells = cells
        self._in_flight = in_flight
        self._guards: dict[BackendKey, BackendGuard] = {}
        self._shared: set[BackendKey] = set()  # keys whose circuit is a cell of ``cells``
        self._counted: set[BackendKey] = set()  # keys whose bulkhead counts in ``in_flight``

    def __len__(self) -> int:
        return len(self._guards)

    def get(self, key: BackendKey) -> BackendGuard | None:
        return self._guards.get(key)

    def for_webhook(self, webhook: Webhook) -> BackendGuard:
        """The guard of a configured backend (one is made on the fly if reconcile has not seen it)."""
        key = backend_key(webhook)
        guard = self._guards.get(key)
        if guard is None:
            guard = self._guards[key] = BackendGuard(
                webhook.name, webhook.backend_policy, self._clock, self._listener
            )
            self._share(key, guard)
        return guard

    def reconcile(self, webhooks: Iterable[Webhook]) -> Reconciled:
        """Apply a new configuration: guards of backends still present keep their state.

        A backend whose policy changed keeps its circuit (with the new thresholds) and its calls in
        flight; a backend that is gone is dropped (calls still in flight release into the old
        objects harmlessly); a new backend starts closed and empty.
        """
        previous = self._guards
        current: dict[BackendKey, BackendGuard] = {}
        added = kept = 0
        for webhook in webhooks:
            key = backend_key(webhook)
            if key in current:
                continue
            policy = webhook.backend_policy
            guard = previous.get(key)
            if guard is None:
                guard = BackendGuard(webhook.name, policy, self._clock, self._listener)
                added += 1
            else:
                kept += 1
                guard.name = webhook.name
                if guard.policy != policy:
                    guard.reconfigure(policy)
            current[key] = guard
            self._share(key, guard)
        removed = 0
        for key in previous:
            if key not in current:
                removed += 1
                self._unshare(key)
                self._uncount(key)
        self._guards = current
        return Reconciled(added, kept, removed)

    def _share(self, key: BackendKey, guard: BackendGuard) -> None:
        """Put the circuit and the bulkhead of ``key`` in the shared stores (or take them out)."""
        breaker, bulkhead = guard.breaker, guard.bulkhead
        if self._cells is not None:
            if breaker is None:
                self._unshare(key)
            elif key not in self._shared:
                cell = self._cells.attach(key)  # a worker that starts picks up the state found there
                if cell is not None:
                    breaker.cell = cell
                    self._shared.add(key)
        if self._in_flight is not None:
            if bulkhead is None:
                self._uncount(key)
            elif key not in self._counted:
                counter = self._in_flight.attach(key)
                if counter is not None:
                    bulkhead.counter = counter  # calls in flight keep the counter that counted them
                    self._counted.add(key)

    def _unshare(self, key: BackendKey) -> None:
        if self._cells is not None and key in self._shared:
            self._shared.discard(key)
            self._cells.release(key)

    def _uncount(self, key: BackendKey) -> None:
        if self._in_flight is not None and key in self._counted:
            self._counted.discard(key)
            self._in_flight.release(key)

    def circuits(self) -> list[tuple[str, int, bool]]:
        """``(webhook name, state gauge value, shared)`` per backend with a circuit breaker, read now.

        ``shared``: the state is the one every process acts on (always, without a store).
        """
        cells = self._cells
        return [
            (g.name, int(g.breaker.state), cells is None or key in self._shared)
            for key, g in self._guards.items()
            if g.breaker is not None
        ]

    def states(self) -> Mapping[str, CircuitState]:
        """Circuit state per webhook name, for backends with a circuit breaker (scrape time)."""
        return MappingProxyType(
            {g.name: g.circuit_state for g in self._guards.values() if g.breaker is not None}
        )


__all__ = [
    "DEFAULT_POLICY",
    "REFUSAL_REASONS",
    "BackendGuard",
    "BackendGuards",
    "BackendKey",
    "Pass",
    "Reconciled",
    "Refusal",
    "RefusalReason",
    "backend_key",
]
