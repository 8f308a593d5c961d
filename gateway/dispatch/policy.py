"""The backend policy the server runs with: circuit breakers and bulkheads at the dispatch seam.

``GuardedBackends`` implements ``outcome.BackendPolicy`` over the pure per-backend guards of
``gateway.resilience``. It sits at the dispatch seam rather than at the call port because the
breaker has to see what the call *meant*: a 2xx reply that fails verification, or a patch that
cannot be applied, is a failure of the backend as much as a timeout is, and only dispatch knows it.
Denials and allowed replies are answers (a healthy backend); a call cancelled without a result
says nothing about the backend.

Order of refusals: the circuit, then the bulkhead. Each refusal is the ``CallingWebhookError`` the
backend's own failurePolicy then decides. A review the gateway sheds never gets here: its calls are
refused before the policy is asked (``gateway.dispatch.invoke``), so no breaker permit or bulkhead
slot is taken for them.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.config.backend_policy import BackendMode
from gateway.config.model import Webhook
from gateway.dispatch.outcome import UNTRACKED, Admission, CallFailed, Outcome, Panicked, PatchFailed
from gateway.errors import CallingWebhookError
from gateway.resilience import BackendGuard, BackendGuards, Pass, Refusal

RefusalListener = Callable[[str, str], None]  # (webhook name, reason)


class _Guarded:
    """One admitted call: gives its guard pass back exactly once."""

    __slots__ = ("guard", "passed")

    def __init__(self, guard: BackendGuard, passed: Pass) -> None:
        self.guard = guard
        self.passed = passed

    def settled(self, outcome: Outcome) -> None:
        if isinstance(outcome, CallFailed):
            self.guard.failed(self.passed, outcome.error.reason)
        elif isinstance(outcome, PatchFailed):  # allowed with a patch that cannot be applied
            self.guard.failed(self.passed, outcome.status.message)
        elif isinstance(outcome, Panicked):  # the gateway's bug, not the backend's
            self.guard.abandoned(self.passed)
        else:  # allowed or denied: the backend answered
            self.guard.succeeded(self.passed)

    def abandoned(self) -> None:
        self.guard.abandoned(self.passed)


class GuardedBackends:
    """``BackendPolicy`` with overload shedding, each backend's circuit breaker and bulkhead, and
    each backend's configured rollout mode."""

    def __init__(self, guards: BackendGuards, on_refused: RefusalListener | None = None) -> None:
        self.guards = guards
        self._on_refused = on_refused

    def admit(self, hook: Webhook) -> CallingWebhookError | Admission:
        guard = self.guards.for_webhook(hook)
        passed = guard.before_call()
        if isinstance(passed, Refusal):
            if self._on_refused is not None:
                self._on_refused(hook.name, passed.reason)
            return CallingWebhookError(passed.message, status_code=503, kind=passed.reason)
        if passed.breaker is None and passed.bulkhead is None:
            return UNTRACKED  # no circuit, no bulkhead: how the call ends changes nothing
        return _Guarded(guard, passed)

    def mode(self, hook: Webhook) -> BackendMode:
        return hook.backend_policy.mode
