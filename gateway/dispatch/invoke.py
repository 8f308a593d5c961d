"""Calling one backend: negotiate, encode, POST, classify the HTTP status, decode and verify.

``call_backend`` returns a verified reply (``Called``) or the ``CallingWebhookError`` the call ended
with (governed by failurePolicy), as a value; what a verified reply *means* (allow, reject, patch)
is decided by the drivers and ``gateway.dispatch.outcome``. Also here: what both drivers share
(``Backends``, the CEL inputs of a review, the condition facts of the report).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog
import trio

from gateway.admission import AdmissionAttributes
from gateway.config.model import Webhook
from gateway.config.plan import MatchPlan
from gateway.dispatch.outcome import BackendPolicy, Outcome
from gateway.dispatch.ports import WebhookCaller
from gateway.dispatch.report import ConditionRecord, DispatchReport
from gateway.dispatch.shadow import ShadowCalls
from gateway.dispatch.status import http_error_cause
from gateway.errors import CallingWebhookError
from gateway.matching import ConditionFacts, ConditionInputs, MatchDecision
from gateway.review import (
    BackendResponse,
    InboundReview,
    decode_backend_response,
    encode_backend_request,
    negotiate_version,
    new_request_uid,
    no_known_version_error,
)

log = structlog.get_logger("gateway.dispatch")


@dataclass(slots=True)
class Called:
    """A verified reply and the facts metrics/logs need about the call."""

    response: BackendResponse
    version: str
    backend_uid: str


def deadline_exceeded(caller: WebhookCaller, hook: Webhook) -> CallingWebhookError:
    """FPT-08 / VAL-10: the budget is gone before (or while) the backend could be called."""
    url = caller.url(hook, timeout_seconds=0)
    return CallingWebhookError(
        f'failed to call webhook: Post "{url}": context deadline exceeded', status_code=503, kind="timeout"
    )


@dataclass(frozen=True, slots=True)
class Backends:
    """What the drivers need to call backends: the caller, the backend policy seam, a clock, and
    where Shadow-mode calls run (None: nowhere, they are recorded as not started)."""

    caller: WebhookCaller
    policy: BackendPolicy
    clock: Callable[[], float]
    shadow: ShadowCalls | None = None

    def start_shadow(self, hook: Webhook, run: Callable[[], Awaitable[Outcome]], *, review_uid: str) -> None:
        """Run a Shadow-mode invocation apart from the review; it never delays the answer."""
        if self.shadow is None:
            log.warning("shadow call not started: no shadow runner", webhook=hook.name)
            return
        self.shadow.start(hook, run, review_uid=review_uid)


async def call_backend(
    caller: WebhookCaller,
    hook: Webhook,
    inbound: InboundReview,
    attrs: AdmissionAttributes,
    *,
    deadline: float,
    mutating: bool,
) -> Called | CallingWebhookError:
    """One invocation of ``hook`` on the current object: its verified reply, or its call error.

    The call is bounded by the caller alone (``WebhookCaller.call``'s ``timeout_seconds``, FPT-05):
    its own cancel scope encloses every wait of the call, so a second scope here could never fire
    first, and would cost as much as the rest of this function.
    """
    try:
        version = negotiate_version(hook)
        if version is None:  # REV-05
            return no_known_version_error()
        remaining = min(float(hook.timeout_seconds), deadline - trio.current_time())
        if remaining <= 0:
            return deadline_exceeded(caller, hook)
        backend_uid = new_request_uid()
        body = encode_backend_request(inbound, version=version, uid=backend_uid, object=attrs.object)
        reply = await caller.call(hook, body, timeout_seconds=remaining)
        status_code = reply.status
        if not 200 <= status_code <= 206:  # REV-09: anything else is a call error, body never decoded
            cause, code = http_error_cause(status_code, reply.content_type, reply.body)
            return CallingWebhookError(f"failed to call webhook: {cause}", status_code=code, kind="status")
        response = decode_backend_response(
            reply.body,
            version=version,
            sent_uid=backend_uid,
            mutating=mutating,
            status_code=status_code,
            content_type=reply.content_type,
        )
        return Called(response, version, backend_uid)
    except CallingWebhookError as exc:
        return exc


def condition_inputs(inbound: InboundReview, plans: Sequence[MatchPlan]) -> ConditionInputs | None:
    """CEL's variables for one review (MAT-25), ``request`` read from the decoded review itself.

    Built only when some backend has match conditions (None otherwise: nothing will read them);
    most reviews never evaluate CEL.
    """
    for plan in plans:
        if plan.has_conditions:
            return ConditionInputs(request=inbound.cel_request())
    return None


def note_conditions(report: DispatchReport, hook: Webhook, decision: MatchDecision) -> None:
    """MET-07/MAT-30 facts and MAT-26/29 errors of one backend's match conditions, for observability."""
    facts: ConditionFacts | None = getattr(decision, "conditions", None)
    if facts is None:
        return
    failure = (facts.failure,) if facts.failure is not None else ()
    report.conditions.append(
        ConditionRecord(
            name=hook.name,
            excluded=facts.excluded,
            evaluation_errors=facts.evaluation_errors,
            seconds=facts.evaluation_seconds,
            errors=tuple((e.name, e.message) for e in (*facts.errors, *failure)),
        )
    )
