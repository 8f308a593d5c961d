"""The canonical log line: everything worth knowing about one review, as one structured event.

Built from what the server saw (endpoint, HTTP code, end-to-end time, the decoded review) and what
dispatch recorded (``DispatchReport``). Pure functions returning plain dicts, so the line can be
asserted field by field and rendered by any structlog renderer. Object bodies are included only when
the operator asked for them (``--log-bodies``); credentials are never part of these values.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from gateway.admission import AdmissionAttributes, Status
from gateway.conversion.convert import ConversionReport
from gateway.dispatch.report import DispatchReport, InvocationRecord
from gateway.tracing import current_trace, parse_traceparent


class InboundLike(Protocol):
    """What the canonical line reads from a decoded inbound review (``review.codec.InboundReview``)."""

    @property
    def uid(self) -> str: ...

    @property
    def api_version(self) -> str: ...

    @property
    def attributes(self) -> AdmissionAttributes: ...


class VerdictLike(Protocol):
    """What the canonical line reads from the gateway's answer (``dispatch.engine.Verdict``)."""

    @property
    def allowed(self) -> bool: ...

    @property
    def status(self) -> Status | None: ...

    @property
    def patch(self) -> bytes | None: ...

    @property
    def warnings(self) -> list[str]: ...

    @property
    def report(self) -> DispatchReport | None: ...


def decision_of(verdict: VerdictLike | None) -> str:
    """``allowed`` / ``denied`` for an answered review; ``error`` when there was no verdict."""
    if verdict is None:
        return "error"
    return "allowed" if verdict.allowed else "denied"


def resource_path(attrs: AdmissionAttributes) -> str:
    """``group/version/resource[/subresource]``; the core group is written ``core``."""
    res = attrs.resource
    path = f"{res.group or 'core'}/{res.version}/{res.resource}"
    return f"{path}/{attrs.sub_resource}" if attrs.sub_resource else path


def trace_id_of(traceparent: str) -> str:
    """The review's trace id: the one bound by ``tracing.start_review_trace``, else the header's."""
    bound = current_trace.get()
    if bound is not None:
        return bound[0]
    if traceparent:
        parsed = parse_traceparent(traceparent)
        if parsed is not None:
            return parsed[0]
    return ""


def backend_seconds_of(report: DispatchReport) -> float:
    """``report.backend_seconds``: the longest invocation of a fan-out, the sum of a chain.

    For the common single invocation that is its duration, without building a list.
    """
    invocations = report.invocations
    if len(invocations) == 1:
        return invocations[0].duration_seconds
    return report.backend_seconds


def _ms(seconds: float) -> float:
    # Milliseconds with three decimals; integer arithmetic is three times cheaper than round().
    return int(seconds * 1_000_000.0 + 0.5) / 1000.0


def backend_entry(record: InvocationRecord) -> dict[str, Any]:
    """One backend invocation as it appears in the ``backends`` list of the canonical line."""
    entry: dict[str, Any] = {
        "name": record.name,
        "round": record.round,
        "outcome": record.outcome,
        "code": record.code,
        "ms": int(record.duration_seconds * 1_000_000.0 + 0.5) / 1000.0,
    }
    if record.version:
        entry["version"] = record.version
    if record.backend_uid:
        entry["uid"] = record.backend_uid  # REV-15: the backend's own uid, for correlation
    if record.outcome != "allowed":
        if record.reason:
            entry["reason"] = record.reason
        if record.error_kind:
            entry["error_kind"] = record.error_kind
    elif record.mutated:
        entry["mutated"] = True
    if record.mode != "Enforce":
        entry["mode"] = record.mode  # its outcome was recorded, never enforced
    return entry


def review_fields(
    endpoint: str,
    *,
    code: int,
    seconds: float,
    inbound: InboundLike | None,
    verdict: VerdictLike | None,
    error: str = "",
    trace_id: str = "",
    log_bodies: bool = False,
    backend_seconds: float | None = None,
) -> dict[str, Any]:
    """The fields of the canonical ``review`` event (without the event name itself).

    Always: endpoint, decision, code, total_ms. With a decoded review: uid, api_version, operation,
    resource, namespace/name. With a verdict: denied_by and reason on a deny, the per-backend list,
    backend_ms and overhead_ms. ``error`` is the failure text of a request that got no verdict.
    ``backend_seconds`` is the report's, when the caller has it already. Once per review: dicts are
    built as literals and milliseconds inline (the field order is the line's; golden-tested).
    """
    fields: dict[str, Any]
    decision = decision_of(verdict)
    if inbound is not None:
        attrs = inbound.attributes
        fields = {
            "uid": inbound.uid,
            "endpoint": endpoint,
            "api_version": inbound.api_version,
            "operation": attrs.operation,
            "resource": resource_path(attrs),
        }
        if attrs.namespace:
            fields["namespace"] = attrs.namespace
        if attrs.name:
            fields["name"] = attrs.name
        if attrs.dry_run:
            fields["dry_run"] = True
        fields["decision"] = decision
        fields["code"] = code
    else:
        fields = {
            "endpoint": endpoint,
            "decision": decision,
            "code": code,
        }
    report = verdict.report if verdict is not None else None
    if verdict is not None and not verdict.allowed:
        denied_by = report.denied_by if report is not None else ""
        if denied_by:
            fields["denied_by"] = denied_by
        reason = report.deny_reason if report is not None else ""
        if not reason and verdict.status is not None:
            reason = verdict.status.message
        fields["reason"] = reason
    if error:
        fields["error"] = error
    if report is not None and report.invocations:
        fields["backends"] = [backend_entry(r) for r in report.invocations]
    fields["total_ms"] = int(seconds * 1_000_000.0 + 0.5) / 1000.0  # _ms, inline
    if report is not None:
        if backend_seconds is None:
            backend_seconds = report.backend_seconds
        fields["backend_ms"] = int(backend_seconds * 1_000_000.0 + 0.5) / 1000.0
        overhead = seconds - backend_seconds if seconds > backend_seconds else 0.0
        fields["overhead_ms"] = int(overhead * 1_000_000.0 + 0.5) / 1000.0
        if report.reinvoked:
            fields["reinvoked"] = report.reinvoked
        if report.modes:  # which backends ran in a rollout mode (every other one enforced)
            fields["modes"] = {m.name: m.mode for m in report.modes}
        if report.deadline_exhausted:
            fields["deadline_exhausted"] = True
    if verdict is not None:
        if verdict.patch:
            fields["patched"] = True
        if verdict.warnings:
            fields["warnings"] = len(verdict.warnings)
    if trace_id:
        fields["trace_id"] = trace_id
    if log_bodies:
        _add_bodies(fields, inbound, verdict)
    return fields


def _add_bodies(fields: dict[str, Any], inbound: InboundLike | None, verdict: VerdictLike | None) -> None:
    """``--log-bodies``: the objects and the combined patch, embedded as JSON (debugging only)."""
    if inbound is not None:
        attrs = inbound.attributes
        if attrs.object is not None:
            fields["object"] = attrs.object
        if attrs.old_object is not None:
            fields["old_object"] = attrs.old_object
    if verdict is not None and verdict.patch:
        fields["patch"] = _json_or_text(verdict.patch)


def _json_or_text(body: bytes) -> msgspec.Raw | str:
    # Raw is embedded verbatim by the JSON renderer, so it must be valid JSON or the line breaks.
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace")
    return msgspec.Raw(body)


def failed_open_fields(endpoint: str, uid: str, record: InvocationRecord, trace_id: str) -> dict[str, Any]:
    """FPT-03: the warning written for a call error ignored under ``failurePolicy: Ignore``."""
    fields: dict[str, Any] = {
        "uid": uid,
        "endpoint": endpoint,
        "webhook": record.name,
        "round": record.round,
        "code": record.code,
        "error": record.reason,
    }
    if record.error_kind:
        fields["error_kind"] = record.error_kind
    if trace_id:
        fields["trace_id"] = trace_id
    return fields


def conversion_fields(report: ConversionReport, trace_id: str) -> dict[str, Any]:
    """The canonical line of one conversion request: CRD, versions, objects, backend, result, time."""
    fields: dict[str, Any] = {
        "endpoint": "conversion",
        "code": report.code,
        "crd": report.crd,
        "uid": report.uid,
        "review_version": report.inbound_version,
        "from_version": report.from_version,
        "to_version": report.to_version,
        "objects": report.objects,
        "backend": report.backend,
        "result": report.result,
        "failure_type": report.failure_type,
        "duration_ms": _ms(report.seconds),
        "backend_ms": _ms(report.backend_seconds),
        "called": report.called,
        "trace_id": trace_id,
    }
    if report.reason:
        fields["reason"] = report.reason
    if report.cache_hits or report.cache_misses:
        fields["cache_hits"], fields["cache_misses"] = report.cache_hits, report.cache_misses
    return fields
