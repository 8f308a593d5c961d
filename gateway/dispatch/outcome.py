"""Deciding apart from recording: every backend invocation ends as a value, decided and recorded once.

Every backend invocation ends as an ``Outcome`` (``gateway.dispatch.invoke``, for both drivers).
Everything after that is pure and lives here:

- ``apply_failure_policy(outcome, policy)`` → ``Effect``: the one place where ``failurePolicy``
  (FPT-01..03), dry-run refusal (FPT-09) and internal errors (MUT-06..10, ERR-08) become allow /
  deny / fail open. ``settle`` applies it to every outcome; the mutating chain also asks it to stop
  at the first deny.
- ``settle(...)`` builds the ``Verdict`` from the list of outcomes: the reply (allowed, status, patch),
  the audit annotations (AUD-04..06) and warnings (AUD-07), and the ``DispatchReport`` that metrics
  and the review log line read (MET-02..06).

Backend policy seam (circuit breaker, bulkhead, rollout modes): a ``BackendPolicy`` is asked
``admit(hook)`` before every call (``gateway.dispatch.invoke``); a refusal is returned as
the ``CallingWebhookError`` the call would have failed with, so it becomes a ``CallFailed`` outcome
governed by the backend's ``failurePolicy`` like any other call error. Otherwise it returns an
``Admission``, told exactly once how the call ended: ``settled(outcome)`` with every outcome of the
call (verified or not: a 2xx that fails verification or a patch that cannot be applied is a
failure for the breaker) or ``abandoned()`` when it was cancelled without a result.

``mode(hook)`` is the backend's rollout mode. ``Enforce``: its outcome is used as is. ``Warn``: the
drivers mark the outcome (``Invocation.mode``); ``apply_failure_policy`` handles its call errors
as under ``Ignore`` and returns an ``Effect`` with ``enforced=False`` for the rest, and ``settle``
turns what would have denied (or patched) into a warning ``<webhook>: <message>``. ``Shadow``: the
drivers start the call apart from the review (``gateway.dispatch.shadow``); its outcome never
reaches ``settle`` and is reduced by ``shadow_result`` for metrics and the log.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, TypeAlias

import msgspec

from gateway.admission import Status
from gateway.config.backend_policy import BackendMode
from gateway.config.model import FailurePolicy, Webhook
from gateway.config.plan import Candidate
from gateway.dispatch import status as statuses
from gateway.dispatch.annotations import (
    AuditAnnotations,
    Warnings,
    failed_open_key,
    mode_key,
    mode_value,
    mutation_key,
    mutation_value,
    patch_key,
)
from gateway.dispatch.report import DispatchReport, InvocationOutcome, InvocationRecord
from gateway.errors import CallingWebhookError, MatchingError
from gateway.matching import ConditionInputs, NamespaceLabels, matching_error_status
from gateway.resilience.modes import ShadowOutcome, denial_warning, patch_warning, shadow_outcome
from gateway.review import BackendResponse

_encode = msgspec.json.Encoder().encode

Kind = Literal["validating", "mutating"]

SIDE_EFFECTS_REFUSED_ON_DRY_RUN: Final = ("Unknown", "Some")
"""FPT-09: backends with these sideEffects are not called in a dry-run review."""


# --- outcomes: how one backend invocation ended ----------------------------------------------------
# Frozen msgspec Structs, like matching's decisions: immutable values, and several are built per
# backend call (a Struct in ~0.1 µs, a frozen dataclass in ~1 µs). Never encoded or decoded.


class Invocation(msgspec.Struct, frozen=True):
    """Who was invoked, in which round, and the facts of the call (for records and logs)."""

    hook: Webhook
    round: int = 0
    seconds: float = 0.0
    version: str = ""
    backend_uid: str = ""
    position: int = 0  # validating: place among the called backends (the failed-open annotation index)
    mode: BackendMode = "Enforce"  # Warn/Shadow: a rollout mode records this outcome, never denying

    @property
    def enforced(self) -> bool:
        return self.mode == "Enforce"


class Allowed(msgspec.Struct, frozen=True):
    """A verified reply that allowed; for mutating backends ``mutated`` says if its patch changed
    the object, and ``patch`` holds the ops applied (for ``auditPatches``). ``withheld``: the ops
    of a patch that would have changed the object but was not applied (a mutating backend in Warn
    or Shadow mode)."""

    at: Invocation
    response: BackendResponse
    mutated: bool = False
    patch: list[Any] | None = None
    withheld: list[Any] | None = None


class Rejected(msgspec.Struct, frozen=True):
    """A verified reply with ``allowed: false`` (ERR-01)."""

    at: Invocation
    response: BackendResponse
    status: Status


class CallFailed(msgspec.Struct, frozen=True):
    """A call error (ERR-02/03/06, MAT-10, REV-05/08/12..14, MUT-04/05): governed by failurePolicy.

    ``response`` is set when a verified reply carried an unusable patch: its annotations and
    warnings still count.
    """

    at: Invocation
    error: CallingWebhookError
    response: BackendResponse | None = None


class PatchFailed(msgspec.Struct, frozen=True):
    """MUT-06..10: the backend allowed with a patch the gateway could not apply. Denies (500 inside)."""

    at: Invocation
    response: BackendResponse
    status: Status


class DryRunRefused(msgspec.Struct, frozen=True):
    """FPT-09: a dry-run review and a backend with side effects: not called, the review is denied."""

    at: Invocation
    status: Status


class Panicked(msgspec.Struct, frozen=True):
    """A gateway bug while handling one backend; confined to it and governed by failurePolicy (VAL-06).

    ``error`` is the text for the deny (ERR-08), ``detail`` the exception's repr for logs.
    """

    at: Invocation
    error: str
    detail: str = ""


class MatchRefused(msgspec.Struct, frozen=True):
    """A matching error that answers the whole review whatever failurePolicy says (MAT-16/17/23/28)."""

    hook: Webhook
    error: MatchingError


Outcome: TypeAlias = Allowed | Rejected | CallFailed | PatchFailed | DryRunRefused | Panicked | MatchRefused


# --- failure policy: the one place that turns an outcome into allow / deny / fail open -----------


class Effect(msgspec.Struct, frozen=True):
    """What an outcome does to the review. ``deny`` is the Status to deny with (None: no deny);
    ``failed_open``: a call error ignored under ``Ignore`` (FPT-03). ``enforced=False`` is the seam
    for rollout modes: recorded, never denying."""

    deny: Status | None = None
    failed_open: bool = False
    enforced: bool = True

    @property
    def denies(self) -> bool:
        return self.deny is not None and self.enforced


ALLOW = Effect()
FAIL_OPEN = Effect(failed_open=True)


def apply_failure_policy(outcome: Outcome, policy: FailurePolicy) -> Effect:
    """FPT-01..03, FPT-09, ERR-01/02/04/08 and MUT-06..13 for one outcome, in one place.

    An invocation in a rollout mode (``Invocation.mode``, set by the drivers from
    ``BackendPolicy.mode``) never fails a review: its call errors are handled as under ``Ignore``
    (Warn records the fail-open like Ignore does; Shadow enforced nothing to fail open), and
    whatever else would deny gets ``enforced=False``: recorded, never denying.
    """
    if isinstance(outcome, MatchRefused) or outcome.at.mode == "Enforce":
        return _effect(outcome, policy)
    effect = _effect(outcome, "Ignore")
    return Effect(
        deny=effect.deny, failed_open=effect.failed_open and outcome.at.mode == "Warn", enforced=False
    )


def _effect(outcome: Outcome, policy: FailurePolicy) -> Effect:
    if isinstance(outcome, Allowed):
        return ALLOW
    if isinstance(outcome, Rejected | PatchFailed | DryRunRefused):
        return Effect(deny=outcome.status)  # whatever the policy says
    if isinstance(outcome, CallFailed):
        if policy == "Ignore":
            return FAIL_OPEN
        return Effect(deny=statuses.call_error_status(outcome.at.hook.name, outcome.error.reason))
    if isinstance(outcome, Panicked):
        if policy == "Ignore":
            return FAIL_OPEN
        hook = outcome.at.hook
        return Effect(deny=statuses.panicked_status(hook.name, outcome.error, kind=hook.kind))
    return Effect(deny=matching_error_status(outcome.error))


# --- the backend policy seam -----------------------------------------------------------------------


class Admission(Protocol):
    """An admitted call; told exactly once how it ended. Neither method may raise."""

    def settled(self, outcome: Outcome) -> None:
        """Every outcome of the call: allowed, rejected, call error, unusable patch, gateway bug."""

    def abandoned(self) -> None:
        """The call was cancelled before it had a result (the caller went away, shutdown)."""


class BackendPolicy(Protocol):
    """Asked before every backend call (circuit breakers, bulkheads, shedding) and for its mode.

    ``admit`` returns the call error to fail the call with (never raises), or the ``Admission`` to
    tell how it ended; ``mode`` is the backend's rollout mode (Enforce, Warn, Shadow).
    """

    def admit(self, hook: Webhook) -> CallingWebhookError | Admission: ...

    def mode(self, hook: Webhook) -> BackendMode: ...


class _Untracked:
    def settled(self, outcome: Outcome) -> None:
        pass

    def abandoned(self) -> None:
        pass


UNTRACKED: Final[Admission] = _Untracked()
"""An admission nobody needs to hear back from."""


class AdmitAll:
    """The default backend policy: every call proceeds, nothing is tracked; modes as configured."""

    def admit(self, hook: Webhook) -> CallingWebhookError | Admission:
        return UNTRACKED

    def mode(self, hook: Webhook) -> BackendMode:
        return hook.backend_policy.mode


def in_mode(outcome: Outcome, mode: BackendMode) -> Outcome:
    """The same outcome, marked with the rollout mode it ran in (Warn/Shadow: recorded, never denying)."""
    if isinstance(outcome, MatchRefused) or outcome.at.mode == mode:
        return outcome
    return msgspec.structs.replace(outcome, at=msgspec.structs.replace(outcome.at, mode=mode))


def not_enforced(outcome: Outcome) -> Outcome:
    """The same outcome, recorded but never denying (what Warn mode makes of it)."""
    return in_mode(outcome, "Warn")


def would_be_message(outcome: Outcome) -> str:
    """What a backend's outcome would have told the caller: its denial, its call error, its patch."""
    if isinstance(outcome, Rejected):
        st = outcome.response.status
        if st is not None and (st.message or st.reason):
            return st.message or st.reason
        return "denied the request"
    if isinstance(outcome, PatchFailed | DryRunRefused):
        return outcome.status.message
    if isinstance(outcome, CallFailed):
        return outcome.error.reason
    if isinstance(outcome, Panicked):
        return outcome.error
    if isinstance(outcome, MatchRefused):
        return outcome.error.message
    if outcome.withheld:
        return patch_warning(outcome.at.hook.name, _ops(outcome.withheld)).split(": ", 1)[1]
    return ""


def _ops(patch: list[Any]) -> list[tuple[str, str]]:
    return [(str(op.get("op", "")), str(op.get("path", ""))) for op in patch if isinstance(op, dict)]


def shadow_result(outcome: Outcome) -> tuple[ShadowOutcome, str]:
    """The ``outcome`` label of a Shadow-mode result and the message it would have given.

    An unusable patch counts as ``error`` (the backend answered wrongly), a dry-run refusal as
    ``denied`` (the review would have been denied).
    """
    call_error = isinstance(outcome, CallFailed | Panicked | PatchFailed | MatchRefused)
    allowed = isinstance(outcome, Allowed)
    patched = isinstance(outcome, Allowed) and bool(outcome.withheld)
    return shadow_outcome(call_error=call_error, allowed=allowed, patched=patched), would_be_message(outcome)


# --- the verdict, built once from the outcomes ---------------------------------------------------


@dataclass(slots=True)
class Verdict:
    """The gateway's answer to one review, before encoding in the caller's version."""

    allowed: bool
    status: Status | None = None
    patch: bytes | None = None
    warnings: list[str] = field(default_factory=list)
    audit_annotations: dict[str, str] = field(default_factory=dict)
    report: DispatchReport | None = None


def _cap(code: int) -> int:
    return 600 if code > 600 else code


def record_of(outcome: Outcome, effect: Effect) -> InvocationRecord | None:
    """MET-02/03/05/06: the metrics/log record of one invocation (None for a matching refusal)."""
    if isinstance(outcome, MatchRefused):
        return None
    at = outcome.at
    hook = at.hook
    kind: InvocationOutcome = "allowed"
    code, reason, error_kind, mutated = 200, "", "", False
    if isinstance(outcome, Allowed):
        mutated = outcome.mutated
    elif isinstance(outcome, Rejected):
        kind, code, reason = "rejected", _cap(outcome.status.code), outcome.status.message
    elif isinstance(outcome, CallFailed):
        kind = "failed_open" if effect.failed_open else "failed_closed"
        code, reason, error_kind = _cap(outcome.error.status_code), outcome.error.reason, outcome.error.kind
    elif isinstance(outcome, PatchFailed | DryRunRefused):
        kind, code, reason = "internal_error", 0, outcome.status.message
    else:  # Panicked
        kind = "failed_open" if effect.failed_open else "failed_closed"
        code = 500
        reason = outcome.detail if effect.failed_open or effect.deny is None else effect.deny.message
    return InvocationRecord(
        name=hook.name,
        configuration=hook.configuration,
        round=at.round,
        index=hook.index,
        outcome=kind,
        code=code,
        duration_seconds=at.seconds,
        version=at.version,
        reason=reason,
        error_kind=error_kind,
        mutated=mutated,
        backend_uid=at.backend_uid,
        mode=at.mode,
    )


def _response_of(outcome: Outcome) -> BackendResponse | None:
    if isinstance(outcome, Allowed | Rejected | PatchFailed):
        return outcome.response
    if isinstance(outcome, CallFailed):
        return outcome.response
    return None


PatchMode = Literal["concat", "diff"]


@dataclass(frozen=True, slots=True)
class DispatchSettings:
    """Knobs of the dispatcher (all have the apiserver's defaults)."""

    patch_mode: PatchMode = "concat"
    audit_patches: bool = False
    max_denial_message_bytes: int = 8192
    max_warning_bytes: int = 64 * 1024
    exclude_virtual_resources: bool = True
    equivalents: Mapping[Any, Any] | None = None


@dataclass(frozen=True, slots=True)
class Matching:
    """What a driver decides one review's backends with (MAT-*): the candidates (the backends whose
    rules can match, in order), the namespace labels looked up for them (MAT-12), CEL's inputs
    (MAT-25, None when no candidate has conditions) and the dispatcher's settings."""

    candidates: Sequence[Candidate]
    namespace: NamespaceLabels | None
    inputs: ConditionInputs | None
    settings: DispatchSettings


def settle(
    kind: Kind,
    report: DispatchReport,
    outcomes: Sequence[Outcome],
    settings: DispatchSettings,
    *,
    patch: bytes | None = None,
) -> Verdict:
    """The reply, annotations, warnings and report of a review, from its outcomes in order.

    Validating: outcomes in configuration order (VAL-07); every enforced deny is combined (VAL-08).
    Mutating: outcomes in chain order, ending at the first deny (MUT-13/14); ``patch`` is the
    combined patch of an allowed chain (MUT-22..24). A ``MatchRefused`` answers the review alone.
    """
    annotations = AuditAnnotations()
    warnings = Warnings(max_bytes=settings.max_warning_bytes)
    denials: list[Status] = []
    refused: MatchRefused | None = None
    for outcome in outcomes:
        if isinstance(outcome, MatchRefused):
            refused = outcome
            break
        hook = outcome.at.hook
        effect = apply_failure_policy(outcome, hook.failure_policy)
        record = record_of(outcome, effect)
        assert record is not None
        report.invocations.append(record)
        response = _response_of(outcome)
        if response is not None:
            if response.audit_annotations:
                report.dropped += annotations.add_backend(hook.name, response.audit_annotations)
            if response.warnings:
                report.dropped += warnings.add(response.warnings)
        if kind == "mutating":
            _mutation_annotations(annotations, outcome, effect, settings)
        elif effect.failed_open:
            annotations.add_gateway(failed_open_key("validating", 0, outcome.at.position), hook.name)
        if outcome.at.mode == "Warn":
            report.dropped += warnings.add(_warn_warnings(outcome, effect))
        if effect.denies:
            assert effect.deny is not None
            if not denials:
                report.denied_by = hook.name
            denials.append(effect.deny)
    for ran in report.modes:  # which backends ran in a rollout mode (Enforce is the default)
        annotations.add_gateway(
            mode_key(kind, ran.round, ran.index), mode_value(ran.configuration, ran.name, ran.mode)
        )
    deny: Status | None = None
    if refused is not None:  # VAL-01 / MUT-02: answers the review; earlier patches are discarded
        deny = matching_error_status(refused.error)
        report.denied_by, report.deny_reason = refused.hook.name, refused.error.message
        error = refused.error
        if error.code == 404 and error.details.get("kind") == "namespaces":
            # MAT-16: the namespace is unknown to the label source; the backend whose selector asked
            # was never called, so the log must not name it as the one that denied.
            report.denied_by = ""
            report.deny_reason = (
                f"{error.message}: the namespace is unknown to the gateway's namespace source "
                "(file mode: no Namespace object in the configuration); no backend was called"
            )
    elif denials:
        if kind == "mutating":  # the chain stopped at its one deny
            deny = denials[0]
        else:
            deny = statuses.combine_denials(denials, limit=settings.max_denial_message_bytes)
        report.deny_reason = deny.message
    report.allowed = deny is None
    return Verdict(
        allowed=deny is None,
        status=deny,
        patch=patch if deny is None else None,
        warnings=warnings.as_list(),
        audit_annotations=annotations.as_dict(),
        report=report,
    )


def _warn_warnings(outcome: Outcome, effect: Effect) -> list[str]:
    """Warn mode: what would have denied, or the patch that would have changed the object."""
    if isinstance(outcome, MatchRefused):
        return []
    name = outcome.at.hook.name
    if effect.deny is not None:
        return [denial_warning(name, would_be_message(outcome))]
    if isinstance(outcome, Allowed) and outcome.withheld:
        return [patch_warning(name, _ops(outcome.withheld))]
    return []


def _mutation_annotations(
    annotations: AuditAnnotations, outcome: Outcome, effect: Effect, settings: DispatchSettings
) -> None:
    """AUD-05/06 for one mutating invocation: patch (opt-in), mutation, failed-open."""
    if isinstance(outcome, MatchRefused):
        return
    at = outcome.at
    hook = at.hook
    if isinstance(outcome, Allowed) and outcome.patch is not None and settings.audit_patches:
        annotations.add_gateway(
            patch_key(at.round, hook.index),
            _encode(
                {
                    "configuration": hook.configuration,
                    "webhook": hook.name,
                    "patch": outcome.patch,
                    "patchType": "JSONPatch",
                }
            ).decode(),
        )
    # Every invoked backend, including failed and dry-run-refused ones: upstream's annotator runs
    # before the call and before the dry-run check (AUD-05).
    mutated = isinstance(outcome, Allowed) and outcome.mutated
    annotations.add_gateway(
        mutation_key(at.round, hook.index), mutation_value(hook.configuration, hook.name, mutated=mutated)
    )
    if effect.failed_open:
        annotations.add_gateway(failed_open_key("mutating", at.round, hook.index), hook.name)
