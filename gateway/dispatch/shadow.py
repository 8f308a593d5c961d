"""Shadow-mode calls: run apart from the review, in a nursery owned by the server, bounded in number.

A backend in ``mode: Shadow`` is called with the same request as the enforcing backends (a
mutating one with the object as the chain has it at its position), but the review never waits for
it: ``invoke.Calls.shadow`` hands the invocation to ``ShadowCalls.start`` and goes on. The reply
goes out when the enforcing backends are done; a shadow call still running then finishes (within its own
``timeoutSeconds``) or is cancelled when the server shuts down. Each result is reduced to an
outcome label and the message it would have given (``outcome.shadow_result``) and handed to the
listener (metrics and one log line).

Bounded: at most ``max_in_flight`` shadow calls run at once; one more is not started and is
reported as an ``error`` (a shadow backend must never cost the gateway unbounded memory).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import structlog
import trio

from gateway.config.model import Webhook
from gateway.dispatch.outcome import Outcome, shadow_result
from gateway.resilience.modes import ShadowOutcome

log = structlog.get_logger("gateway.dispatch")

DEFAULT_MAX_SHADOW_CALLS: Final = 256


@dataclass(frozen=True, slots=True)
class ShadowResult:
    """What one Shadow-mode backend would have done to a review."""

    webhook: str
    configuration: str
    kind: str
    outcome: ShadowOutcome
    message: str  # the would-be denial, call error or patch ("" when it allowed unchanged)
    seconds: float
    review_uid: str = ""


ShadowListener = Callable[[ShadowResult], None]


class ShadowCalls:
    """Starts Shadow-mode invocations in ``nursery`` (the server's, long-lived)."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        max_in_flight: int = DEFAULT_MAX_SHADOW_CALLS,
        on_result: ShadowListener | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._nursery = nursery
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._on_result = on_result
        self._clock = clock

    def start(self, hook: Webhook, run: Callable[[], Awaitable[Outcome]], *, review_uid: str = "") -> None:
        """Start ``run`` (one invocation of ``hook``) unless ``max_in_flight`` are running already."""
        if self.in_flight >= self.max_in_flight:
            message = f"not called: {self.max_in_flight} shadow calls already in flight"
            self._report(
                ShadowResult(hook.name, hook.configuration, hook.kind, "error", message, 0.0, review_uid)
            )
            return
        try:
            self._nursery.start_soon(self._run, hook, run, review_uid)
        except RuntimeError:  # the server's nursery is closed: the gateway is shutting down
            self._report(
                ShadowResult(
                    hook.name,
                    hook.configuration,
                    hook.kind,
                    "error",
                    "not called: shutting down",
                    0.0,
                    review_uid,
                )
            )
            return
        self.in_flight += 1

    async def _run(self, hook: Webhook, run: Callable[[], Awaitable[Outcome]], review_uid: str) -> None:
        started = self._clock()
        try:
            outcome = await run()
        except Exception as exc:  # a gateway bug in one shadow call stays confined to it
            log.exception("shadow call failed", webhook=hook.name)
            label: ShadowOutcome = "error"
            message = repr(exc)
        else:
            label, message = shadow_result(outcome)
        finally:
            self.in_flight -= 1
        seconds = self._clock() - started
        self._report(
            ShadowResult(hook.name, hook.configuration, hook.kind, label, message, seconds, review_uid)
        )

    def _report(self, result: ShadowResult) -> None:
        if self._on_result is None:
            return
        try:
            self._on_result(result)
        except Exception:
            log.exception("recording a shadow result failed", webhook=result.webhook)
