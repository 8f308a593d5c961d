"""One backend invocation, start to end: the one call path of both drivers.

Every invocation of a backend, enforcing or in a rollout mode, validating or mutating, in the review
or apart from it (Shadow), goes through ``Calls``:

1. ``Calls.admit``: is the call made at all? Not in a dry run for a backend with side effects
   (FPT-09), not once the review's deadline has passed (VAL-10, FPT-08), not for a review the gateway
   sheds, not when the backend policy seam refuses (circuit, bulkhead). A call that is not made ends
   here as its ``Outcome``, and costs no task.
2. ``Admitted.run``: make the call (negotiate, encode, POST, classify the HTTP status, decode and
   verify the reply), let the driver's ``Classify`` say what the verified reply means (allow,
   reject; for the chain: what its patch does), and tell the admission how it ended, exactly once.

The confinement rule is here, once: an exception raised while handling one backend, from admission
to settling, is a gateway bug confined to that backend as ``Panicked`` (VAL-06), which its
failurePolicy then decides; the other backends and the review go on.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import structlog
import trio

from gateway.admission import AdmissionAttributes
from gateway.config.model import Webhook
from gateway.dispatch import status
from gateway.dispatch.outcome import (
    SIDE_EFFECTS_REFUSED_ON_DRY_RUN,
    Admission,
    Allowed,
    BackendPolicy,
    CallFailed,
    DryRunRefused,
    Invocation,
    Outcome,
    Panicked,
    Rejected,
)
from gateway.dispatch.ports import WebhookCaller
from gateway.dispatch.shadow import ShadowCalls
from gateway.dispatch.status import http_error_cause
from gateway.errors import CallingWebhookError
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


Classify = Callable[[Webhook, Called, Invocation], Outcome]
"""What a verified reply means for the driver: ``reply_outcome``, or the chain's ``ChainObject.apply``."""


def reply_outcome(hook: Webhook, called: Called, at: Invocation) -> Outcome:
    """A verified reply as it stands: allowed, or rejected with its normalised status (ERR-01)."""
    response = called.response
    if response.allowed:
        return Allowed(at, response)
    return Rejected(at, response, status.rejection_status(hook.name, response.status))


@dataclass(frozen=True, slots=True)
class Backends:
    """What every invocation needs, for the gateway's life: the caller, the backend policy seam, a
    clock for durations, and where Shadow-mode calls run (None: nowhere, they are not started)."""

    caller: WebhookCaller
    policy: BackendPolicy
    clock: Callable[[], float]
    shadow: ShadowCalls | None = None


def shed_error(reason: str) -> CallingWebhookError:
    """The call error of every call of a review the gateway sheds (its reason: ``in_flight``,
    ``event_loop_lag``, ``cpu``)."""
    return CallingWebhookError(
        f"the gateway is overloaded ({reason}); the call was not made", status_code=503, kind="shed"
    )


def deadline_exceeded(caller: WebhookCaller, hook: Webhook) -> CallingWebhookError:
    """FPT-08 / VAL-10: the budget is gone before (or while) the backend could be called."""
    url = caller.url(hook, timeout_seconds=0)
    return CallingWebhookError(
        f'failed to call webhook: Post "{url}": context deadline exceeded', status_code=503, kind="timeout"
    )


class Calls:
    """The invocations of one review: its backends, request, deadline and shed decision.

    ``shed`` is the overload shedder's reason for this review (None: not shed), passed in by the
    server: every call of a shed review is refused before anything is asked of the backend policy
    (no breaker permit, no bulkhead slot), as the call error its failurePolicy then decides.
    """

    __slots__ = ("backends", "deadline", "inbound", "shed")

    def __init__(
        self, backends: Backends, inbound: InboundReview, *, deadline: float, shed: str | None = None
    ) -> None:
        self.backends = backends
        self.inbound = inbound
        self.deadline = deadline
        self.shed = shed

    async def invoke(
        self,
        at: Invocation,
        attrs: AdmissionAttributes,
        classify: Classify,
        pre_error: CallingWebhookError | None,
    ) -> Outcome:
        """Admit and, if admitted, make one call: its outcome (``attrs`` carries the object to send)."""
        admitted = self.admit(at, attrs, pre_error)
        if isinstance(admitted, Admitted):
            return await admitted.run(classify)
        return admitted

    def admit(
        self, at: Invocation, attrs: AdmissionAttributes, pre_error: CallingWebhookError | None
    ) -> Outcome | Admitted:
        """The outcome of a call that is not made, or the admitted call to ``run``.

        ``at``: who is invoked, in which mode (``BackendPolicy.mode``, asked once per invocation by
        the driver), round and position (for annotations); ``pre_error``: matching already failed
        the call (MAT-10).
        """
        hook = at.hook
        if attrs.dry_run and hook.side_effects in SIDE_EFFECTS_REFUSED_ON_DRY_RUN:  # FPT-09
            return DryRunRefused(at, status.dry_run_status(hook.name))
        backends = self.backends
        clock = backends.clock
        started = clock()
        try:
            admission: CallingWebhookError | Admission | None = pre_error
            if admission is None and trio.current_time() >= self.deadline:  # VAL-10, FPT-08
                admission = deadline_exceeded(backends.caller, hook)
            if admission is None and self.shed is not None:
                admission = shed_error(self.shed)
            if admission is None:  # the backend policy seam (gateway.dispatch.outcome)
                admission = backends.policy.admit(hook)
        except Exception as exc:  # VAL-06: a gateway bug, confined to this backend
            log.exception("backend handling failed", webhook=hook.name)
            return _panicked(_ended(at, clock() - started), exc)
        if isinstance(admission, CallingWebhookError):
            return CallFailed(_ended(at, clock() - started), admission)
        return Admitted(self, at, attrs, admission, started)

    def shadow(
        self,
        hook: Webhook,
        attrs: AdmissionAttributes,
        classify: Classify,
        pre_error: CallingWebhookError | None,
        *,
        round_: int = 0,
    ) -> None:
        """Start a Shadow-mode invocation apart from the review: its own timeout, never awaited.

        It shares the review's shed decision (an overloaded gateway starts no extra calls).
        """
        shadows = self.backends.shadow
        if shadows is None:
            log.warning("shadow call not started: no shadow runner", webhook=hook.name)
            return
        apart = Calls(self.backends, self.inbound, deadline=math.inf, shed=self.shed)
        at = Invocation(hook, round=round_, mode="Shadow")

        def run() -> Awaitable[Outcome]:
            return apart.invoke(at, attrs, classify, pre_error)

        shadows.start(hook, run, review_uid=self.inbound.uid)


class Admitted:
    """A call that is made: ``run`` it once. ``at`` is its invocation, without the call's facts yet."""

    __slots__ = ("admission", "at", "attrs", "calls", "started")

    def __init__(
        self, calls: Calls, at: Invocation, attrs: AdmissionAttributes, admission: Admission, started: float
    ) -> None:
        self.calls = calls
        self.at = at
        self.attrs = attrs
        self.admission = admission
        self.started = started

    async def run(self, classify: Classify) -> Outcome:
        """Make the call; its outcome is told to the admission exactly once (VAL-05/06)."""
        at, admission = self.at, self.admission
        hook, clock = at.hook, self.calls.backends.clock
        try:
            try:
                called = await _call(self.calls, hook, self.attrs)
                outcome: Outcome
                if isinstance(called, CallingWebhookError):
                    outcome = CallFailed(_ended(at, clock() - self.started), called)
                else:
                    seconds = clock() - self.started
                    outcome = classify(hook, called, _ended(at, seconds, called.version, called.backend_uid))
            except BaseException:  # cancelled, or the bug below: nothing to say about the backend
                admission.abandoned()
                raise
            admission.settled(outcome)
            return outcome
        except Exception as exc:  # VAL-06: a gateway bug, confined to this backend
            log.exception("backend handling failed", webhook=hook.name)
            return _panicked(_ended(at, clock() - self.started), exc)


def _ended(at: Invocation, seconds: float, version: str = "", backend_uid: str = "") -> Invocation:
    """The invocation with the facts of its end: how long it took, and the reply's version and uid."""
    return msgspec.structs.replace(at, seconds=seconds, version=version, backend_uid=backend_uid)


def _panicked(at: Invocation, exc: Exception) -> Panicked:
    return Panicked(at, str(exc), repr(exc))


async def _call(calls: Calls, hook: Webhook, attrs: AdmissionAttributes) -> Called | CallingWebhookError:
    """One POST of ``attrs``'s object to ``hook``: its verified reply, or its call error.

    The call is bounded by the caller alone (``WebhookCaller.call``'s ``timeout_seconds``, FPT-05):
    its own cancel scope encloses every wait of the call, so a second scope here could never fire
    first, and would cost as much as the rest of this function.
    """
    caller = calls.backends.caller
    try:
        version = negotiate_version(hook)
        if version is None:  # REV-05
            return no_known_version_error()
        remaining = min(float(hook.timeout_seconds), calls.deadline - trio.current_time())
        if remaining <= 0:
            return deadline_exceeded(caller, hook)
        backend_uid = new_request_uid()
        body = encode_backend_request(calls.inbound, version=version, uid=backend_uid, object=attrs.object)
        reply = await caller.call(hook, body, timeout_seconds=remaining)
        status_code = reply.status
        if not 200 <= status_code <= 206:  # REV-09: anything else is a call error, body never decoded
            cause, code = http_error_cause(status_code, reply.content_type, reply.body)
            return CallingWebhookError(f"failed to call webhook: {cause}", status_code=code, kind="status")
        response = decode_backend_response(
            reply.body,
            version=version,
            sent_uid=backend_uid,
            mutating=hook.kind == "mutating",
            status_code=status_code,
            content_type=reply.content_type,
        )
        return Called(response, version, backend_uid)
    except CallingWebhookError as exc:
        return exc
