"""The validating driver (VAL-01..10): match, call the matching backends concurrently, settle.

A thin loop over I/O: matching decides who is called, each call ends as an ``Outcome`` value, and
``outcome.settle`` builds the verdict from the outcomes in configuration order (never completion
order, VAL-07). A bug while handling one backend stays confined to it (VAL-06).
"""

from __future__ import annotations

import math

import structlog
import trio

from gateway.admission import AdmissionAttributes
from gateway.config.backend_policy import BackendMode
from gateway.config.model import Webhook
from gateway.config.plan import PlanSet
from gateway.dispatch import status
from gateway.dispatch.invoke import (
    Backends,
    call_backend,
    condition_inputs,
    deadline_exceeded,
    note_conditions,
)
from gateway.dispatch.outcome import (
    SIDE_EFFECTS_REFUSED_ON_DRY_RUN,
    Admission,
    Allowed,
    CallFailed,
    DispatchSettings,
    DryRunRefused,
    Invocation,
    MatchRefused,
    Outcome,
    Panicked,
    Rejected,
    Verdict,
    settle,
)
from gateway.dispatch.report import DispatchReport, ModeRecord
from gateway.errors import CallingWebhookError
from gateway.matching import Call, CallFailure, NamespaceLabels, Refuse, decide_candidates
from gateway.review import InboundReview

log = structlog.get_logger("gateway.dispatch")


async def validate(
    backends: Backends,
    settings: DispatchSettings,
    inbound: InboundReview,
    plans: PlanSet,
    *,
    namespace: NamespaceLabels | None,
    report: DispatchReport,
    deadline: float,
) -> Verdict:
    """VAL-01..10 for one review whose namespace labels were looked up (``namespace``)."""
    attrs = inbound.attributes
    selected: list[tuple[Webhook, CallingWebhookError | None, BackendMode]] = []
    decided = decide_candidates(
        plans,
        attrs,
        namespace,
        equivalents=settings.equivalents,
        inputs=condition_inputs(inbound, plans.plans),
    )
    shadows: list[tuple[Webhook, CallingWebhookError | None]] = []
    for plan, decision in decided:
        hook = plan.hook
        note_conditions(report, hook, decision)
        if isinstance(decision, Refuse):  # VAL-01: the first matching error answers, nobody is called
            return settle("validating", report, [MatchRefused(hook, decision.error)], settings)
        if isinstance(decision, Call):
            pre_error = None
        elif isinstance(decision, CallFailure):
            pre_error = decision.error
        else:
            continue
        mode = backends.policy.mode(hook)
        if mode == "Enforce":
            selected.append((hook, pre_error, mode))
            continue
        report.modes.append(ModeRecord(hook.name, hook.configuration, mode, 0, hook.index))
        if mode == "Shadow":
            shadows.append((hook, pre_error))
        else:
            selected.append((hook, pre_error, mode))
    for hook, pre_error in shadows:  # started first: they run apart from the review, never delaying it
        _start_shadow(backends, hook, inbound, attrs, pre_error)
    report.matched = len(selected) + len(shadows)
    if not selected:
        return settle("validating", report, [], settings)  # VAL-02 (or only Shadow-mode backends)

    # Admission is decided here, in configuration order, before any task starts: a call that is not
    # made (dry run, deadline, shedding, an open circuit, a full bulkhead) settles at once and costs
    # no task. Under overload every call of a shed review ends this way, so it must be cheap.
    outcomes: list[Outcome | None] = [None] * len(selected)
    pending: list[tuple[int, Webhook, BackendMode, Admission, float]] = []
    for i, (hook, pre_error, mode) in enumerate(selected):
        admitted = _admit(backends, hook, attrs, pre_error, mode, position=i, deadline=deadline)
        if isinstance(admitted, tuple):
            pending.append((i, hook, mode, *admitted))
        else:
            outcomes[i] = admitted

    async def run(i: int, hook: Webhook, mode: BackendMode, admission: Admission, started: float) -> None:
        outcomes[i] = await _call(
            backends,
            hook,
            inbound,
            attrs,
            mode=mode,
            admission=admission,
            started=started,
            position=i,
            deadline=deadline,
        )

    if len(pending) == 1:  # nothing to run concurrently: spare the nursery and its task
        await run(*pending[0])
    elif pending:
        async with trio.open_nursery() as nursery:
            for call in pending[1:]:
                nursery.start_soon(run, *call)
            await run(*pending[0])  # this task makes one of the calls: one task fewer to start

    settled = [o for o in outcomes if o is not None]  # every task stored its outcome or the nursery raised
    report.deadline_exhausted = trio.current_time() >= deadline and any(
        isinstance(o, CallFailed) and o.error.kind == "timeout" for o in settled
    )
    return settle("validating", report, settled, settings)


def _start_shadow(
    backends: Backends,
    hook: Webhook,
    inbound: InboundReview,
    attrs: AdmissionAttributes,
    pre_error: CallingWebhookError | None,
) -> None:
    """A Shadow-mode backend: called with the same request, apart from the review (its own timeout)."""

    async def run() -> Outcome:
        return await _invoke(backends, hook, inbound, attrs, pre_error, position=0, deadline=math.inf)

    backends.start_shadow(hook, run, review_uid=inbound.uid)


async def _invoke(
    backends: Backends,
    hook: Webhook,
    inbound: InboundReview,
    attrs: AdmissionAttributes,
    pre_error: CallingWebhookError | None,
    *,
    position: int,
    deadline: float,
) -> Outcome:
    """One validating backend → its outcome (VAL-05/06, FPT-09)."""
    mode = backends.policy.mode(hook)
    admitted = _admit(backends, hook, attrs, pre_error, mode, position=position, deadline=deadline)
    if not isinstance(admitted, tuple):
        return admitted
    admission, started = admitted
    return await _call(
        backends,
        hook,
        inbound,
        attrs,
        mode=mode,
        admission=admission,
        started=started,
        position=position,
        deadline=deadline,
    )


def _admit(
    backends: Backends,
    hook: Webhook,
    attrs: AdmissionAttributes,
    pre_error: CallingWebhookError | None,
    mode: BackendMode,
    *,
    position: int,
    deadline: float,
) -> Outcome | tuple[Admission, float]:
    """The outcome of a call that is not made, or the admission (and start time) of one that is.

    ``mode`` is the backend's rollout mode (``BackendPolicy.mode``), asked once per invocation.
    """
    if attrs.dry_run and hook.side_effects in SIDE_EFFECTS_REFUSED_ON_DRY_RUN:
        return DryRunRefused(Invocation(hook, position=position, mode=mode), status.dry_run_status(hook.name))
    clock = backends.clock
    started = clock()
    try:
        error = pre_error
        if error is None and trio.current_time() >= deadline:  # VAL-10
            error = deadline_exceeded(backends.caller, hook)
        # the backend policy seam (see gateway.dispatch.outcome): a refusal is the call's error
        admission = backends.policy.admit(hook) if error is None else error
    except Exception as exc:
        log.exception("backend handling failed", webhook=hook.name)
        return Panicked(
            Invocation(hook, seconds=clock() - started, position=position, mode=mode), str(exc), repr(exc)
        )
    if isinstance(admission, CallingWebhookError):
        return CallFailed(
            Invocation(hook, seconds=clock() - started, position=position, mode=mode), admission
        )
    return admission, started


async def _call(
    backends: Backends,
    hook: Webhook,
    inbound: InboundReview,
    attrs: AdmissionAttributes,
    *,
    mode: BackendMode,
    admission: Admission,
    started: float,
    position: int,
    deadline: float,
) -> Outcome:
    """Make one admitted call; its outcome is told to ``admission`` exactly once (VAL-05/06)."""
    clock = backends.clock
    try:
        try:
            called = await call_backend(
                backends.caller, hook, inbound, attrs, deadline=deadline, mutating=False
            )
            outcome: Outcome
            if isinstance(called, CallingWebhookError):
                at = Invocation(hook, seconds=clock() - started, position=position, mode=mode)
                outcome = CallFailed(at, called)
            else:
                at = Invocation(
                    hook,
                    seconds=clock() - started,
                    version=called.version,
                    backend_uid=called.backend_uid,
                    position=position,
                    mode=mode,
                )
                response = called.response
                if response.allowed:
                    outcome = Allowed(at, response)
                else:
                    outcome = Rejected(at, response, status.rejection_status(hook.name, response.status))
        except BaseException:
            admission.abandoned()
            raise
        admission.settled(outcome)
        return outcome
    except trio.Cancelled:
        raise
    except Exception as exc:
        log.exception("backend handling failed", webhook=hook.name)
        at = Invocation(hook, seconds=clock() - started, position=position, mode=mode)
        return Panicked(at, str(exc), repr(exc))
