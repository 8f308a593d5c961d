"""Dispatch: run the matching backends of one review and decide (VAL-*, MUT-*, FPT-*).

``Dispatcher.decide`` is the one entry the server holds: it takes one decoded review, the kind of
webhook it is for, the snapshot it uses from start to end (ORD-04) and the overload shedder's
decision, and walks the review once:

1. MAT-31/32 exemptions (before readiness is even considered, MAT-33);
2. the snapshot (a fixed one, or awaited until the gateway is ready; not ready: MAT-33's 403);
3. the candidates (the backends whose rules can match), computed once; none: allowed (VAL-02);
4. one namespace lookup, only if some candidate's selector needs it (MAT-12), and CEL's inputs;
5. the driver: ``gateway.dispatch.validating`` (concurrent fan-out) or ``gateway.dispatch.mutating``
   (the serial chain with reinvocation); both invoke every backend through
   ``gateway.dispatch.invoke`` and return the outcomes in order;
6. ``outcome.settle``: the ``Verdict`` (reply, annotations, report for metrics and logs), once, with
   ``failurePolicy`` applied in one place.

A gateway bug outside any one backend's handling denies the review with a 500 naming the step
(ERR-08), never an HTTP error; inside one backend's handling it stays with that backend (VAL-06).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Final, TypeAlias

import structlog
import trio

from gateway.admission import AdmissionAttributes
from gateway.config.model import Snapshot, WebhookKind
from gateway.config.plan import Candidate, MatchPlan
from gateway.dispatch import mutating, status, validating
from gateway.dispatch.invoke import Backends, Calls
from gateway.dispatch.outcome import (
    AdmitAll,
    BackendPolicy,
    CallFailed,
    DispatchSettings,
    Matching,
    Outcome,
    PatchMode,
    Verdict,
    settle,
)
from gateway.dispatch.ports import NamespaceLabelSource, NamespaceNotFoundError, WebhookCaller
from gateway.dispatch.report import DispatchReport
from gateway.dispatch.shadow import ShadowCalls
from gateway.matching import (
    ConditionInputs,
    NamespaceLabels,
    NamespaceLookupFailed,
    NamespaceNotFound,
    is_exempt,
    matching_error_status,
    namespace_to_look_up,
    not_ready_error,
)
from gateway.review import InboundReview

__all__ = ["DispatchSettings", "Dispatcher", "PatchMode", "ReadySnapshot", "Verdict"]

log = structlog.get_logger("gateway.dispatch")

ReadySnapshot: TypeAlias = Callable[[float], Awaitable[Snapshot | None]]
"""Awaits the snapshot to decide with, until the deadline given; None: the gateway is not ready (MAT-33)."""


class Dispatcher:
    """Runs reviews against a Snapshot through a WebhookCaller. One instance serves every review.

    ``policy`` is the backend policy seam (``gateway.dispatch.outcome.BackendPolicy``): asked before
    every call, told every outcome; the default admits everything. ``shadow`` runs Shadow-mode
    backends apart from the reviews (``gateway.dispatch.shadow``); without it they are not called.
    """

    def __init__(
        self,
        caller: WebhookCaller,
        namespaces: NamespaceLabelSource,
        settings: DispatchSettings | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        policy: BackendPolicy | None = None,
        shadow: ShadowCalls | None = None,
    ) -> None:
        self.caller = caller
        self.namespaces = namespaces
        self.settings = settings or DispatchSettings()
        self.backends = Backends(caller=caller, policy=policy or AdmitAll(), clock=clock, shadow=shadow)
        self._shed_verdicts = _PerSnapshot()
        self.shed_verdicts_reused = 0  # shed reviews given the verdict of an earlier one of their class

    async def validate(
        self, inbound: InboundReview, snapshot: Snapshot, *, deadline: float, shed: str | None = None
    ) -> Verdict:
        """VAL-01..10: ``decide`` for the validating webhooks."""
        return await self.decide("validating", inbound, snapshot, deadline=deadline, shed=shed)

    async def mutate(
        self, inbound: InboundReview, snapshot: Snapshot, *, deadline: float, shed: str | None = None
    ) -> Verdict:
        """MUT-01..25: ``decide`` for the mutating webhooks."""
        return await self.decide("mutating", inbound, snapshot, deadline=deadline, shed=shed)

    async def decide(
        self,
        kind: WebhookKind,
        inbound: InboundReview,
        snapshot: Snapshot | ReadySnapshot,
        *,
        deadline: float,
        shed: str | None = None,
    ) -> Verdict:
        """The verdict on one review for the ``kind`` webhooks.

        ``snapshot``: the snapshot to use, or a ``ReadySnapshot`` to await it from (the server's
        readiness). ``shed``: the overload shedder's reason to refuse every call of this review at
        once (each then fails under its backend's failurePolicy), or None.
        """
        attrs = inbound.attributes
        report = DispatchReport(kind=kind, operation=attrs.operation)
        if is_exempt(attrs, exclude_virtual_resources=self.settings.exclude_virtual_resources):
            return Verdict(allowed=True, report=report)  # MAT-31/32, before readiness (MAT-33)
        try:
            if not isinstance(snapshot, Snapshot):
                ready = await snapshot(deadline)
                if ready is None:
                    st = matching_error_status(not_ready_error(attrs))
                    report.allowed, report.deny_reason, report.denied_by = False, st.message, "not-ready"
                    return Verdict(allowed=False, status=st, report=report)
                snapshot = ready
            plans = snapshot.plans(kind)
            candidates = plans.candidates(attrs) if plans else ()
            if not candidates:
                return Verdict(allowed=True, report=report)  # VAL-02: no rules match
            return await self._decide(kind, inbound, candidates, report, deadline=deadline, shed=shed)
        except Exception as exc:  # ERR-08: a gateway bug outside any one backend's handling
            log.exception("dispatch failed", uid=inbound.uid, endpoint=kind)
            st = status.internal_error_status(f"{kind} dispatch", str(exc) or type(exc).__name__)
            report.allowed, report.deny_reason, report.denied_by = False, st.message, "gateway"
            return Verdict(allowed=False, status=st, report=report)

    def decide_shed(
        self, kind: WebhookKind, inbound: InboundReview, snapshot: Snapshot, *, deadline: float, shed: str
    ) -> Verdict | None:
        """``decide`` for a review the overload shedder refuses, at once, without awaiting anything.

        The same walk and the same verdict as ``decide(..., shed=shed)``: every matched backend's
        call is refused before it is made and settles under its own failurePolicy. None when the
        decision needs I/O (a namespace lookup that is not cached, MAT-12): then ``decide`` takes it.
        The server's read path asks this before it starts a task for the review, so that a shed
        review costs what its decision costs, not a request's whole machinery (docs/resilience.md).

        Under overload most reviews are shed, and most are alike: a shed verdict reads nothing of a
        review but what ``_shed_class`` keys it by, so the walk is made once per class and snapshot
        and its verdict (the same object) given to every review of that class
        (``shed_verdicts_reused`` counts them).
        """
        attrs = inbound.attributes
        candidates: Sequence[Candidate] = ()
        labels: Mapping[str, str] | str | None = None  # the namespace's, when a selector needs them
        if not is_exempt(attrs, exclude_virtual_resources=self.settings.exclude_virtual_resources):
            plans = snapshot.plans(kind)
            candidates = plans.candidates(attrs) if plans else ()
            if _need_namespace(candidates):
                name = namespace_to_look_up(attrs, [c.plan for c in candidates])
                if name is not None:
                    try:
                        labels = self.namespaces.labels_now(name)
                        if labels is None:
                            return None
                    except NamespaceNotFoundError:
                        labels = _NO_NAMESPACE  # known now not to exist (MAT-16): no lookup needed
                    except Exception:  # noqa: BLE001 - the ordinary path reports the lookup's failure
                        return None
        expired = trio.current_time() >= deadline
        try:
            policy = self.backends.policy
            key = _shed_class(kind, attrs, candidates, labels, policy, shed=shed, expired=expired)
        except Exception:  # noqa: BLE001 - labels that do not decode: the walk decides (and says why)
            key = None
        known = self._shed_verdicts.of(snapshot)
        if key is not None:
            found = known.get(key)
            if found is not None:
                self.shed_verdicts_reused += 1
                return found
        # With the snapshot given, a namespace known and every call refused, nothing in the walk
        # waits: the coroutine ends at its first step.
        walk = self.decide(kind, inbound, snapshot, deadline=deadline, shed=shed)
        try:
            walk.send(None)
        except StopIteration as done:
            verdict: Verdict = done.value
            if key is not None:
                if len(known) >= _SHED_CLASSES:
                    known.clear()
                known[key] = verdict
            return verdict
        walk.close()  # unreachable by the checks above; never leave a review half-decided
        raise RuntimeError("a shed review's decision waited for I/O")

    async def _decide(
        self,
        kind: WebhookKind,
        inbound: InboundReview,
        candidates: Sequence[Candidate],
        report: DispatchReport,
        *,
        deadline: float,
        shed: str | None,
    ) -> Verdict:
        attrs = inbound.attributes
        namespace = None
        if _need_namespace(candidates):
            namespace = await self._namespace_labels([c.plan for c in candidates], attrs, deadline)
        matching = Matching(candidates, namespace, _condition_inputs(inbound, candidates), self.settings)
        calls = Calls(self.backends, inbound, deadline=deadline, shed=shed)
        patch = None
        if kind == "validating":
            outcomes = await validating.validate(calls, matching, report)
        else:
            outcomes, patch = await mutating.mutate(calls, matching, report)
        report.deadline_exhausted = _deadline_exhausted(outcomes, deadline)
        return settle(kind, report, outcomes, self.settings, patch=patch)

    async def _namespace_labels(
        self, plans: list[MatchPlan], attrs: AdmissionAttributes, deadline: float
    ) -> NamespaceLabels | None:
        """Look the namespace up once per review, only if some backend's selector needs it (MAT-12).

        A live lookup (cache miss in cluster mode) is bounded by the review's deadline; every failure
        is a value that matching turns into MAT-16/17's answer if a backend's rules match.
        """
        name = namespace_to_look_up(attrs, plans)
        if name is None:
            return None
        try:
            known = self.namespaces.labels_now(name)  # a cache hit needs no deadline (~7 µs saved)
            if known is not None:
                return known
            with trio.fail_after(max(0.0, deadline - trio.current_time())):
                return await self.namespaces.labels(name)
        except trio.TooSlowError:
            return NamespaceLookupFailed(f'Get namespace "{name}": context deadline exceeded')
        except NamespaceNotFoundError:
            return NamespaceNotFound(name)
        except Exception as exc:  # noqa: BLE001 - any lookup failure is MAT-17's 500, decided later
            return NamespaceLookupFailed(str(exc))


_SHED_CLASSES: Final = 1024  # shed verdicts kept per snapshot (then forgotten together)
_NO_NAMESPACE: Final = "<not found>"


class _PerSnapshot:
    """Shed verdicts by class, for the last few snapshots (``/validate/fail`` and
    ``/validate/ignore`` decide with snapshots of their own: ``registration.half_of``)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Snapshot, dict[Hashable, Verdict]]] = {}

    def of(self, snapshot: Snapshot) -> dict[Hashable, Verdict]:
        found = self._seen.get(id(snapshot))
        if found is not None and found[0] is snapshot:
            return found[1]
        verdicts: dict[Hashable, Verdict] = {}
        self._seen[id(snapshot)] = (snapshot, verdicts)
        while len(self._seen) > 4:
            del self._seen[next(iter(self._seen))]
        return verdicts


def _labels_key(labels: Mapping[str, str] | str | None) -> Hashable:
    if isinstance(labels, Mapping):
        return frozenset(labels.items())
    return labels  # None (no labels, no lookup) or _NO_NAMESPACE


def _shed_class(
    kind: WebhookKind,
    attrs: AdmissionAttributes,
    candidates: Sequence[Candidate],
    labels: Mapping[str, str] | str | None,
    policy: BackendPolicy,
    *,
    shed: str,
    expired: bool,
) -> Hashable | None:
    """What a shed review's verdict reads of the review, as a key; None when it reads more.

    Rules read the request's kind, resource, subresource, operation and namespace (and, for an
    ``Equivalent`` policy, the original request's); a call refused reads the dry-run flag
    (FPT-09), the shedding reason and whether the deadline has already passed (FPT-08).
    Selectors add the labels they read: the namespace's (MAT-12/13) and the object's and old
    object's (MAT-19; a Namespace's own labels are its object's or old object's, MAT-13/15).
    Match conditions read the whole request (MAT-25) and a Shadow backend's call is made apart
    from the review: a review with such a candidate is walked every time.
    """
    simple = True
    for candidate in candidates:
        plan = candidate.plan
        if plan.has_conditions or policy.mode(plan.hook) == "Shadow":
            return None
        if not plan.simple:
            simple = False
    key = (
        kind,
        shed,
        expired,
        attrs.dry_run,
        attrs.operation,
        attrs.namespace,
        attrs.resource,
        attrs.sub_resource,
        attrs.kind,
        attrs.request_resource,
        attrs.request_sub_resource,
        attrs.request_kind,
    )
    if simple:
        return key
    return (
        *key,
        _labels_key(labels),
        _labels_key(attrs.object_labels()),
        _labels_key(attrs.old_object_labels()),
    )


def _need_namespace(candidates: Sequence[Candidate]) -> bool:
    """Whether some candidate has a namespaceSelector (MAT-12); if none has, nothing is looked up."""
    for candidate in candidates:  # noqa: SIM110 - a plain loop: no generator per review
        if candidate.plan.needs_namespace:
            return True
    return False


def _condition_inputs(inbound: InboundReview, candidates: Sequence[Candidate]) -> ConditionInputs | None:
    """CEL's variables for one review (MAT-25), ``request`` read from the decoded review itself.

    Built only when some candidate has match conditions (None otherwise: nothing will read them);
    most reviews never evaluate CEL.
    """
    for candidate in candidates:
        if candidate.plan.has_conditions:
            return ConditionInputs(request=inbound.cel_request())
    return None


def _deadline_exhausted(outcomes: Sequence[Outcome], deadline: float) -> bool:
    """MET-09: the review's budget ran out and some backend failed for it (a timeout, or no call)."""
    if trio.current_time() < deadline:
        return False
    return any(isinstance(o, CallFailed) and o.error.kind == "timeout" for o in outcomes)
