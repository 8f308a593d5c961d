"""Logs: the canonical review line, FPT-03 fail-open warnings, configuration lines, and the output pipeline.

Reviews are real decoded AdmissionReviews (``review.inbound.decode_inbound``); dispatch reports are
built by hand. Lines are captured with ``structlog.testing.capture_logs`` or, for the output format,
read back from the stream ``configure_logging`` writes to.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import os
import types
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import structlog
from structlog.testing import capture_logs

from gateway.admission import Status
from gateway.config.model import ClientConfig, Snapshot, Webhook
from gateway.config.selectors import LabelSelector
from gateway.dispatch.engine import Verdict
from gateway.dispatch.report import (
    ConditionRecord,
    DispatchReport,
    InvocationOutcome,
    InvocationRecord,
    ModeRecord,
)
from gateway.errors import ConfigProblem
from gateway.observability.logs import configure_logging
from gateway.observability.metrics import Metrics
from gateway.observability.observer import Observability
from gateway.review.inbound import InboundReview, decode_inbound
from gateway.tracing import current_trace

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
OBJECT = b'{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"web","labels":{"app":"web"}}}'


def inbound(
    *,
    group: str = "apps",
    version: str = "v1",
    resource: str = "deployments",
    sub_resource: str = "",
    namespace: str = "team-a",
    name: str = "web",
    operation: str = "CREATE",
    dry_run: bool = False,
    api_version: str = "admission.k8s.io/v1",
) -> InboundReview:
    """A real inbound review, decoded by the codec the server uses."""
    request: dict[str, Any] = {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": group, "version": version, "kind": "Deployment"},
        "resource": {"group": group, "version": version, "resource": resource},
        "operation": operation,
        "userInfo": {"username": "alice"},
        "object": json.loads(OBJECT),
        "dryRun": dry_run,
    }
    if sub_resource:
        request["subResource"] = sub_resource
    if namespace:
        request["namespace"] = namespace
    if name:
        request["name"] = name
    body = {"apiVersion": api_version, "kind": "AdmissionReview", "request": request}
    return decode_inbound(json.dumps(body).encode())


def rec(
    name: str,
    outcome: InvocationOutcome = "allowed",
    code: int = 200,
    seconds: float = 0.002,
    *,
    reason: str = "",
    error_kind: str = "",
) -> InvocationRecord:
    return InvocationRecord(
        name=name,
        configuration="policies",
        round=0,
        index=0,
        outcome=outcome,
        code=code,
        duration_seconds=seconds,
        version="v1",
        backend_uid="b-uid",
        reason=reason,
        error_kind=error_kind,
    )


def answer(
    kind: str, *records: InvocationRecord, denied_by: str = "", deny_reason: str = "", **kw: Any
) -> Verdict:
    report = DispatchReport(kind=kind, operation="CREATE", invocations=list(records))  # type: ignore[arg-type]
    report.denied_by, report.deny_reason = denied_by, deny_reason
    report.allowed = not deny_reason
    return Verdict(allowed=report.allowed, report=report, **kw)


def observe(
    obs: Observability,
    endpoint: str,
    verdict: Verdict | None,
    *,
    review: InboundReview | None = None,
    code: int = 200,
    seconds: float = 0.01,
    error: str = "",
    trace: str = "",
) -> None:
    obs.review_started(endpoint)
    obs.review_finished(
        endpoint,
        code=code,
        seconds=seconds,
        inbound=review if review is not None or verdict is None else inbound(),
        verdict=verdict,
        error=error,
        trace=trace,
    )


def review_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "review"]


DENY = 'admission webhook "deny.example.com" denied the request: image registry not allowed'
FAIL = (
    'Internal error occurred: failed calling webhook "slow.example.com": failed to call webhook: '
    'Post "https://slow.svc:443/check?timeout=1s": context deadline exceeded'
)


@pytest.mark.parametrize(
    ("endpoint", "verdict", "code", "error", "level", "expected", "absent"),
    [
        pytest.param(
            "validating",
            answer("validating", rec("a.example.com"), rec("b.example.com")),
            200,
            "",
            "info",
            {"decision": "allowed", "code": 200, "uid": "705ab4f5-6393-11e8-b7cc-42010a800002"},
            {"denied_by", "reason", "error"},
            id="an allowed review: decision allowed, code 200, no deny fields",
        ),
        pytest.param(
            "validating",
            answer(
                "validating",
                rec("a.example.com"),
                rec("deny.example.com", "rejected", 403, reason=DENY),
                denied_by="deny.example.com",
                deny_reason=DENY,
            ),
            200,
            "",
            "info",
            {"decision": "denied", "denied_by": "deny.example.com", "reason": DENY},
            {"error"},
            id="ERR-01: a rejection names the backend that denied and why",
        ),
        pytest.param(
            "mutating",
            answer(
                "mutating",
                rec("slow.example.com", "failed_closed", 500, reason=FAIL, error_kind="timeout"),
                denied_by="slow.example.com",
                deny_reason=FAIL,
            ),
            200,
            "",
            "info",
            {"decision": "denied", "denied_by": "slow.example.com", "reason": FAIL},
            set(),
            id="FPT-04/ERR-02: a fail-closed timeout names the backend and the call error",
        ),
        pytest.param(
            "validating",
            answer("validating", deny_reason='namespaces "gone" not found'),
            200,
            "",
            "info",
            {"decision": "denied", "reason": 'namespaces "gone" not found'},
            {"denied_by", "backends"},
            id="MAT-16: a deny before any call has a reason and no backend",
        ),
        pytest.param(
            "validating",
            answer(
                "validating",
                denied_by="not-ready",
                deny_reason='deployments.apps "web" is forbidden: not yet ready to handle request',
            ),
            200,
            "",
            "info",
            {"decision": "denied", "denied_by": "not-ready"},
            set(),
            id="MAT-33: a not-ready deny says so",
        ),
        pytest.param(
            "validating",
            Verdict(allowed=False, status=Status(status="Failure", message="from status", code=500)),
            200,
            "",
            "info",
            {"decision": "denied", "reason": "from status"},
            {"backends", "backend_ms"},
            id="a verdict without report takes its reason from the status",
        ),
        pytest.param(
            "mutating",
            None,
            400,
            "request.uid is required",
            "warning",
            {"decision": "error", "code": 400, "error": "request.uid is required", "endpoint": "mutating"},
            {"uid", "backends", "backend_ms", "overhead_ms"},
            id="REV-01: a malformed review (400) is logged with its error",
        ),
        pytest.param(
            "validating",
            None,
            413,
            "request body exceeds 1024 bytes",
            "warning",
            {"decision": "error", "code": 413, "error": "request body exceeds 1024 bytes"},
            {"uid"},
            id="TRN-13: an oversize review (413) is logged with its error",
        ),
        pytest.param(
            "validating",
            None,
            499,
            "caller disconnected",
            "warning",
            {"decision": "error", "code": 499, "error": "caller disconnected"},
            set(),
            id="a review abandoned by the caller is logged as an error 499",
        ),
        pytest.param(
            "validating",
            None,
            500,
            "boom",
            "error",
            {"decision": "error", "code": 500},
            set(),
            id="a request that failed inside the gateway (500) is logged at error level",
        ),
    ],
)
def test_canonical_line_per_decision(
    endpoint: str,
    verdict: Verdict | None,
    code: int,
    error: str,
    level: str,
    expected: dict[str, Any],
    absent: set[str],
) -> None:
    """Exactly one ``review`` line per request, with the decision, who denied and why."""
    with capture_logs() as logs:
        obs = Observability(metrics=False)
        review = inbound() if verdict is not None else None
        observe(obs, endpoint, verdict, review=review, code=code, error=error)
    lines = review_lines(logs)
    assert len(lines) == 1
    line = lines[0]
    assert line["log_level"] == level
    assert line["endpoint"] == endpoint
    assert {k: line.get(k) for k in expected} == expected
    assert absent.isdisjoint(line)


def test_canonical_line_backend_list() -> None:
    """Per backend: name, round, outcome, code, ms, version, backend uid, and the reason when it failed."""
    verdict = answer(
        "validating",
        rec("a.example.com", seconds=0.0012345),
        rec(
            "b.example.com",
            "failed_open",
            503,
            seconds=0.004,
            reason="failed to call webhook: refused",
            error_kind="connect",
        ),
    )
    with capture_logs() as logs:
        observe(Observability(metrics=False), "validating", verdict)
    assert review_lines(logs)[0]["backends"] == [
        {
            "name": "a.example.com",
            "round": 0,
            "outcome": "allowed",
            "code": 200,
            "ms": 1.235,
            "version": "v1",
            "uid": "b-uid",
        },
        {
            "name": "b.example.com",
            "round": 0,
            "outcome": "failed_open",
            "code": 503,
            "ms": 4.0,
            "version": "v1",
            "uid": "b-uid",
            "reason": "failed to call webhook: refused",
            "error_kind": "connect",
        },
    ]


@pytest.mark.parametrize(
    ("endpoint", "durations", "total", "backend", "overhead"),
    [
        pytest.param(
            "validating",
            (0.003, 0.005),
            0.009,
            5.0,
            4.0,
            id="validating: backend time is the slowest call of the fan-out",
        ),
        pytest.param(
            "mutating", (0.003, 0.005), 0.009, 8.0, 1.0, id="mutating: backend time is the sum of the chain"
        ),
    ],
)
def test_canonical_line_timings(
    endpoint: str, durations: tuple[float, ...], total: float, backend: float, overhead: float
) -> None:
    """total_ms, backend_ms and overhead_ms (end-to-end minus backend time)."""
    verdict = answer(endpoint, *(rec(f"h{i}.example.com", seconds=d) for i, d in enumerate(durations)))
    with capture_logs() as logs:
        observe(Observability(metrics=False), endpoint, verdict, seconds=total)
    line = review_lines(logs)[0]
    assert (line["total_ms"], line["backend_ms"], line["overhead_ms"]) == (total * 1000, backend, overhead)


@pytest.mark.parametrize(
    ("review", "expected", "absent"),
    [
        pytest.param(
            inbound(),
            {
                "api_version": "admission.k8s.io/v1",
                "operation": "CREATE",
                "resource": "apps/v1/deployments",
                "namespace": "team-a",
                "name": "web",
            },
            {"dry_run"},
            id="a namespaced object: resource, namespace and name",
        ),
        pytest.param(
            inbound(group="", resource="pods", sub_resource="status", operation="UPDATE"),
            {"operation": "UPDATE", "resource": "core/v1/pods/status"},
            set(),
            id="the core group is written core, and a subresource is appended",
        ),
        pytest.param(
            inbound(group="", resource="namespaces", namespace=""),
            {"name": "web"},
            {"namespace"},
            id="a cluster-scoped object has no namespace field",
        ),
        pytest.param(
            inbound(dry_run=True, api_version="admission.k8s.io/v1beta1"),
            {"dry_run": True, "api_version": "admission.k8s.io/v1beta1"},
            set(),
            id="a dry run and the inbound review version are recorded",
        ),
    ],
)
def test_canonical_line_request_identity(
    review: InboundReview, expected: dict[str, Any], absent: set[str]
) -> None:
    """The line identifies the request: uid, apiVersion, operation, resource, namespace/name."""
    with capture_logs() as logs:
        observe(Observability(metrics=False), "validating", answer("validating"), review=review)
    line = review_lines(logs)[0]
    assert line["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    assert {k: line.get(k) for k in expected} == expected
    assert absent.isdisjoint(line)


def test_canonical_line_extras() -> None:
    """Reinvocation, deadline exhaustion, a returned patch and warnings show up when they happen."""
    verdict = answer(
        "mutating", rec("a.example.com"), patch=b'[{"op":"add","path":"/x","value":1}]', warnings=["w"]
    )
    assert verdict.report is not None
    verdict.report.reinvoked = ["a.example.com"]
    verdict.report.deadline_exhausted = True
    with capture_logs() as logs:
        observe(Observability(metrics=False), "mutating", verdict)
    line = review_lines(logs)[0]
    assert {k: line[k] for k in ("reinvoked", "deadline_exhausted", "patched", "warnings")} == {
        "reinvoked": ["a.example.com"],
        "deadline_exhausted": True,
        "patched": True,
        "warnings": 1,
    }


# --- FPT-03 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "warned"),
    [
        pytest.param(
            rec(
                "ign.example.com",
                "failed_open",
                503,
                reason="failed to call webhook: timeout",
                error_kind="timeout",
            ),
            True,
            id="FPT-03: a call error under Ignore is a warning with the webhook and the error text",
        ),
        pytest.param(
            rec("ign.example.com", "failed_closed", 503, reason="failed to call webhook: timeout"),
            False,
            id="FPT-03: a call error under Fail is no fail-open warning",
        ),
        pytest.param(
            rec("ign.example.com", "cancelled", 503, reason="cancelled"),
            False,
            id="FPT-03: a call cancelled because the caller went away is not reported as failing open",
        ),
        pytest.param(rec("ign.example.com"), False, id="FPT-03: a successful call gives no warning"),
    ],
)
@pytest.mark.parametrize("review_log", [True, False], ids=["review log on", "review log off"])
def test_fail_open_warning(record: InvocationRecord, warned: bool, review_log: bool) -> None:
    """FPT-03: every ignored call error is logged as a warning, even with the review line turned off."""
    with capture_logs() as logs:
        obs = Observability(metrics=False, review_log=review_log)
        observe(obs, "validating", answer("validating", record), trace=TRACEPARENT)
    warnings = [e for e in logs if e["event"] == "backend failed open"]
    if not warned:
        assert warnings == []
        return
    assert warnings == [
        {
            "event": "backend failed open",
            "log_level": "warning",
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "endpoint": "validating",
            "webhook": "ign.example.com",
            "round": 0,
            "code": 503,
            "error": "failed to call webhook: timeout",
            "error_kind": "timeout",
            "trace_id": TRACE_ID,
        }
    ]
    assert len(review_lines(logs)) == (1 if review_log else 0)


NOT_MADE = [
    pytest.param(
        "shed",
        [0.0, 0.1, 0.5, 0.99, 1.2, 1.3, 2.5],
        [(0.0, 0), (1.2, 3), (2.5, 1)],
        id="a call not made because the review was shed is warned once per webhook per second, "
        "the next warning counting the ones left out",
    ),
    pytest.param(
        "circuit_open",
        [0.0, 0.2, 0.4],
        [(0.0, 0)],
        id="a call not made because the circuit is open is warned once per webhook per second",
    ),
    pytest.param(
        "max_in_flight",
        [0.0, 1.0, 2.0],
        [(0.0, 0), (1.0, 0), (2.0, 0)],
        id="a call not made because of maxInFlight: one a second is each warned",
    ),
    pytest.param(
        "timeout",
        [0.0, 0.1, 0.2],
        [(0.0, 0), (0.1, 0), (0.2, 0)],
        id="FPT-03: a call that was made and failed is warned every time, however often",
    ),
]


@pytest.mark.parametrize(("kind", "at", "warned"), NOT_MADE)
def test_calls_not_made_are_warned_at_most_once_a_second(
    kind: str, at: list[float], warned: list[tuple[float, int]]
) -> None:
    """An overload (or an open circuit) makes every review fail open on the same backends: one
    warning per review would flood the log, so calls the gateway did not make are throttled per
    webhook and reason; each review's own line still lists them, and the metrics count every one."""
    now = [0.0]
    with capture_logs() as logs:
        obs = Observability(metrics=False, clock=lambda: now[0])
        for t in at:
            now[0] = t
            record = rec("ign.example.com", "failed_open", 503, reason="not made", error_kind=kind)
            other = rec("other.example.com", "failed_open", 503, reason="not made", error_kind=kind)
            observe(obs, "validating", answer("validating", record, other))
    for webhook in ("ign.example.com", "other.example.com"):
        warnings = [e for e in logs if e["event"] == "backend failed open" and e["webhook"] == webhook]
        assert [e.get("suppressed", 0) for e in warnings] == [n for _, n in warned]
    assert len(review_lines(logs)) == len(at), "every review keeps its own line"


def test_dropped_entries_are_warned() -> None:
    """AUD-02: annotations or warnings dropped by dispatch are logged as a warning."""
    verdict = answer("validating", rec("a.example.com"))
    assert verdict.report is not None
    verdict.report.dropped = ["a.example.com/bad key: dropped (not a qualified name)"]
    with capture_logs() as logs:
        observe(Observability(metrics=False), "validating", verdict)
    dropped = [e for e in logs if e["event"] == "review entries dropped"]
    assert [e["dropped"] for e in dropped] == [["a.example.com/bad key: dropped (not a qualified name)"]]


# --- bodies, credentials, trace ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("log_bodies", "present"),
    [
        pytest.param(False, False, id="objects and patches are not logged by default"),
        pytest.param(True, True, id="--log-bodies adds the object and the combined patch"),
    ],
)
def test_bodies_only_with_log_bodies(log_bodies: bool, present: bool) -> None:
    """Object bodies appear in the canonical line only when asked for."""
    patch = b'[{"op":"add","path":"/metadata/labels/x","value":"y"}]'
    with capture_logs() as logs:
        obs = Observability(metrics=False, log_bodies=log_bodies)
        observe(obs, "mutating", answer("mutating", rec("a.example.com"), patch=patch))
    line = review_lines(logs)[0]
    if not present:
        assert {"object", "old_object", "patch"}.isdisjoint(line)
        assert '"app"' not in repr(line)
        return
    assert json.loads(bytes(line["object"])) == json.loads(OBJECT)
    assert "old_object" not in line  # CREATE: there is none
    assert bytes(line["patch"]) == patch


@pytest.mark.parametrize(
    ("bound", "header", "expected"),
    [
        pytest.param(None, TRACEPARENT, TRACE_ID, id="the caller's traceparent gives the trace id"),
        pytest.param(("1" * 32, "01"), TRACEPARENT, "1" * 32, id="the trace bound by the server wins"),
        pytest.param(None, "00-zz-not-a-trace", None, id="an invalid traceparent gives no trace id"),
        pytest.param(None, "", None, id="no traceparent, no trace id"),
    ],
)
def test_trace_id(bound: tuple[str, str] | None, header: str, expected: str | None) -> None:
    """The canonical line carries the W3C trace id of the review."""
    token = current_trace.set(bound)
    try:
        with capture_logs() as logs:
            observe(Observability(metrics=False), "validating", answer("validating"), trace=header)
    finally:
        current_trace.reset(token)
    assert review_lines(logs)[0].get("trace_id") == expected


def test_observer_never_raises() -> None:
    """A failure while recording is logged, never raised into the server."""

    class Broken:
        allowed = True
        status = None
        patch = None
        warnings: list[str] = []  # noqa: RUF012

        @property
        def report(self) -> DispatchReport:
            raise RuntimeError("broken report")

    with capture_logs() as logs:
        obs = Observability(metrics=True)
        obs.review_finished("validating", code=200, seconds=0.001, inbound=inbound(), verdict=Broken())
    assert [(e["event"], e["log_level"]) for e in logs] == [("recording a review failed", "error")]


# --- ReviewObserver surface --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metrics", "enabled"),
    [
        pytest.param(True, True, id="metrics=True builds a Metrics"),
        pytest.param(Metrics(), True, id="a given Metrics is used"),
        pytest.param(False, False, id="metrics=False (--no-metrics): /metrics is not served"),
    ],
)
def test_metrics_endpoint_body(metrics: Metrics | bool, enabled: bool) -> None:
    """``metrics()`` returns the exposition, or None when metrics are off."""
    obs = Observability(metrics=metrics, review_log=False)
    observe(obs, "validating", answer("validating", rec("a.example.com")))
    got = obs.metrics()
    if not enabled:
        assert got is None
        return
    assert got is not None
    body, content_type = got
    assert content_type.startswith("text/plain; version=0.0.4")
    assert b'webhook_gateway_admission_webhook_request_total{code="200",name="a.example.com"' in body


def test_watch_pool() -> None:
    """``watch_pool`` exports the pool's open_connections() at scrape time."""

    class Pool:
        def __init__(self) -> None:
            self.counts = {"https://a.svc:443": 1}

        def open_connections(self) -> dict[str, int]:
            return self.counts

    pool = Pool()
    obs = Observability(metrics=True, review_log=False)
    obs.watch_pool(pool)
    pool.counts = {"https://a.svc:443": 3}
    got = obs.metrics()
    assert got is not None
    assert b'webhook_gateway_backend_open_connections{origin="https://a.svc:443"} 3.0' in got[0]


# --- CFG-25 ------------------------------------------------------------------------------------------


def _hook(name: str, kind: str) -> Webhook:
    return Webhook(
        name=name,
        configuration="policies",
        kind=kind,
        identity=f"policies/{name}/0",
        index=0,  # type: ignore[arg-type]
        client_config=ClientConfig(url="https://x.example.com"),
        rules=(),
        failure_policy="Fail",
        match_policy="Equivalent",
        namespace_selector=LabelSelector(),
        object_selector=LabelSelector(),
        side_effects="None",
        timeout_seconds=10,
        admission_review_versions=("v1",),
    )


SNAPSHOT = Snapshot(
    validating=(_hook("a.example.com", "validating"), _hook("b.example.com", "validating")),
    mutating=(_hook("m.example.com", "mutating"),),
    generation=4,
)
PROBLEM = ConfigProblem(
    file="config/team-a.yaml",
    message="must be between 1 and 30",
    kind="ValidatingWebhookConfiguration",
    name="team-a",
    path="webhooks[0].timeoutSeconds",
)
WARNING = ConfigProblem(file="config/team-b.yaml", message="sideEffects Unknown", severity="warning")


@pytest.mark.parametrize(
    ("ok", "problems", "expected"),
    [
        pytest.param(
            True,
            [],
            [("configuration loaded", "info", {"generation": 4, "validating": 2, "mutating": 1})],
            id="CFG-25: a load is logged with its generation and backend counts",
        ),
        pytest.param(
            True,
            [WARNING],
            [
                ("configuration loaded", "info", {"generation": 4}),
                ("configuration warning", "warning", {"problem": "config/team-b.yaml: sideEffects Unknown"}),
            ],
            id="CFG-24: each warning of a loaded set is a warning line",
        ),
        pytest.param(
            False,
            [PROBLEM],
            [
                (
                    "configuration refused; the last good configuration stays in force",
                    "error",
                    {
                        "generation": 4,
                        "problems": [
                            'config/team-a.yaml: ValidatingWebhookConfiguration "team-a" '
                            "webhooks[0].timeoutSeconds: must be between 1 and 30"
                        ],
                    },
                )
            ],
            id="CFG-23/25: a refused reload is an error line with every problem, file and path",
        ),
    ],
)
def test_config_reloaded(
    ok: bool, problems: list[ConfigProblem], expected: list[tuple[str, str, dict[str, Any]]]
) -> None:
    """CFG-25: every configuration load attempt is logged (and counted, MET-09)."""
    with capture_logs() as logs:
        obs = Observability(metrics=True)
        obs.config_reloaded(ok=ok, snapshot=SNAPSHOT, problems=problems)
    assert len(logs) == len(expected)
    for line, (event, level, fields) in zip(logs, expected, strict=True):
        assert (line["event"], line["log_level"]) == (event, level)
        assert {k: line[k] for k in fields} == fields
    got = obs.metrics()
    assert got is not None
    result = "success" if ok else "failure"
    assert f'webhook_gateway_config_reloads_total{{result="{result}"}} 1.0'.encode() in got[0]


# --- output pipeline (configure_logging) -------------------------------------------------------------


@pytest.fixture
def output() -> Iterator[io.TextIOWrapper]:
    """A text stream over a byte sink; structlog and stdlib logging are restored afterwards."""
    saved = structlog.get_config()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    yield io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    structlog.configure(**saved)
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    buffer = stream.buffer
    assert isinstance(buffer, io.BytesIO)
    return buffer.getvalue().decode()


def _json_lines(stream: io.TextIOWrapper) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _text(stream).splitlines()]


def test_json_output_is_one_object_per_line(output: io.TextIOWrapper) -> None:
    """JSON format: every line parses; timestamp (UTC, Z), level and event come first."""
    configure_logging("info", "json", stream=output)
    obs = Observability(metrics=False)
    verdict = answer("validating", rec("a.example.com"), rec("b.example.com", "failed_open", 503, reason="x"))
    observe(obs, "validating", verdict, trace=TRACEPARENT)
    lines = _json_lines(output)
    assert [(line["event"], line["level"]) for line in lines] == [
        ("backend failed open", "warning"),
        ("review", "info"),
    ]
    review = lines[1]
    assert list(review)[:3] == ["timestamp", "level", "event"]
    assert review["timestamp"].endswith("Z")
    assert review["backends"][1] == {
        "name": "b.example.com",
        "round": 0,
        "outcome": "failed_open",
        "code": 503,
        "ms": 2.0,
        "version": "v1",
        "uid": "b-uid",
        "reason": "x",
    }
    assert review["trace_id"] == TRACE_ID


def test_json_output_embeds_bodies_as_json(output: io.TextIOWrapper) -> None:
    """--log-bodies in JSON format: the object is nested JSON, not an escaped string."""
    configure_logging("info", "json", stream=output)
    observe(Observability(metrics=False, log_bodies=True), "validating", answer("validating"))
    (line,) = _json_lines(output)
    assert line["object"] == json.loads(OBJECT)


def test_json_output_renders_unknown_values_as_text(output: io.TextIOWrapper) -> None:
    """Values msgspec cannot encode are written with str() instead of failing the line."""
    configure_logging("info", "json", stream=output)
    structlog.get_logger("t").info("odd value", value=ValueError("nope"), where={1, 2} - {1, 2})
    (line,) = _json_lines(output)
    assert (line["value"], line["where"]) == ("nope", [])


def test_console_output(output: io.TextIOWrapper) -> None:
    """Console format: a human-readable line with the event and key=value fields."""
    configure_logging("info", "console", stream=output)
    observe(
        Observability(metrics=False, log_bodies=True),
        "validating",
        answer("validating", rec("a.example.com")),
    )
    text = _text(output)
    assert text.count("\n") == 1
    assert "review" in text
    assert "decision=allowed" in text
    assert "resource=apps/v1/deployments" in text
    assert '"metadata"' in text  # the object body is shown as JSON text


@pytest.mark.parametrize(
    ("level", "events"),
    [
        pytest.param("debug", ["backend failed open", "review", "lib debug"], id="debug shows everything"),
        pytest.param("info", ["backend failed open", "review"], id="info hides debug lines"),
        pytest.param("warning", ["backend failed open"], id="warning hides the review line but keeps FPT-03"),
        pytest.param("error", [], id="error hides warnings"),
    ],
)
def test_log_level(output: io.TextIOWrapper, level: str, events: list[str]) -> None:
    """--log-level filters structlog and stdlib lines alike."""
    configure_logging(level, "json", stream=output)
    observe(
        Observability(metrics=False),
        "validating",
        answer("validating", rec("a.example.com", "failed_open", 503)),
    )
    logging.getLogger("somelib").debug("lib debug")
    assert [line["event"] for line in _json_lines(output)] == events


def test_stdlib_logging_is_routed_through_the_pipeline(output: io.TextIOWrapper) -> None:
    """hypercorn's stdlib logger writes into the same JSON stream, exceptions included."""
    configure_logging("info", "json", stream=output)
    log = logging.getLogger("hypercorn.error")
    log.warning("client %s went away", "127.0.0.1")
    try:
        raise RuntimeError("kaboom")
    except RuntimeError:
        log.exception("handler crashed")
    first, second = _json_lines(output)
    assert (first["logger"], first["level"], first["event"]) == (
        "hypercorn.error",
        "warning",
        "client 127.0.0.1 went away",
    )
    assert (second["level"], second["event"]) == ("error", "handler crashed")
    assert "RuntimeError: kaboom" in second["exception"]


def test_configure_logging_twice_keeps_one_handler(output: io.TextIOWrapper) -> None:
    """Reconfiguring replaces the stdlib bridge instead of duplicating lines."""
    configure_logging("info", "json", stream=output)
    configure_logging("info", "json", stream=output)
    logging.getLogger("x").warning("once")
    assert [line["event"] for line in _json_lines(output)] == ["once"]


def test_canonical_line_has_no_credentials(output: io.TextIOWrapper) -> None:
    """Nothing about backend client configuration (URLs with credentials, CA bundles) reaches the line."""
    configure_logging("info", "json", stream=output)
    obs = Observability(metrics=False)
    obs.config_reloaded(ok=True, snapshot=SNAPSHOT)
    observe(obs, "validating", answer("validating", rec("a.example.com")))
    text = _text(output)
    assert "x.example.com" not in text
    assert "ca_bundle" not in text


def test_raw_is_valid_json_in_message() -> None:
    """A patch that is not valid JSON is logged as text so the JSON line stays valid."""
    with capture_logs() as logs:
        observe(
            Observability(metrics=False, log_bodies=True),
            "mutating",
            answer("mutating", rec("a.example.com"), patch=b"not json"),
        )
    line = review_lines(logs)[0]
    assert line["patch"] == "not json"
    assert not isinstance(line["patch"], msgspec.Raw)


# --- the bytes written: golden lines -----------------------------------------------------------------

FROZEN = datetime.datetime(2026, 11, 24, 13, 44, 52, 123456, tzinfo=datetime.UTC)


# Stands in for the ``datetime`` module in gateway.observability.logs: ``datetime.now()`` is FROZEN.
FROZEN_CLOCK = types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda tz=None: FROZEN))


def _golden_case(case: str) -> tuple[Observability, dict[str, Any]]:
    """An observer and the ``review_finished`` arguments of one golden case."""
    five = [rec(f"check-{i}.policy.example.com", seconds=0.0012 + i * 0.0003) for i in range(5)]
    if case == "one backend, allowed, trace bound":
        return Observability(Metrics()), {"verdict": answer("validating", rec("a.example.com"))}
    if case == "five backends, traceparent header":
        return Observability(Metrics()), {"verdict": answer("validating", *five), "trace": TRACEPARENT}
    if case == "denied: rejection, fail-closed timeout, fail-open":
        verdict = answer(
            "validating",
            rec("deny.example.com", "rejected", 403, reason=DENY),
            rec("slow.example.com", "failed_closed", 500, reason=FAIL, error_kind="timeout"),
            rec(
                "ign.example.com",
                "failed_open",
                503,
                reason="failed to call webhook: 503",
                error_kind="status",
            ),
            denied_by="deny.example.com",
            deny_reason=DENY,
        )
        return Observability(Metrics()), {"verdict": verdict, "seconds": 1.23456789}
    if case == "no verdict: 400":
        return Observability(Metrics()), {
            "verdict": None, "review": None, "code": 400, "error": "request.uid is required",
        }  # fmt: skip
    if case == "no verdict: 500":
        return Observability(Metrics()), {"verdict": None, "code": 500, "error": "boom"}
    if case == "denied without report":
        verdict = Verdict(allowed=False, status=Status(status="Failure", message="from status", code=500))
        return Observability(Metrics()), {"verdict": verdict}
    if case == "mutating: patch, warnings, reinvocation, modes, dry run, subresource":
        mutated = rec("m.example.com")
        mutated.mutated = True
        warn = rec("w.example.com", "rejected", 403, reason="would deny")
        warn.mode = "Warn"
        verdict = answer(
            "mutating", mutated, warn, patch=b'[{"op":"add","path":"/x","value":1}]', warnings=["w"]
        )
        assert verdict.report is not None
        verdict.report.reinvoked = ["m.example.com"]
        verdict.report.deadline_exhausted = True
        verdict.report.modes = [ModeRecord("w.example.com", "policies", "Warn", 0, 1)]
        review = inbound(
            group="apps", resource="deployments", sub_resource="scale", namespace="", dry_run=True
        )
        return Observability(Metrics()), {"verdict": verdict, "review": review, "seconds": 0.0000004}
    if case == "log bodies":
        verdict = answer("mutating", rec("m.example.com"), patch=b'[{"op":"add","path":"/x","value":1}]')
        return Observability(Metrics(), log_bodies=True), {"verdict": verdict}
    if case == "log bodies, a patch that is not JSON":
        verdict = answer("mutating", rec("m.example.com"), patch=b"not json")
        return Observability(None, log_bodies=True), {"verdict": verdict}
    if case == "match condition errors and dropped entries":
        verdict = answer("validating", rec("a.example.com"))
        assert verdict.report is not None
        verdict.report.conditions = [
            ConditionRecord("a.example.com", False, 1, 0.0001, (("c1", "no such key"),))
        ]
        verdict.report.dropped = ["annotation x"]
        return Observability(Metrics()), {"verdict": verdict}
    raise AssertionError(case)


GOLDEN: dict[str, bytes] = {  # written by the code before the canonical line had a fast path
    "one backend, allowed, trace bound": b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"info","event":"review","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"validating","api_version":"admission.k8s.io/v1","operation":"CREATE","resource":"apps/v1/deployments","namespace":"team-a","name":"web","decision":"allowed","code":200,"backends":[{"name":"a.example.com","round":0,"outcome":"allowed","code":200,"ms":2.0,"version":"v1","uid":"b-uid"}],"total_ms":10.0,"backend_ms":2.0,"overhead_ms":8.0,"trace_id":"11111111111111111111111111111111"}\n',
    "five backends, traceparent header": b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"info","event":"review","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"validating","api_version":"admission.k8s.io/v1","operation":"CREATE","resource":"apps/v1/deployments","namespace":"team-a","name":"web","decision":"allowed","code":200,"backends":[{"name":"check-0.policy.example.com","round":0,"outcome":"allowed","code":200,"ms":1.2,"version":"v1","uid":"b-uid"},{"name":"check-1.policy.example.com","round":0,"outcome":"allowed","code":200,"ms":1.5,"version":"v1","uid":"b-uid"},{"name":"check-2.policy.example.com","round":0,"outcome":"allowed","code":200,"ms":1.8,"version":"v1","uid":"b-uid"},{"name":"check-3.policy.example.com","round":0,"outcome":"allowed","code":200,"ms":2.1,"version":"v1","uid":"b-uid"},{"name":"check-4.policy.example.com","round":0,"outcome":"allowed","code":200,"ms":2.4,"version":"v1","uid":"b-uid"}],"total_ms":10.0,"backend_ms":2.4,"overhead_ms":7.6,"trace_id":"0af7651916cd43dd8448eb211c80319c"}\n',
    "denied: rejection, fail-closed timeout, fail-open": (
        b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"warning","event":"backend failed open","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"validating","webhook":"ign.example.com","round":0,"code":503,"error":"failed to call webhook: 503","error_kind":"status"}\n'
        b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"info","event":"review","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"validating","api_version":"admission.k8s.io/v1","operation":"CREATE","resource":"apps/v1/deployments","namespace":"team-a","name":"web","decision":"denied","code":200,"denied_by":"deny.example.com","reason":"admission webhook \\"deny.example.com\\" denied the request: image registry not allowed","backends":[{"name":"deny.example.com","round":0,"outcome":"rejected","code":403,"ms":2.0,"version":"v1","uid":"b-uid","reason":"admission webhook \\"deny.example.com\\" denied the request: image registry not allowed"},{"name":"slow.example.com","round":0,"outcome":"failed_closed","code":500,"ms":2.0,"version":"v1","uid":"b-uid","reason":"Internal error occurred: failed calling webhook \\"slow.example.com\\": failed to call webhook: Post \\"https://slow.svc:443/check?timeout=1s\\": context deadline exceeded","error_kind":"timeout"},{"name":"ign.example.com","round":0,"outcome":"failed_open","code":503,"ms":2.0,"version":"v1","uid":"b-uid","reason":"failed to call webhook: 503","error_kind":"status"}],"total_ms":1234.568,"backend_ms":2.0,"overhead_ms":1232.568}\n'
    ),
    "no verdict: 400": b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"warning","event":"review","endpoint":"validating","decision":"error","code":400,"error":"request.uid is required","total_ms":10.0}\n',
    "no verdict: 500": b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"error","event":"review","endpoint":"validating","decision":"error","code":500,"error":"boom","total_ms":10.0}\n',
    "denied without report": b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"info","event":"review","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"validating","api_version":"admission.k8s.io/v1","operation":"CREATE","resource":"apps/v1/deployments","namespace":"team-a","name":"web","decision":"denied","code":200,"reason":"from status","total_ms":10.0}\n',
    "mutating: patch, warnings, reinvocation, modes, dry run, subresource": b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"info","event":"review","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"mutating","api_version":"admission.k8s.io/v1","operation":"CREATE","resource":"apps/v1/deployments/scale","name":"web","dry_run":true,"decision":"allowed","code":200,"backends":[{"name":"m.example.com","round":0,"outcome":"allowed","code":200,"ms":2.0,"version":"v1","uid":"b-uid","mutated":true},{"name":"w.example.com","round":0,"outcome":"rejected","code":403,"ms":2.0,"version":"v1","uid":"b-uid","reason":"would deny","mode":"Warn"}],"total_ms":0.0,"backend_ms":4.0,"overhead_ms":0.0,"reinvoked":["m.example.com"],"modes":{"w.example.com":"Warn"},"deadline_exhausted":true,"patched":true,"warnings":1}\n',
    "log bodies": b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"info","event":"review","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"mutating","api_version":"admission.k8s.io/v1","operation":"CREATE","resource":"apps/v1/deployments","namespace":"team-a","name":"web","decision":"allowed","code":200,"backends":[{"name":"m.example.com","round":0,"outcome":"allowed","code":200,"ms":2.0,"version":"v1","uid":"b-uid"}],"total_ms":10.0,"backend_ms":2.0,"overhead_ms":8.0,"patched":true,"object":{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "labels": {"app": "web"}}},"patch":[{"op":"add","path":"/x","value":1}]}\n',
    "log bodies, a patch that is not JSON": b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"info","event":"review","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"mutating","api_version":"admission.k8s.io/v1","operation":"CREATE","resource":"apps/v1/deployments","namespace":"team-a","name":"web","decision":"allowed","code":200,"backends":[{"name":"m.example.com","round":0,"outcome":"allowed","code":200,"ms":2.0,"version":"v1","uid":"b-uid"}],"total_ms":10.0,"backend_ms":2.0,"overhead_ms":8.0,"patched":true,"object":{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "labels": {"app": "web"}}},"patch":"not json"}\n',
    "match condition errors and dropped entries": (
        b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"warning","event":"match condition failed","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"validating","webhook":"a.example.com","condition":"c1","error":"no such key"}\n'
        b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"warning","event":"review entries dropped","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"validating","dropped":["annotation x"]}\n'
        b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"info","event":"review","uid":"705ab4f5-6393-11e8-b7cc-42010a800002","endpoint":"validating","api_version":"admission.k8s.io/v1","operation":"CREATE","resource":"apps/v1/deployments","namespace":"team-a","name":"web","decision":"allowed","code":200,"backends":[{"name":"a.example.com","round":0,"outcome":"allowed","code":200,"ms":2.0,"version":"v1","uid":"b-uid"}],"total_ms":10.0,"backend_ms":2.0,"overhead_ms":8.0}\n'
    ),
}


def _observe_golden(case: str, context: bool) -> bytes:
    """Observe the golden ``case`` (with a worker context variable if ``context``); the bytes due."""
    obs, kw = _golden_case(case)
    trace = ("1" * 32, "01") if case == "one backend, allowed, trace bound" else None
    token = current_trace.set(trace)
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(worker=2)
    try:
        observe(obs, "mutating" if case.startswith(("mutating", "log bodies")) else "validating", **kw)
    finally:
        structlog.contextvars.clear_contextvars()
        current_trace.reset(token)
    expected = GOLDEN[case]
    if context:  # with --workers every line carries the worker's context variable after its fields
        expected = b"\n".join(line[:-1] + b',"worker":2}' for line in expected.splitlines()) + b"\n"
    return expected


@pytest.mark.parametrize("context", [False, True], ids=["", "with a bound structlog context variable"])
@pytest.mark.parametrize("case", list(GOLDEN))
def test_golden_lines(
    output: io.TextIOWrapper, monkeypatch: pytest.MonkeyPatch, case: str, context: bool
) -> None:
    """The JSON lines a review writes, byte for byte (timestamp frozen), as configure_logging set them up.

    With ``--workers`` every line carries the worker's structlog context variable after its fields.
    """
    from gateway.observability import logs

    monkeypatch.setattr(logs, "datetime", FROZEN_CLOCK)
    configure_logging("info", "json", stream=output)
    expected = _observe_golden(case, context)
    assert _text(output).encode() == expected


@pytest.mark.parametrize(
    ("fields", "context"),
    [
        pytest.param({"a": 1, "b": [1, {"c": None}], "d": msgspec.Raw(b'{"x":1}')}, {}, id="plain fields"),
        pytest.param(
            {"a": 1, "value": ValueError("nope")}, {"worker": 3, "a": "ctx"}, id="context variables"
        ),
        pytest.param(
            {"a": 1}, {"level": "ctx", "timestamp": "ctx", "event": "ctx"}, id="context keys the chain sets"
        ),
        pytest.param({"a": 1}, {"exc_info": True, "z": 1}, id="an exc_info context variable"),
        pytest.param({"a": 1, "timestamp": "mine"}, {}, id="a field the chain sets"),
        pytest.param({"exc_info": ValueError("x"), "a": 1}, {}, id="an exc_info field"),
    ],
)
@pytest.mark.parametrize(
    "level", [logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL]
)
def test_event_writer_writes_what_the_chain_writes(
    output: io.TextIOWrapper,
    monkeypatch: pytest.MonkeyPatch,
    fields: dict[str, Any],
    context: dict[str, Any],
    level: int,
) -> None:
    """EventWriter.write(level, event, fields) writes the bytes bound.log(level, event, **fields) writes."""
    from gateway.observability import logs

    monkeypatch.setattr(logs, "datetime", FROZEN_CLOCK)
    configure_logging("debug", "json", stream=output)
    bound = structlog.get_logger("gateway.review").bind()
    writer = logs.EventWriter(bound)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)
    try:
        bound.log(level, "event", **dict(fields))
        expected = _text(output).encode()
        writer.write(level, "event", dict(fields))
    finally:
        structlog.contextvars.clear_contextvars()
    assert _text(output).encode() == expected * 2


def test_event_writer_follows_the_chain_it_was_made_with(output: io.TextIOWrapper) -> None:
    """capture_logs (or any other chain) in force at the time of the call gets the event as bound.log would."""
    from gateway.observability import logs

    configure_logging("info", "json", stream=output)
    bound = structlog.get_logger("gateway.review").bind()
    writer = logs.EventWriter(bound)
    with capture_logs() as captured:
        writer.write(logging.WARNING, "review", {"a": 1})
    assert captured == [{"a": 1, "event": "review", "log_level": "warning"}]
    assert _text(output) == ""
    with_context = logs.EventWriter(bound.bind(k="v"))  # bound context comes first: the chain writes it
    with_context.write(logging.INFO, "review", {"a": 1})
    assert list(_json_lines(output)[0])[3:] == ["k", "a"]
    configure_logging("info", "console", stream=output)
    logs.EventWriter(structlog.get_logger("gateway.review").bind()).write(logging.INFO, "review", {"a": 1})
    assert _text(output).splitlines()[1].endswith("a=1")


@pytest.mark.parametrize("kind", ["validating", "mutating"])
@pytest.mark.parametrize("durations", [(), (0.003,), (0.001, 0.004, 0.002)], ids=["none", "one", "three"])
def test_backend_seconds_of_is_the_reports(kind: str, durations: tuple[float, ...]) -> None:
    """The shortcut for one invocation gives what DispatchReport.backend_seconds gives."""
    from gateway.observability.canonical import backend_seconds_of

    r = answer(kind, *(rec(f"b{i}", seconds=s) for i, s in enumerate(durations))).report
    assert r is not None
    assert backend_seconds_of(r) == r.backend_seconds


# --- background output (configure_logging(background=True): the serving processes) -----------------


@pytest.fixture
def pipe_output(output: io.TextIOWrapper) -> Iterator[tuple[io.TextIOWrapper, int]]:
    """A text stream over the write end of a real pipe, and the read end; the sink is closed after."""
    from gateway.observability import logs

    read_end, write_end = os.pipe()
    stream = io.TextIOWrapper(open(write_end, "wb"), encoding="utf-8", write_through=True)  # noqa: SIM115
    yield stream, read_end
    logs._close_sink()
    stream.close()
    os.close(read_end)


def _read_pipe(read_end: int) -> bytes:
    """What the pipe holds once the sink has written everything it accepted."""
    from gateway.observability import logs

    assert logs.flush_logs(30)
    os.set_blocking(read_end, False)
    data = bytearray()
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(read_end, 1 << 20):
            data += chunk
    return bytes(data)


@pytest.mark.parametrize("context", [False, True], ids=["", "with a bound structlog context variable"])
@pytest.mark.parametrize("case", list(GOLDEN))
def test_background_output_writes_the_golden_bytes(
    pipe_output: tuple[io.TextIOWrapper, int], monkeypatch: pytest.MonkeyPatch, case: str, context: bool
) -> None:
    """Through the sink, to a pipe: the same bytes as written at once (the fast EventWriter path too)."""
    from gateway.observability import logs

    stream, read_end = pipe_output
    monkeypatch.setattr(logs, "datetime", FROZEN_CLOCK)
    configure_logging("info", "json", stream=stream, background=True)
    assert logs.EventWriter(structlog.get_logger("gateway.review").bind())._encode is not None
    expected = _observe_golden(case, context)
    assert _read_pipe(read_end) == expected


def test_background_console_output_is_what_the_stream_gets(
    output: io.TextIOWrapper, pipe_output: tuple[io.TextIOWrapper, int]
) -> None:
    """Console format through the sink: the text the stream itself would have been given."""
    stream, read_end = pipe_output
    configure_logging("info", "console", stream=output)
    structlog.get_logger().info("hello", n=1, names=["a"], text="é")
    direct = _text(output).split(" ", 1)[1]  # without the timestamp
    configure_logging("info", "console", stream=stream, background=True)
    structlog.get_logger().info("hello", n=1, names=["a"], text="é")
    assert _read_pipe(read_end).decode().split(" ", 1)[1] == direct


def _fill(fd: int) -> int:
    """Fill the pipe with whole lines, as a reader that stopped reading leaves it; bytes written."""
    os.set_blocking(fd, False)
    filled = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            filled += os.write(fd, b"f" * 99 + b"\n")
    os.set_blocking(fd, True)
    return filled


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        pytest.param(
            "json",
            b'{"timestamp":"2026-11-24T13:44:52.123456Z","level":"warning","event":"log lines dropped",'
            b'"dropped":DROPPED,"worker":2}',
            id="JSON: a warning line with the count and the worker's context variable",
        ),
        pytest.param(
            "console",
            b"[warning  ] log lines dropped              dropped=DROPPED worker=2",
            id="console: the same, readable",
        ),
    ],
)
def test_dropped_lines_are_announced_by_one_line_and_counted_in_the_metric(
    pipe_output: tuple[io.TextIOWrapper, int], monkeypatch: pytest.MonkeyPatch, fmt: str, expected: bytes
) -> None:
    """Beyond the bound, lines are dropped; the next line written is preceded by how many were."""
    from functools import partial

    from gateway.observability import logs
    from gateway.observability.logsink import LineSink

    stream, read_end = pipe_output
    monkeypatch.setattr(logs, "datetime", FROZEN_CLOCK)
    monkeypatch.setattr(logs, "LineSink", partial(LineSink, limit_bytes=1000))
    filled = _fill(stream.fileno())  # nobody reads
    configure_logging("info", fmt, stream=stream, background=True)  # type: ignore[arg-type]
    metrics = Metrics()
    logs.count_dropped_lines(metrics.log_lines_dropped.labels().inc)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(worker=2)
    try:
        for i in range(100):
            structlog.get_logger().info("line", i=i)
        dropped = int(metrics.log_lines_dropped.labels().value)
        assert dropped > 0
        while filled:  # the reader is back: the lines that filled the pipe, exactly
            filled -= len(os.read(read_end, filled))
        assert logs.flush_logs(30)
        structlog.get_logger().info("line", i="after")
    finally:
        structlog.contextvars.clear_contextvars()
    data = _read_pipe(read_end)
    lines = data.splitlines()
    notices = [line for line in lines if b"log lines dropped" in line]
    assert len(notices) == 1
    assert notices[0].endswith(expected.replace(b"DROPPED", str(dropped).encode()))
    assert lines[-2] == notices[0]
    assert b"after" in lines[-1]
    assert len(lines) - 2 + dropped == 100  # every line is either written or counted
    assert f"webhook_gateway_log_lines_dropped_total {float(dropped)}".encode() in metrics.render()[0]
