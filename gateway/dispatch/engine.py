"""Dispatch: run the matching backends of one review and decide (VAL-*, MUT-*, FPT-*).

``Dispatcher`` is the facade the server holds: ``validate``/``mutate`` take one decoded review and
the snapshot it uses from start to end (ORD-04). They handle what precedes any backend (MAT-31/32
exemptions, one namespace lookup per review, MAT-12) and hand over to the drivers:

- ``gateway.dispatch.validating``: concurrent fan-out, outcomes combined in configuration order;
- ``gateway.dispatch.mutating``: the serial chain with reinvocation.

Both turn every backend invocation into an ``Outcome`` value and build the ``Verdict`` (reply,
annotations, report for metrics and logs) once, in ``gateway.dispatch.outcome``, where
``failurePolicy`` is applied in one place and where the backend policy seam is documented.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import trio

from gateway.admission import AdmissionAttributes
from gateway.config.model import Snapshot
from gateway.config.plan import Candidate, MatchPlan
from gateway.dispatch import mutating, validating
from gateway.dispatch.invoke import Backends
from gateway.dispatch.outcome import AdmitAll, BackendPolicy, DispatchSettings, PatchMode, Verdict
from gateway.dispatch.ports import NamespaceLabelSource, NamespaceNotFoundError, WebhookCaller
from gateway.dispatch.report import DispatchReport
from gateway.dispatch.shadow import ShadowCalls
from gateway.matching import (
    NamespaceLabels,
    NamespaceLookupFailed,
    NamespaceNotFound,
    is_exempt,
    namespace_to_look_up,
)
from gateway.review import InboundReview

__all__ = ["DispatchSettings", "Dispatcher", "PatchMode", "Verdict"]


def _need_namespace(candidates: Sequence[Candidate]) -> bool:
    """Whether some candidate has a namespaceSelector (MAT-12); if none has, nothing is looked up."""
    for candidate in candidates:  # noqa: SIM110 - a plain loop: no generator per review
        if candidate.plan.needs_namespace:
            return True
    return False


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

    async def validate(self, inbound: InboundReview, snapshot: Snapshot, *, deadline: float) -> Verdict:
        """VAL-01..10: match all, call the matching ones concurrently, combine in config order."""
        attrs = inbound.attributes
        report = DispatchReport(kind="validating", operation=attrs.operation)
        plans = snapshot.plans("validating")
        if not plans or is_exempt(attrs, exclude_virtual_resources=self.settings.exclude_virtual_resources):
            return Verdict(allowed=True, report=report)
        candidates = plans.candidates(attrs)
        if not candidates:
            return Verdict(allowed=True, report=report)  # VAL-02: no rules match
        namespace = None
        if _need_namespace(candidates):
            namespace = await self._namespace_labels([c.plan for c in candidates], attrs, deadline)
        return await validating.validate(
            self.backends,
            self.settings,
            inbound,
            plans,
            namespace=namespace,
            report=report,
            deadline=deadline,
        )

    async def mutate(self, inbound: InboundReview, snapshot: Snapshot, *, deadline: float) -> Verdict:
        """MUT-01..25: the serial chain with reinvocation; one combined patch in the reply."""
        attrs = inbound.attributes
        report = DispatchReport(kind="mutating", operation=attrs.operation)
        plans = snapshot.plans("mutating")
        if not plans or is_exempt(attrs, exclude_virtual_resources=self.settings.exclude_virtual_resources):
            return Verdict(allowed=True, report=report)
        candidates = plans.candidates(attrs)
        if not candidates:
            return Verdict(allowed=True, report=report)
        namespace = None
        if _need_namespace(candidates):
            namespace = await self._namespace_labels([c.plan for c in candidates], attrs, deadline)
        return await mutating.mutate(
            self.backends,
            self.settings,
            inbound,
            plans,
            namespace=namespace,
            report=report,
            deadline=deadline,
        )

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
