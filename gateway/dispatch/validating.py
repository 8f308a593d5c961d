"""The validating driver (VAL-01..10): decide every candidate, call the matching backends concurrently.

A thin loop over I/O: matching decides who is called, each invocation ends as an ``Outcome`` value
(``gateway.dispatch.invoke``), and the outcomes come back in configuration order (never completion
order, VAL-07) for ``outcome.settle``.
"""

from __future__ import annotations

import trio

from gateway.config.backend_policy import BackendMode
from gateway.config.model import Webhook
from gateway.dispatch.invoke import Admitted, Calls, reply_outcome
from gateway.dispatch.outcome import Invocation, Matching, MatchRefused, Outcome
from gateway.dispatch.report import DispatchReport, ModeRecord
from gateway.errors import CallingWebhookError
from gateway.matching import Call, CallFailure, Refuse, decide_candidates


async def validate(calls: Calls, matching: Matching, report: DispatchReport) -> list[Outcome]:
    """VAL-01..10: the outcomes of one review's validating backends, in configuration order."""
    attrs = calls.inbound.attributes
    policy = calls.backends.policy
    selected: list[tuple[Webhook, CallingWebhookError | None, BackendMode]] = []
    shadows: list[tuple[Webhook, CallingWebhookError | None]] = []
    decided = decide_candidates(
        matching.candidates,
        attrs,
        matching.namespace,
        equivalents=matching.settings.equivalents,
        inputs=matching.inputs,
    )
    for plan, decision in decided:
        hook = plan.hook
        report.note_conditions(hook.name, decision)
        if isinstance(decision, Refuse):  # VAL-01: the first matching error answers, nobody is called
            return [MatchRefused(hook, decision.error)]
        if isinstance(decision, Call):
            pre_error = None
        elif isinstance(decision, CallFailure):
            pre_error = decision.error
        else:
            continue
        mode = policy.mode(hook)
        if mode == "Enforce":
            selected.append((hook, pre_error, mode))
            continue
        report.modes.append(ModeRecord(hook.name, hook.configuration, mode, 0, hook.index))
        if mode == "Shadow":
            shadows.append((hook, pre_error))
        else:
            selected.append((hook, pre_error, mode))
    for hook, pre_error in shadows:  # started first: they run apart from the review, never delaying it
        calls.shadow(hook, attrs, reply_outcome, pre_error)
    report.matched = len(selected) + len(shadows)

    # Admission is decided here, in configuration order, before any task starts: a call that is not
    # made (dry run, deadline, shedding, an open circuit, a full bulkhead) settles at once and costs
    # no task. Under overload every call of a shed review ends this way, so it must be cheap.
    outcomes: list[Outcome | None] = [None] * len(selected)
    pending: list[tuple[int, Admitted]] = []
    for i, (hook, pre_error, mode) in enumerate(selected):
        admitted = calls.admit(Invocation(hook, position=i, mode=mode), attrs, pre_error)
        if isinstance(admitted, Admitted):
            pending.append((i, admitted))
        else:
            outcomes[i] = admitted

    async def run(i: int, admitted: Admitted) -> None:
        outcomes[i] = await admitted.run(reply_outcome)

    if len(pending) == 1:  # nothing to run concurrently: spare the nursery and its task
        await run(*pending[0])
    elif pending:
        async with trio.open_nursery() as nursery:
            for call in pending[1:]:
                nursery.start_soon(run, *call)
            await run(*pending[0])  # this task makes one of the calls: one task fewer to start
    return [o for o in outcomes if o is not None]  # every task stored its outcome or the nursery raised
