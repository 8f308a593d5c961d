"""The backend caller behind the per-backend guards: circuit breaker and bulkhead at the call port.

``GuardedCaller`` wraps any caller with dispatch's ``WebhookCaller`` shape. Before each call it asks
the backend's guard; a refusal raises the same ``CallingWebhookError`` a failed connection would,
so dispatch applies the backend's own failurePolicy to it, at once (``failed calling webhook
"<name>": circuit open after 5 consecutive failures (last: …)``). After the call it reports the
result: a transport failure or a status outside 200..206 is a call error, any other reply an
answer; a call cancelled from outside (the caller went away) says nothing about the backend.

Why here and not in dispatch: the guard needs only "was a call made, and did it fail", which the
call port sees, so it works the same for validating and mutating backends and for reinvocations.
A 2xx reply whose body later fails verification is counted as an answer here (the backend is
alive and fast, which is what the breaker protects the review's deadline from).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

from gateway.config.model import Webhook
from gateway.errors import CallingWebhookError
from gateway.resilience import BackendGuards, Refusal


class _Reply(Protocol):
    @property
    def status(self) -> int: ...
    @property
    def content_type(self) -> str: ...
    @property
    def body(self) -> bytes: ...


class _Caller(Protocol):
    async def call(self, hook: Webhook, body: bytes, *, timeout_seconds: float) -> _Reply: ...
    def url(self, hook: Webhook, *, timeout_seconds: float) -> str: ...


RefusalListener = Callable[[str, str], None]  # (webhook name, reason)

# The overload reason of the review being handled, if it is shed. A context variable because the
# review's backend calls run in tasks dispatch starts, which inherit the handler's context (as the
# trace context does, gateway/tracing.py); every call of a shed review is refused at once.
_shed_reason: ContextVar[str | None] = ContextVar("webhook_gateway_shed_reason", default=None)


@contextmanager
def refusing_calls(reason: str) -> Iterator[None]:
    """Inside, every backend call of this review (and of tasks it starts) is a call error at once."""
    token = _shed_reason.set(reason)
    try:
        yield
    finally:
        _shed_reason.reset(token)


class GuardedCaller:
    """``inner`` with each backend's circuit breaker and bulkhead in front of it."""

    def __init__(
        self, inner: _Caller, guards: BackendGuards, on_refused: RefusalListener | None = None
    ) -> None:
        self.inner = inner
        self.guards = guards
        self._on_refused = on_refused

    def __getattr__(self, name: str) -> object:
        # Transparent for everything else the wrapped caller offers (its pool, its credentials).
        return getattr(self.inner, name)

    def url(self, hook: Webhook, *, timeout_seconds: float) -> str:
        return self.inner.url(hook, timeout_seconds=timeout_seconds)

    async def call(self, hook: Webhook, body: bytes, *, timeout_seconds: float) -> _Reply:
        if (shed := _shed_reason.get()) is not None:
            raise CallingWebhookError(
                f"the gateway is overloaded ({shed}); the call was not made", status_code=503, kind="shed"
            )
        guard = self.guards.for_webhook(hook)
        passed = guard.before_call()
        if isinstance(passed, Refusal):
            if self._on_refused is not None:
                self._on_refused(hook.name, passed.reason)
            raise CallingWebhookError(passed.message, status_code=503, kind=passed.reason)
        try:
            reply = await self.inner.call(hook, body, timeout_seconds=timeout_seconds)
        except CallingWebhookError as exc:
            guard.failed(passed, exc.reason)
            raise
        except BaseException:
            guard.abandoned(passed)
            raise
        if 200 <= reply.status <= 206:
            guard.succeeded(passed)
        else:
            guard.failed(passed, f"HTTP {reply.status}")
        return reply
