"""should_call: the whole per-backend decision (MAT-01/02, MAT-09/10, MAT-24..28), plus review-level
exemptions (MAT-31/32) and the forbidden messages matching produces (MAT-28, MAT-33).

Predicates run cheapest first (rules, then selectors, then CEL), but every outcome equals upstream's
order (``generic/webhook.go ShouldCallHook``): a clean "no" from any predicate skips; selector errors
count only when the rules match, the namespaceSelector's before the objectSelector's.

Whole-review errors (404/500/403 of MAT-16/17/23/28) are *returned* as ``Refuse(error)`` values, never
raised: the dispatcher decides in configuration order which one answers the review (VAL-01, MUT-02).

Backends come as ``MatchPlan``s compiled with the Snapshot (``gateway.config.plan``);
``decide_candidates`` looks only at the plans whose rules can match (the Snapshot's index).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Final, Literal, TypeAlias

import msgspec

from gateway.admission import AdmissionAttributes, GroupVersionResource, Status, StatusCause, StatusDetails
from gateway.config.model import Webhook
from gateway.config.plan import Candidate, MatchPlan, PlanSet, is_cluster_scoped
from gateway.errors import CallingWebhookError, MatchingError
from gateway.matching.conditions import (
    DEFAULT_TIME_LIMIT_SECONDS,
    Clock,
    ConditionFacts,
    ConditionInputs,
    evaluate_conditions,
)
from gateway.matching.namespace import (
    NamespaceLabels,
    internal_error,
    is_exempt_from_namespace_selector,
    resolve_namespace_labels,
)
from gateway.matching.objects import name_for_message

Equivalents: TypeAlias = Mapping[GroupVersionResource, Iterable[GroupVersionResource]]
"""MAT-10: for a GVR, the GVRs that share its storage (the configured equivalence table)."""

SkipReason = Literal["rules", "namespaceSelector", "objectSelector", "matchConditions"]


class Skip(msgspec.Struct, frozen=True):
    """The backend does not apply. ``reason`` names the predicate that said no, in evaluation order
    (rules first); ``conditions`` is set when match conditions were evaluated (MAT-30)."""

    reason: SkipReason
    conditions: ConditionFacts | None = None


class Call(msgspec.Struct, frozen=True):
    """Call the backend with the review as received (the gateway never converts, GW-13)."""

    hook: Webhook
    conditions: ConditionFacts | None = None


class CallFailure(msgspec.Struct, frozen=True):
    """MAT-10: a call error without calling (governed by the backend's ``failurePolicy``)."""

    hook: Webhook
    error: CallingWebhookError


class Refuse(msgspec.Struct, frozen=True):
    """A matching error that answers the whole review, whatever ``failurePolicy`` says."""

    hook: Webhook
    error: MatchingError
    conditions: ConditionFacts | None = None


MatchDecision: TypeAlias = Skip | Call | CallFailure | Refuse

_SKIP_RULES: Final = Skip("rules")
_SKIP_NAMESPACE: Final = Skip("namespaceSelector")
_SKIP_OBJECT: Final = Skip("objectSelector")


def _gvr_text(gvr: GroupVersionResource) -> str:
    return f"{gvr.group}/{gvr.version}/{gvr.resource}" if gvr.group else f"{gvr.version}/{gvr.resource}"


def equivalent_match_error(
    requested: GroupVersionResource, matched: GroupVersionResource
) -> CallingWebhookError:
    """MAT-10's call error (status code 500 for metrics, FPT-12)."""
    return CallingWebhookError(
        f"matchPolicy Equivalent requires converting {_gvr_text(requested)} to {_gvr_text(matched)},"
        " which the gateway cannot do",
        status_code=500,
        kind="equivalent",
    )


_UNRESOLVED: Final = object()


class _Review:
    """Per-review work shared by all backends: the rules shape key, namespace labels, CEL inputs."""

    __slots__ = (
        "_namespace",
        "attrs",
        "clock",
        "cluster",
        "equivalents",
        "inputs",
        "looked_up",
        "time_limit",
    )

    def __init__(
        self,
        attrs: AdmissionAttributes,
        *,
        looked_up: NamespaceLabels | None,
        equivalents: Equivalents | None,
        inputs: ConditionInputs | None,
        time_limit: float,
        clock: Clock,
    ) -> None:
        self.attrs = attrs
        self.cluster = is_cluster_scoped(attrs.resource, attrs.namespace)  # MAT-08, once per review
        self.looked_up = looked_up
        self.equivalents = equivalents
        self.inputs = inputs
        self.time_limit = time_limit
        self.clock = clock
        self._namespace: object = _UNRESOLVED

    def namespace_labels(self) -> Mapping[str, str] | MatchingError | None:
        """None when MAT-11 exempts the request; else the labels (or error) of MAT-13..17."""
        if self._namespace is _UNRESOLVED:
            attrs = self.attrs
            self._namespace = (
                None
                if is_exempt_from_namespace_selector(attrs)
                else resolve_namespace_labels(attrs, self.looked_up)
            )
        return self._namespace  # type: ignore[return-value]


def should_call(
    hook: Webhook | MatchPlan,
    attrs: AdmissionAttributes,
    namespace_labels: NamespaceLabels | None,
    *,
    direct: bool | None = None,
    equivalents: Equivalents | None = None,
    inputs: ConditionInputs | None = None,
    time_limit_seconds: float = DEFAULT_TIME_LIMIT_SECONDS,
    clock: Clock = time.perf_counter,
) -> MatchDecision:
    """Decide whether ``hook`` applies to ``attrs`` (MAT-01..30).

    ``hook`` is a compiled plan (from the Snapshot) or a bare webhook (compiled here, for tests);
    ``direct`` is whether its rules match, when the caller already knows (``PlanSet.candidates``).
    ``namespace_labels`` is the dispatcher's lookup of ``namespace_to_look_up(attrs)``; ``inputs``
    shares decoded CEL variables across the backends of one review (made here when omitted).
    """
    review = _Review(
        attrs,
        looked_up=namespace_labels,
        equivalents=equivalents,
        inputs=inputs,
        time_limit=time_limit_seconds,
        clock=clock,
    )
    return _decide(hook if isinstance(hook, MatchPlan) else MatchPlan(hook), review, direct)


def decide_all(
    hooks: Iterable[Webhook | MatchPlan],
    attrs: AdmissionAttributes,
    namespace_labels: NamespaceLabels | None,
    *,
    equivalents: Equivalents | None = None,
    inputs: ConditionInputs | None = None,
    time_limit_seconds: float = DEFAULT_TIME_LIMIT_SECONDS,
    clock: Clock = time.perf_counter,
) -> list[MatchDecision]:
    """``should_call`` for every backend, in order, sharing the per-review work (VAL-01).

    Given a ``PlanSet``, only its ``candidates(attrs)`` are decided and the rest skip by rules
    without being looked at (their decisions are the shared ``Skip("rules")``).
    """
    review = _Review(
        attrs,
        looked_up=namespace_labels,
        equivalents=equivalents,
        inputs=inputs,
        time_limit=time_limit_seconds,
        clock=clock,
    )
    if isinstance(hooks, PlanSet):
        decided = {id(plan): _decide(plan, review, direct) for plan, direct in hooks.candidates(attrs)}
        return [decided.get(id(plan), _SKIP_RULES) for plan in hooks.plans]
    return [_decide(h if isinstance(h, MatchPlan) else MatchPlan(h), review) for h in hooks]


def decide_candidates(
    candidates: Iterable[Candidate],
    attrs: AdmissionAttributes,
    namespace_labels: NamespaceLabels | None,
    *,
    equivalents: Equivalents | None = None,
    inputs: ConditionInputs | None = None,
    time_limit_seconds: float = DEFAULT_TIME_LIMIT_SECONDS,
    clock: Clock = time.perf_counter,
) -> list[tuple[MatchPlan, MatchDecision]]:
    """The decisions of ``candidates`` (``PlanSet.candidates(attrs)``: the backends whose rules could
    match, in order; every other one skips), sharing the per-review work.

    What the validating dispatcher runs: the cost follows the number of candidates, not of backends.
    """
    review = _Review(
        attrs,
        looked_up=namespace_labels,
        equivalents=equivalents,
        inputs=inputs,
        time_limit=time_limit_seconds,
        clock=clock,
    )
    return [(plan, _decide(plan, review, direct)) for plan, direct in candidates]


def _decide(plan: MatchPlan, review: _Review, direct: bool | None = None) -> MatchDecision:
    """One backend's decision; ``direct`` is whether its rules match (None: find out here)."""
    attrs = review.attrs
    via: GroupVersionResource | None = None
    if direct is None:
        direct = plan.rules.matches_scoped(
            attrs.operation, attrs.resource, attrs.sub_resource, review.cluster
        )
    if not direct:
        equivalents = review.equivalents
        if equivalents is None or plan.hook.match_policy != "Equivalent":
            return _SKIP_RULES
        others = equivalents.get(attrs.resource)
        via = plan.rules.first_equivalent(attrs, others) if others else None
        if via is None:
            return _SKIP_RULES
    elif plan.simple:
        return Call(plan.hook)

    # The rules match: the selectors decide now, with upstream's precedence (MAT-02). A clean "no"
    # from either selector skips; otherwise the namespaceSelector's error, then the objectSelector's.
    # upstream: predicates/namespace/matcher.go MatchNamespaceSelector (exemption, build, empty, lookup)
    pending: MatchingError | None = None
    if plan.namespace is not None or plan.namespace_error is not None:
        labels = review.namespace_labels()
        if labels is not None:  # None: exempt (MAT-11)
            if plan.namespace_error is not None:
                pending = internal_error(plan.namespace_error)
            elif isinstance(labels, MatchingError):
                pending = labels
            elif plan.namespace is not None and not plan.namespace(labels):
                return _SKIP_NAMESPACE
    if plan.object_error is not None:
        pending = pending or internal_error(plan.object_error)
    elif plan.object is not None:
        # upstream: predicates/object/matcher.go MatchObjectSelector (object or oldObject)
        new = attrs.object_labels()
        if new is None or not plan.object(new):
            old = attrs.old_object_labels()
            if old is None or not plan.object(old):
                return _SKIP_OBJECT
    if pending is not None:
        return Refuse(plan.hook, pending)

    if via is not None:
        # MAT-10: upstream would convert the object to ``via`` and evaluate conditions on that;
        # the gateway can do neither, so the call fails before conditions are looked at.
        return CallFailure(plan.hook, equivalent_match_error(attrs.resource, via))

    if not plan.has_conditions:
        return Call(plan.hook)
    hook = plan.hook
    if review.inputs is None:
        review.inputs = ConditionInputs()
    result = evaluate_conditions(
        hook.match_conditions,
        hook.failure_policy,
        attrs,
        review.inputs,
        time_limit_seconds=review.time_limit,
        clock=review.clock,
    )
    if result.error is not None:
        return Refuse(hook, forbidden(attrs, result.error), result.facts)
    if not result.matches:
        return Skip("matchConditions", result.facts)
    return Call(hook, result.facts)


# --- review-level exemptions (MAT-31/32) ----------------------------------------------------------

_CONFIGURATION_KINDS: Final = frozenset(
    {
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
    }
)
_VIRTUAL_RESOURCES: Final = frozenset(
    {
        ("authentication.k8s.io", "tokenreviews"),
        ("authentication.k8s.io", "selfsubjectreviews"),
        ("authorization.k8s.io", "subjectaccessreviews"),
        ("authorization.k8s.io", "selfsubjectaccessreviews"),
        ("authorization.k8s.io", "localsubjectaccessreviews"),
        ("authorization.k8s.io", "selfsubjectrulesreviews"),
    }
)


def is_exempt(attrs: AdmissionAttributes, *, exclude_virtual_resources: bool = True) -> bool:
    """MAT-31/32: reviews answered "allowed" without consulting any backend (even before readiness)."""
    # upstream: predicates/rules/rules.go IsExemptAdmissionConfigurationResource
    if attrs.kind.group == "admissionregistration.k8s.io" and attrs.kind.kind in _CONFIGURATION_KINDS:
        return True
    return exclude_virtual_resources and (attrs.resource.group, attrs.resource.resource) in _VIRTUAL_RESOURCES


# --- forbidden messages (MAT-28, MAT-33) ----------------------------------------------------------


def _group_resource(attrs: AdmissionAttributes) -> str:
    res = attrs.resource
    return f"{res.resource}.{res.group}" if res.group else res.resource


def forbidden_message(attrs: AdmissionAttributes, error: str, *, name: str | None = None) -> str:
    """``<resource>[.<group>] "<name>" is forbidden: <error>``; name defaults to request.name (MAT-28)."""
    # upstream: apimachinery api/errors NewForbidden
    name = attrs.name if name is None else name
    quoted = f' "{name}"' if name else ""
    return f"{_group_resource(attrs)}{quoted} is forbidden: {error}"


def forbidden(attrs: AdmissionAttributes, error: str, *, name: str | None = None) -> MatchingError:
    """403 Forbidden with details {group, kind: <resource>, name} (MAT-28)."""
    name = attrs.name if name is None else name
    return MatchingError(
        code=403,
        reason="Forbidden",
        message=forbidden_message(attrs, error, name=name),
        details={"name": name, "group": attrs.resource.group, "kind": attrs.resource.resource},
    )


NOT_READY: Final = "not yet ready to handle request"


def not_ready_error(attrs: AdmissionAttributes) -> MatchingError:
    """MAT-33: the 403 for reviews arriving before readiness, with its name fallbacks."""
    # upstream: admission/errors.go NewForbidden via extractResourceName
    return forbidden(attrs, NOT_READY, name=name_for_message(attrs))


def matching_error_status(error: MatchingError) -> Status:
    """The meta/v1 Status a matching error answers the review with (ERR-10: status Failure)."""
    details = error.details
    causes = [StatusCause(message=error.message.removeprefix("Internal error occurred: "))]
    return Status(
        status="Failure",
        message=error.message,
        reason=error.status_reason,
        code=error.code,
        details=StatusDetails(
            name=details.get("name", ""),
            group=details.get("group", ""),
            kind=details.get("kind", ""),
            # upstream: NewInternalError carries the cause text as its only cause
            causes=causes if error.code == 500 and error.status_reason == "InternalError" else None,
        ),
    )
