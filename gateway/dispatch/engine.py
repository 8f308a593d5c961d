"""Dispatch: run the matching backends of one review and decide (VAL-*, MUT-*, FPT-*).

Validating backends are called concurrently in one nursery and their outcomes combined in
configuration order (never completion order, VAL-07); mutating backends are called one at a time,
each patch applied before the next call, with at most one reinvocation round (MUT-15..19).
Every backend failure is a value here; only bugs escape, and even those stay confined to their
backend (VAL-06).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import structlog
import trio

from gateway.admission import AdmissionAttributes, Status, is_null
from gateway.config.model import Snapshot, Webhook
from gateway.dispatch import jsonpatch, status
from gateway.dispatch.annotations import (
    AuditAnnotations,
    Warnings,
    failed_open_key,
    mutation_key,
    mutation_value,
    patch_key,
)
from gateway.dispatch.invoke import Called, call_backend, deadline_exceeded
from gateway.dispatch.ports import NamespaceLabelSource, NamespaceNotFoundError, WebhookCaller
from gateway.dispatch.reinvocation import ReinvocationState
from gateway.dispatch.report import ConditionRecord, DispatchReport, InvocationRecord
from gateway.errors import CallingWebhookError, MatchingError
from gateway.matching import (
    Call,
    CallFailure,
    ConditionFacts,
    ConditionInputs,
    MatchDecision,
    NamespaceLookupFailed,
    NamespaceNotFound,
    Refuse,
    decide_all,
    is_exempt,
    matching_error_status,
    namespace_to_look_up,
    should_call,
)
from gateway.matching.conditions import request_fields
from gateway.review import InboundReview

log = structlog.get_logger("gateway.dispatch")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

PatchMode = Literal["concat", "diff"]


@dataclass(frozen=True, slots=True)
class DispatchSettings:
    """Knobs of the dispatcher (all have the spec's defaults)."""

    patch_mode: PatchMode = "concat"
    audit_patches: bool = False
    max_denial_message_bytes: int = 8192
    max_warning_bytes: int = 64 * 1024
    exclude_virtual_resources: bool = True
    equivalents: Mapping[Any, Any] | None = None


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


class _Refused(Exception):  # noqa: N818 - control flow inside the mutating chain, never escapes
    def __init__(self, hook: Webhook, error: MatchingError) -> None:
        self.hook = hook
        self.error = error


class _Deny(Exception):  # noqa: N818 - control flow inside the mutating chain, never escapes
    def __init__(self, status: Status, by: str) -> None:
        self.status = status
        self.by = by


class Dispatcher:
    """Runs reviews against a Snapshot through a WebhookCaller. One instance serves every review."""

    def __init__(
        self,
        caller: WebhookCaller,
        namespaces: NamespaceLabelSource,
        settings: DispatchSettings | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.caller = caller
        self.namespaces = namespaces
        self.settings = settings or DispatchSettings()
        self._clock = clock

    # --- shared steps ----------------------------------------------------------------------------

    async def _namespace_labels(
        self, hooks: tuple[Webhook, ...], attrs: AdmissionAttributes, deadline: float
    ) -> Any:
        """Look the namespace up once per review, only if some backend's selector needs it (MAT-12).

        A live lookup (cache miss in cluster mode) is bounded by the review's deadline.
        """
        name = namespace_to_look_up(attrs, hooks)
        if name is None:
            return None
        try:
            with trio.fail_after(max(0.0, deadline - trio.current_time())):
                return await self.namespaces.labels(name)
        except trio.TooSlowError:
            return NamespaceLookupFailed(f'Get namespace "{name}": context deadline exceeded')
        except NamespaceNotFoundError:
            return NamespaceNotFound(name)
        except Exception as exc:  # noqa: BLE001 - any lookup failure is MAT-17's 500, decided later
            return NamespaceLookupFailed(str(exc))

    def _matching_error_verdict(self, report: DispatchReport, hook: Webhook, exc: MatchingError) -> Verdict:
        report.allowed = False
        if exc.code == 404 and exc.details.get("kind") == "namespaces":
            # MAT-16: the namespace is unknown to the label source; the backend whose selector asked
            # was never called, so the log must not name it as the one that denied.
            report.deny_reason = (
                f"{exc.message}: the namespace is unknown to the gateway's namespace source "
                "(file mode: no Namespace object in the configuration); no backend was called"
            )
            return Verdict(allowed=False, status=matching_error_status(exc), report=report)
        report.denied_by = hook.name
        report.deny_reason = exc.message
        return Verdict(allowed=False, status=matching_error_status(exc), report=report)

    @staticmethod
    def _note_conditions(report: DispatchReport, hook: Webhook, decision: MatchDecision) -> None:
        facts: ConditionFacts | None = getattr(decision, "conditions", None)
        if facts is not None:
            report.conditions.append(
                ConditionRecord(
                    name=hook.name,
                    excluded=facts.excluded,
                    evaluation_errors=facts.evaluation_errors,
                    seconds=facts.evaluation_seconds,
                )
            )

    # --- validating ------------------------------------------------------------------------------

    async def validate(self, inbound: InboundReview, snapshot: Snapshot, *, deadline: float) -> Verdict:
        """VAL-01..10: match all, call the matching ones concurrently, combine in config order."""
        attrs = inbound.attributes
        report = DispatchReport(kind="validating", operation=attrs.operation)
        if is_exempt(attrs, exclude_virtual_resources=self.settings.exclude_virtual_resources):
            return Verdict(allowed=True, report=report)
        hooks = snapshot.validating
        if not hooks:
            return Verdict(allowed=True, report=report)
        ns = await self._namespace_labels(hooks, attrs, deadline)

        selected: list[tuple[Webhook, CallingWebhookError | None]] = []
        decisions = decide_all(
            hooks, attrs, ns, equivalents=self.settings.equivalents, inputs=_condition_inputs(inbound, hooks)
        )
        for hook, decision in zip(hooks, decisions, strict=True):
            self._note_conditions(report, hook, decision)
            if isinstance(decision, Refuse):  # VAL-01: the first matching error answers, nobody is called
                return self._matching_error_verdict(report, hook, decision.error)
            if isinstance(decision, Call):
                selected.append((hook, None))
            elif isinstance(decision, CallFailure):
                selected.append((hook, decision.error))
        report.matched = len(selected)
        if not selected:
            return Verdict(allowed=True, report=report)  # VAL-02

        results: list[_ValidatingResult | None] = [None] * len(selected)

        async def run(i: int, hook: Webhook, pre_error: CallingWebhookError | None) -> None:
            results[i] = await self._validate_one(hook, inbound, attrs, pre_error, deadline=deadline)

        if len(selected) == 1:  # nothing to run concurrently: spare the nursery and its task
            await run(0, *selected[0])
        else:
            async with trio.open_nursery() as nursery:
                for i, (hook, pre_error) in enumerate(selected):
                    nursery.start_soon(run, i, hook, pre_error)

        # Combine strictly in configuration order (VAL-07, AUD-07 [GW]).
        denials: list[Status] = []
        annotations = AuditAnnotations()
        warnings = Warnings(max_bytes=self.settings.max_warning_bytes)
        for i, result in enumerate(results):
            assert result is not None  # every task stores its result or the nursery raised
            report.invocations.append(result.record)
            if result.response is not None:
                report.dropped += annotations.add_backend(
                    result.record.name, result.response.audit_annotations
                )
                report.dropped += warnings.add(result.response.warnings)
            if result.failed_open:
                annotations.add_gateway(failed_open_key("validating", 0, i), result.record.name)
            if result.denial is not None:
                if not denials:
                    report.denied_by = result.record.name
                denials.append(result.denial)
        report.deadline_exhausted = trio.current_time() >= deadline and any(
            r is not None and r.record.error_kind == "timeout" for r in results
        )
        if denials:
            combined = status.combine_denials(denials, limit=self.settings.max_denial_message_bytes)
            report.allowed = False
            report.deny_reason = combined.message
            return Verdict(
                allowed=False,
                status=combined,
                warnings=warnings.as_list(),
                audit_annotations=annotations.as_dict(),
                report=report,
            )
        return Verdict(
            allowed=True, warnings=warnings.as_list(), audit_annotations=annotations.as_dict(), report=report
        )

    async def _validate_one(
        self,
        hook: Webhook,
        inbound: InboundReview,
        attrs: AdmissionAttributes,
        pre_error: CallingWebhookError | None,
        *,
        deadline: float,
    ) -> _ValidatingResult:
        """One validating backend → its outcome value (VAL-05/06)."""
        started = self._clock()
        record = InvocationRecord(
            name=hook.name,
            configuration=hook.configuration,
            round=0,
            index=hook.index,
            outcome="allowed",
            code=200,
            duration_seconds=0.0,
        )
        result = _ValidatingResult(record=record)
        try:
            if attrs.dry_run and hook.side_effects in ("Unknown", "Some"):  # FPT-09
                result.denial = status.dry_run_status(hook.name)
                record.outcome, record.code, record.reason = "internal_error", 0, result.denial.message
                return result
            try:
                if pre_error is not None:
                    raise pre_error
                if trio.current_time() >= deadline:  # VAL-10
                    raise deadline_exceeded(self.caller, hook)
                called = await call_backend(
                    self.caller, hook, inbound, attrs, deadline=deadline, mutating=False
                )
            except CallingWebhookError as exc:
                self._call_error(hook, exc, record)
                if hook.failure_policy == "Ignore":
                    result.failed_open = True
                else:
                    result.denial = status.call_error_status(hook.name, exc.reason)
                return result
            record.version, record.backend_uid = called.version, called.backend_uid
            result.response = called.response
            if not called.response.allowed:
                result.denial = status.rejection_status(hook.name, called.response.status)
                record.outcome, record.code = "rejected", _cap(result.denial.code)
                record.reason = result.denial.message
            return result
        except trio.Cancelled:
            record.outcome = "cancelled"
            raise
        except Exception as exc:
            log.exception("backend handling failed", webhook=hook.name)
            if hook.failure_policy == "Ignore":
                record.outcome, record.code, record.reason = "failed_open", 500, repr(exc)
                result.failed_open = True
            else:
                result.denial = status.panicked_status(hook.name, str(exc))
                record.outcome, record.code, record.reason = "failed_closed", 500, result.denial.message
            return result
        finally:
            record.duration_seconds = self._clock() - started

    def _call_error(self, hook: Webhook, exc: CallingWebhookError, record: InvocationRecord) -> None:
        record.code = _cap(exc.status_code)
        record.reason = exc.reason
        record.error_kind = exc.kind
        if hook.failure_policy == "Ignore":
            record.outcome = "failed_open"  # logged (FPT-03) and counted (MET-04) by observability
        else:
            record.outcome = "failed_closed"

    # --- mutating --------------------------------------------------------------------------------

    async def mutate(self, inbound: InboundReview, snapshot: Snapshot, *, deadline: float) -> Verdict:
        """MUT-01..25: the serial chain with reinvocation; one combined patch in the reply."""
        attrs = inbound.attributes
        report = DispatchReport(kind="mutating", operation=attrs.operation)
        if is_exempt(attrs, exclude_virtual_resources=self.settings.exclude_virtual_resources):
            return Verdict(allowed=True, report=report)
        hooks = snapshot.mutating
        if not hooks:
            return Verdict(allowed=True, report=report)
        chain = _Chain(self, inbound, attrs, report, deadline)
        chain.inputs = _condition_inputs(inbound, hooks)
        chain.ns = await self._namespace_labels(hooks, attrs, deadline)
        try:
            await chain.run(hooks)
        except _Refused as refused:  # MUT-02: earlier patches are discarded
            verdict = self._matching_error_verdict(report, refused.hook, refused.error)
            verdict.warnings = chain.warnings.as_list()
            verdict.audit_annotations = chain.annotations.as_dict()
            return verdict
        except _Deny as deny:  # MUT-13/14/FPT-09/MUT-06..10: deny without patch
            report.allowed = False
            report.denied_by = deny.by
            report.deny_reason = deny.status.message
            return Verdict(
                allowed=False,
                status=deny.status,
                warnings=chain.warnings.as_list(),
                audit_annotations=chain.annotations.as_dict(),
                report=report,
            )
        return Verdict(
            allowed=True,
            patch=chain.combined_patch(),
            warnings=chain.warnings.as_list(),
            audit_annotations=chain.annotations.as_dict(),
            report=report,
        )


@dataclass(slots=True)
class _ValidatingResult:
    record: InvocationRecord
    response: Any = None  # BackendResponse of a verified reply
    denial: Status | None = None
    failed_open: bool = False


def _condition_inputs(inbound: InboundReview, hooks: tuple[Webhook, ...]) -> ConditionInputs:
    """CEL's ``request`` (MAT-25) with what only the inbound review carries: userInfo and options.

    Built only when some backend has match conditions: most reviews never evaluate CEL.
    """
    if not any(h.match_conditions for h in hooks):
        return ConditionInputs()
    request = inbound.request
    fields = request_fields(inbound.attributes)
    user = request.user_info
    fields["userInfo"] = {
        "username": user.username,
        "uid": user.uid,
        "groups": list(user.groups),
        "extra": {key: list(values) for key, values in user.extra.items()},
    }
    try:
        fields["options"] = None if is_null(request.options) else _decode(request.options)
    except msgspec.DecodeError:
        fields["options"] = None
    return ConditionInputs(request=fields)


class _Chain:
    """State of one mutating chain: the current object, applied patches, reinvocation sets."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        inbound: InboundReview,
        attrs: AdmissionAttributes,
        report: DispatchReport,
        deadline: float,
    ) -> None:
        self.d = dispatcher
        self.inbound = inbound
        self.attrs = attrs
        self.report = report
        self.deadline = deadline
        self.ns: Any = None
        self.inbound_doc: Any = None  # decoded lazily, only when a patch arrives
        self.doc: Any = None
        self.patches: list[bytes] = []
        self.state = ReinvocationState()
        self.annotations = AuditAnnotations()
        self.warnings = Warnings(max_bytes=dispatcher.settings.max_warning_bytes)
        self.inputs = ConditionInputs()  # CEL variables, decoded once per object version (set by mutate)

    async def run(self, hooks: tuple[Webhook, ...]) -> None:
        for round_ in (0, 1):
            if round_ == 1 and not self.state.should_run_round_1:
                return
            for hook in hooks:
                if round_ == 1 and not self.state.should_reinvoke(hook.identity):
                    continue  # MUT-16/17: only backends in R, and only those invoked in round 0
                decision = should_call(
                    hook, self.attrs, self.ns, equivalents=self.d.settings.equivalents, inputs=self.inputs
                )
                Dispatcher._note_conditions(self.report, hook, decision)
                if isinstance(decision, Refuse):
                    raise _Refused(hook, decision.error)
                if isinstance(decision, Call):
                    await self._invoke(hook, round_, None)
                elif isinstance(decision, CallFailure):
                    await self._invoke(hook, round_, decision.error)

    async def _invoke(self, hook: Webhook, round_: int, pre_error: CallingWebhookError | None) -> None:
        """MUT-01: dry-run check, call, process the reply (REV-11), update reinvocation bookkeeping."""
        self.report.matched += 1
        attrs = self.attrs
        if round_ == 1:
            self.report.reinvoked.append(hook.name)
        if attrs.dry_run and hook.side_effects in ("Unknown", "Some"):  # FPT-09: stop the chain
            st = status.dry_run_status(hook.name)
            self._record(hook, round_, "internal_error", 0, 0.0, reason=st.message)
            raise _Deny(st, hook.name)
        started = self.d._clock()
        changed = False
        try:
            if pre_error is not None:
                raise pre_error
            if trio.current_time() >= self.deadline:  # FPT-08: not yet started when the budget ran out
                self.report.deadline_exhausted = True
                raise deadline_exceeded(self.d.caller, hook)
            called = await call_backend(
                self.d.caller, hook, self.inbound, attrs, deadline=self.deadline, mutating=True
            )
            changed = self._process(hook, round_, called, started)
        except CallingWebhookError as exc:
            record = self._record(hook, round_, "allowed", 200, self.d._clock() - started)
            self.d._call_error(hook, exc, record)
            self.annotations.add_gateway(
                mutation_key(round_, hook.index), mutation_value(hook.configuration, hook.name, mutated=False)
            )
            if hook.failure_policy != "Ignore":
                raise _Deny(status.call_error_status(hook.name, exc.reason), hook.name) from None
            self.annotations.add_gateway(failed_open_key("mutating", round_, hook.index), hook.name)
        self.state.record(hook.identity, if_needed=hook.reinvocation_policy == "IfNeeded", changed=changed)

    def _record(
        self, hook: Webhook, round_: int, outcome: Any, code: int, seconds: float, *, reason: str = ""
    ) -> InvocationRecord:
        record = InvocationRecord(
            name=hook.name,
            configuration=hook.configuration,
            round=round_,
            index=hook.index,
            outcome=outcome,
            code=code,
            duration_seconds=seconds,
            reason=reason,
        )
        self.report.invocations.append(record)
        return record

    def _process(self, hook: Webhook, round_: int, called: Called, started: float) -> bool:
        """Handle a verified reply: annotations, warnings, then reject or apply the patch."""
        resp = called.response
        self.report.dropped += self.annotations.add_backend(hook.name, resp.audit_annotations)
        self.report.dropped += self.warnings.add(resp.warnings)
        if not resp.allowed:  # MUT-13
            st = status.rejection_status(hook.name, resp.status)
            rec = self._record(
                hook, round_, "rejected", _cap(st.code), self.d._clock() - started, reason=st.message
            )
            rec.version, rec.backend_uid = called.version, called.backend_uid
            self.annotations.add_gateway(
                mutation_key(round_, hook.index), mutation_value(hook.configuration, hook.name, mutated=False)
            )
            raise _Deny(st, hook.name)
        changed = False
        if resp.patch is not None:
            if called.version == "v1" and resp.patch_type != "JSONPatch":  # MUT-05
                raise CallingWebhookError(
                    f'unsupported patch type "{resp.patch_type}"', status_code=400, kind="bad_response"
                )
            try:
                ops = jsonpatch.decode_patch(resp.patch)
            except jsonpatch.PatchDecodeError as exc:  # MUT-04
                raise CallingWebhookError(
                    f"received undecodable patch in webhook response: {exc}",
                    status_code=503,
                    kind="bad_response",
                ) from None
            if ops:
                changed = self._apply(hook, round_, ops, resp.patch, started)
        rec = self._record(hook, round_, "allowed", 200, self.d._clock() - started)
        rec.version, rec.backend_uid, rec.mutated = called.version, called.backend_uid, changed
        self.annotations.add_gateway(
            mutation_key(round_, hook.index), mutation_value(hook.configuration, hook.name, mutated=changed)
        )
        return changed

    def _apply(
        self, hook: Webhook, round_: int, ops: list[dict[str, Any]], raw: bytes, started: float
    ) -> bool:
        """MUT-06..12: apply all-or-nothing to the current object; internal errors deny with 500."""

        def fail(st: Status) -> _Deny:
            self._record(hook, round_, "internal_error", 0, self.d._clock() - started, reason=st.message)
            self.annotations.add_gateway(
                mutation_key(round_, hook.index), mutation_value(hook.configuration, hook.name, mutated=False)
            )
            return _Deny(st, hook.name)

        if is_null(self.attrs.object):  # MUT-06: DELETE carries no object to modify
            raise fail(status.patch_on_delete_status(hook.name))
        if self.doc is None:
            self.inbound_doc = _decode(self.attrs.object)  # type: ignore[arg-type]
            self.doc = self.inbound_doc
        before = self.doc
        try:
            after = jsonpatch.apply_patch(before, ops)
        except jsonpatch.PatchApplyError as exc:  # MUT-07
            raise fail(status.patch_failure_status(hook.name, str(exc))) from None
        if not isinstance(after, dict):  # MUT-09
            raise fail(status.not_an_object_status(hook.name, f"patched object is a {type(after).__name__}"))
        if (after.get("apiVersion"), after.get("kind")) != (before.get("apiVersion"), before.get("kind")):
            raise fail(  # MUT-10
                status.changed_kind_status(
                    hook.name,
                    str(before.get("apiVersion", "")),
                    str(before.get("kind", "")),
                    str(after.get("apiVersion", "")),
                    str(after.get("kind", "")),
                )
            )
        self.patches.append(raw)
        if self.d.settings.audit_patches:
            self.annotations.add_gateway(
                patch_key(round_, hook.index),
                _encode(
                    {
                        "configuration": hook.configuration,
                        "webhook": hook.name,
                        "patch": ops,
                        "patchType": "JSONPatch",
                    }
                ).decode(),
            )
        changed = not jsonpatch.json_equal(before, after)
        if changed:
            self.doc = after
            self.attrs = self.attrs.with_object(msgspec.Raw(_encode(after)))
        return changed

    def combined_patch(self) -> bytes | None:
        """MUT-22..24: one patch from the inbound object to the final one, or None if equal."""
        if not self.patches or self.doc is None or jsonpatch.json_equal(self.inbound_doc, self.doc):
            return None
        if self.d.settings.patch_mode == "diff":
            return _encode(jsonpatch.diff_patch(self.inbound_doc, self.doc))
        return jsonpatch.concat_patches(self.patches)
