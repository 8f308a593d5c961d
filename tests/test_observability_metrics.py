"""Metrics (§11, MET-01..09): reports built by hand, recorded, rendered and parsed back.

Every assertion reads the text exposition through prometheus_client's own parser, so what is
checked is what a Prometheus server would scrape.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.dispatch.report import ConditionRecord, DispatchReport, InvocationOutcome, InvocationRecord
from gateway.observability.metrics import (
    FINE_DURATION_BUCKETS,
    MATCH_CONDITION_BUCKETS,
    STEP_DURATION_BUCKETS,
    WEBHOOK_DURATION_BUCKETS,
    Metrics,
)

P = "webhook_gateway_"
Labels = frozenset[tuple[str, str]]


def rec(
    name: str,
    outcome: InvocationOutcome = "allowed",
    code: int = 200,
    seconds: float = 0.002,
    *,
    error_kind: str = "",
    round_: int = 0,
) -> InvocationRecord:
    return InvocationRecord(
        name=name,
        configuration="policies",
        round=round_,
        index=0,
        outcome=outcome,
        code=code,
        duration_seconds=seconds,
        error_kind=error_kind,
    )


def report(
    kind: str, *records: InvocationRecord, operation: str = "CREATE", **fields: object
) -> DispatchReport:
    r = DispatchReport(kind=kind, operation=operation, invocations=list(records))  # type: ignore[arg-type]
    for key, value in fields.items():
        setattr(r, key, value)
    r.allowed = not any(x.outcome in ("rejected", "failed_closed", "internal_error") for x in records)
    return r


def record_review(
    m: Metrics, endpoint: str, r: DispatchReport | None, *, code: int = 200, seconds: float = 0.01
) -> None:
    m.review_started(endpoint)
    m.review_finished(
        endpoint,
        code=code,
        seconds=seconds,
        operation=r.operation if r is not None else "",
        allowed=r.allowed if r is not None else None,
        report=r,
    )


def scrape(m: Metrics) -> dict[str, dict[Labels, float]]:
    """sample name -> {label set -> value}, as Prometheus would ingest it."""
    body, content_type = m.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    text = body.decode()
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            # The parser reports every counter sample as "<family>_total"; keep the name as written
            # (upstream's "..._count" counters have no suffix, MET-01).
            if family.type == "counter" and f"\n{family.name}{{" in text:
                name = family.name
            out.setdefault(name, {})[frozenset(s.labels.items())] = s.value
    return out


def L(**labels: str) -> Labels:  # reads like a label-set literal
    return frozenset(labels.items())


def series(samples: dict[str, dict[Labels, float]], name: str) -> dict[Labels, float]:
    return samples.get(name, {})


def without_le(samples: Iterable[Labels]) -> set[Labels]:
    return {frozenset((k, v) for k, v in labels if k != "le") for labels in samples}


# --- MET-01 ------------------------------------------------------------------------------------------

UPSTREAM_FAMILIES = [
    ("admission_webhook_admission_duration_seconds", "histogram", {"name", "type", "operation", "rejected"}),
    ("admission_webhook_request_total", "counter", {"name", "type", "operation", "code", "rejected"}),
    (
        "admission_webhook_rejection_count",
        "counter",
        {"name", "type", "operation", "error_type", "rejection_code"},
    ),
    ("admission_webhook_fail_open_count", "counter", {"name", "type"}),
    ("admission_match_condition_evaluation_errors_total", "counter", {"name", "kind", "type", "operation"}),
    ("admission_match_condition_exclusions_total", "counter", {"name", "kind", "type", "operation"}),
    ("admission_match_condition_evaluation_seconds", "histogram", {"name", "kind", "type", "operation"}),
    ("admission_step_admission_duration_seconds", "histogram", {"type", "operation", "rejected"}),
]


def _every_family_once() -> Metrics:
    m = Metrics()
    r = report(
        "validating",
        rec("a.example.com", "rejected", 403),
        rec("b.example.com", "failed_open", 503, error_kind="timeout"),
        conditions=[ConditionRecord(name="c.example.com", excluded=True, evaluation_errors=1, seconds=0.001)],
    )
    record_review(m, "validating", r)
    return m


@pytest.mark.parametrize(
    ("upstream", "kind", "labels"),
    [
        pytest.param(n, k, ls, id=f"MET-01: apiserver_{n} is exported as webhook_gateway_{n}")
        for n, k, ls in UPSTREAM_FAMILIES
    ],
)
def test_upstream_family_names_types_and_labels(upstream: str, kind: str, labels: set[str]) -> None:
    """MET-01: each upstream admission family exists under the new prefix with the same type and labels."""
    m = _every_family_once()
    body = m.render()[0].decode()
    name = P + upstream
    assert f"# TYPE {name} {kind}\n" in body
    sample = name + "_count" if kind == "histogram" else name
    label_sets = series(scrape(m), sample)
    assert label_sets, f"no samples for {sample}"
    assert {frozenset(k for k, _ in ls) for ls in label_sets} == {frozenset(labels)}


@pytest.mark.parametrize(
    ("family", "buckets"),
    [
        pytest.param(
            "admission_webhook_admission_duration_seconds",
            WEBHOOK_DURATION_BUCKETS,
            id="MET-01: webhook latency buckets are 0.005 … 25 as upstream",
        ),
        pytest.param(
            "admission_step_admission_duration_seconds",
            STEP_DURATION_BUCKETS,
            id="MET-01: step latency buckets are 0.005 … 2.5 as upstream",
        ),
        pytest.param(
            "admission_match_condition_evaluation_seconds",
            MATCH_CONDITION_BUCKETS,
            id="MET-01: match-condition buckets are 0.001 … 0.25 as upstream",
        ),
        pytest.param(
            "backend_call_duration_seconds",
            FINE_DURATION_BUCKETS,
            id="MET-09 [GW]: backend call buckets start at 0.5 ms",
        ),
    ],
)
def test_histogram_buckets(family: str, buckets: tuple[float, ...]) -> None:
    """MET-01: histogram bucket bounds are exactly the specified ones (written as Go writes them)."""
    samples = series(scrape(_every_family_once()), P + family + "_bucket")
    les = {dict(labels)["le"] for labels in samples}
    assert les == {format(b, "g") for b in buckets} | {"+Inf"}


def test_upstream_bucket_values_are_the_spec_table() -> None:
    """MET-01: the bucket constants are the spec table's numbers."""
    assert WEBHOOK_DURATION_BUCKETS == (0.005, 0.025, 0.1, 0.5, 1, 2.5, 10, 25)
    assert STEP_DURATION_BUCKETS == (0.005, 0.025, 0.1, 0.5, 1, 2.5)
    assert MATCH_CONDITION_BUCKETS == (0.001, 0.005, 0.01, 0.025, 0.1, 0.2, 0.25)
    assert FINE_DURATION_BUCKETS[0] == 0.0005


def test_exposition_is_plain_text_format_without_created_series() -> None:
    """MET-01: upstream's exposition has no OpenMetrics ``_created`` series and no ``_count_total``."""
    body = _every_family_once().render()[0].decode()
    assert "_created" not in body
    assert "_count_total" not in body
    assert f"{P}admission_webhook_rejection_count{{" in body
    assert f"{P}admission_webhook_fail_open_count{{" in body


# --- MET-02 / MET-03 / MET-06 ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "record", "expected"),
    [
        pytest.param(
            "validating",
            rec("a.example.com"),
            {"type": "validating", "code": "200", "rejected": "false"},
            id="MET-03/06: an allowed validating invocation is code 200, rejected false, type validating",
        ),
        pytest.param(
            "mutating",
            rec("a.example.com"),
            {"type": "admit", "code": "200", "rejected": "false"},
            id="MET-06: mutating invocations have type admit",
        ),
        pytest.param(
            "validating",
            rec("a.example.com", "rejected", 403),
            {"type": "validating", "code": "403", "rejected": "true"},
            id="MET-03/06: a rejection carries its code and rejected true",
        ),
        pytest.param(
            "validating",
            rec("a.example.com", "rejected", 999),
            {"type": "validating", "code": "600", "rejected": "true"},
            id="MET-03: a code above 600 is recorded as 600",
        ),
        pytest.param(
            "validating",
            rec("a.example.com", "failed_open", 503, error_kind="timeout"),
            {"type": "validating", "code": "503", "rejected": "false"},
            id="MET-03/06: a timeout under Ignore is code 503, rejected false",
        ),
        pytest.param(
            "mutating",
            rec("a.example.com", "failed_closed", 503, error_kind="timeout"),
            {"type": "admit", "code": "503", "rejected": "true"},
            id="MET-03/06: a timeout under Fail is code 503, rejected true",
        ),
        pytest.param(
            "validating",
            rec("a.example.com", "failed_closed", 503, error_kind="bad_response"),
            {"type": "validating", "code": "503", "rejected": "true"},
            id="MET-03: a bad response under Fail is code 503",
        ),
        pytest.param(
            "validating",
            rec("a.example.com", "failed_closed", 404, error_kind="status"),
            {"type": "validating", "code": "404", "rejected": "true"},
            id="MET-03: a non-2xx reply carries its HTTP status",
        ),
        pytest.param(
            "mutating",
            rec("a.example.com", "internal_error", 0),
            {"type": "admit", "code": "0", "rejected": "true"},
            id="MET-03/06: an internal error (patch failure, dry-run refusal) is code 0, rejected true",
        ),
    ],
)
def test_invocation_latency_and_request_total(
    endpoint: str, record: InvocationRecord, expected: dict[str, str]
) -> None:
    """MET-02/03/06: one latency observation and one request_total increment per invocation."""
    m = Metrics()
    record_review(m, endpoint, report(endpoint, record, operation="UPDATE"))
    s = scrape(m)
    labels = {"name": "a.example.com", "operation": "UPDATE", **expected}
    assert series(s, P + "admission_webhook_request_total") == {L(**labels): 1.0}
    duration_labels = {k: v for k, v in labels.items() if k != "code"}
    assert series(s, P + "admission_webhook_admission_duration_seconds_count") == {L(**duration_labels): 1.0}
    assert series(s, P + "admission_webhook_admission_duration_seconds_sum") == {L(**duration_labels): 0.002}


def test_cancelled_invocations_are_not_counted() -> None:
    """FPT-03/MET-02..05: a call abandoned because the caller went away leaves no per-backend series."""
    m = Metrics()
    record_review(
        m, "validating", report("validating", rec("a.example.com", "cancelled", 503, error_kind="timeout"))
    )
    s = scrape(m)
    for family in (
        "admission_webhook_request_total",
        "admission_webhook_admission_duration_seconds_count",
        "admission_webhook_fail_open_count",
        "admission_webhook_rejection_count",
        "backend_call_duration_seconds_count",
        "backend_call_errors_total",
    ):
        assert series(s, P + family) == {}, family


def test_latency_is_observed_into_the_right_bucket() -> None:
    """MET-02: a 30 ms call lands in le=0.1 and above, not in le=0.025 (buckets are "less or equal")."""
    m = Metrics()
    record_review(
        m,
        "validating",
        report("validating", rec("a.example.com", seconds=0.03), rec("b.example.com", seconds=0.025)),
    )
    buckets = series(scrape(m), P + "admission_webhook_admission_duration_seconds_bucket")
    base = {"type": "validating", "operation": "CREATE", "rejected": "false"}
    assert buckets[L(name="a.example.com", le="0.025", **base)] == 0
    assert buckets[L(name="a.example.com", le="0.1", **base)] == 1
    assert buckets[L(name="b.example.com", le="0.025", **base)] == 1
    assert buckets[L(name="a.example.com", le="+Inf", **base)] == 1


# --- MET-04 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        pytest.param(
            rec("a.example.com", "failed_open", 503, error_kind="connect"),
            1.0,
            id="MET-04: a call error ignored under Ignore counts one fail-open",
        ),
        pytest.param(
            rec("a.example.com", "failed_closed", 503, error_kind="connect"),
            None,
            id="MET-04: a call error under Fail is not a fail-open",
        ),
        pytest.param(
            rec("a.example.com", "cancelled", 503),
            None,
            id="MET-04/FPT-03: a cancelled call under Ignore is not counted",
        ),
        pytest.param(rec("a.example.com"), None, id="MET-04: a successful call is not a fail-open"),
        pytest.param(
            rec("a.example.com", "rejected", 403), None, id="MET-04: a rejection is not a fail-open"
        ),
    ],
)
def test_fail_open_count(record: InvocationRecord, expected: float | None) -> None:
    """MET-04: fail_open_count{name,type} counts ignored call errors only."""
    m = Metrics()
    record_review(m, "mutating", report("mutating", record))
    got = series(scrape(m), P + "admission_webhook_fail_open_count")
    assert got == ({L(name="a.example.com", type="admit"): expected} if expected is not None else {})


# --- MET-05 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        pytest.param(
            rec("a.example.com", "rejected", 403),
            ("no_error", "403"),
            id="MET-05: a rejection counts error_type no_error with its code",
        ),
        pytest.param(
            rec("a.example.com", "rejected", 1000),
            ("no_error", "600"),
            id="MET-05: a rejection code above 600 is recorded as 600",
        ),
        pytest.param(
            rec("a.example.com", "failed_closed", 503, error_kind="timeout"),
            ("calling_webhook_error", "503"),
            id="MET-05: a fail-closed timeout counts calling_webhook_error 503",
        ),
        pytest.param(
            rec("a.example.com", "failed_closed", 400, error_kind="version"),
            ("calling_webhook_error", "400"),
            id="MET-05: a fail-closed REV-05 version error counts calling_webhook_error 400",
        ),
        pytest.param(
            rec("a.example.com", "internal_error", 0),
            ("apiserver_internal_error", "0"),
            id="MET-05: an internal error counts apiserver_internal_error 0",
        ),
        pytest.param(
            rec("a.example.com", "failed_open", 503), None, id="MET-05: an ignored call error is no rejection"
        ),
        pytest.param(
            rec("a.example.com", "cancelled", 503), None, id="MET-05: a cancelled call is no rejection"
        ),
        pytest.param(rec("a.example.com"), None, id="MET-05: an allowed call is no rejection"),
    ],
)
def test_rejection_count(record: InvocationRecord, expected: tuple[str, str] | None) -> None:
    """MET-05: rejection_count{name,type,operation,error_type,rejection_code} per failing invocation."""
    m = Metrics()
    record_review(m, "validating", report("validating", record, operation="DELETE"))
    got = series(scrape(m), P + "admission_webhook_rejection_count")
    if expected is None:
        assert got == {}
    else:
        error_type, code = expected
        assert got == {
            L(
                name="a.example.com",
                type="validating",
                operation="DELETE",
                error_type=error_type,
                rejection_code=code,
            ): 1.0
        }


def test_every_rejecting_backend_of_a_fan_out_is_counted() -> None:
    """MET-05: in a validating fan-out each rejecting backend counts, not only the first."""
    m = Metrics()
    record_review(
        m,
        "validating",
        report("validating", rec("a.example.com", "rejected", 403), rec("b.example.com", "rejected", 422)),
    )
    got = series(scrape(m), P + "admission_webhook_rejection_count")
    assert {dict(k)["name"]: dict(k)["rejection_code"] for k in got} == {
        "a.example.com": "403",
        "b.example.com": "422",
    }


# --- MET-07 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "condition", "exclusions", "errors"),
    [
        pytest.param(
            "validating",
            ConditionRecord("c.example.com", True, 0, 0.001),
            {"type": "validate"},
            None,
            id="MET-07: a validating exclusion uses type validate",
        ),
        pytest.param(
            "mutating",
            ConditionRecord("c.example.com", True, 0, 0.001),
            {"type": "admit"},
            None,
            id="MET-07: a mutating exclusion uses type admit",
        ),
        pytest.param(
            "validating",
            ConditionRecord("c.example.com", False, 2, 0.001),
            None,
            ({"type": "validating"}, 2.0),
            id="MET-07 [UP-quirk]: validating evaluation errors use type validating and count per expression",
        ),
        pytest.param(
            "mutating",
            ConditionRecord("c.example.com", True, 1, 0.001),
            {"type": "admit"},
            ({"type": "admit"}, 1.0),
            id="MET-07/MAT-30: an error skipped under Ignore counts an exclusion and an evaluation error",
        ),
        pytest.param(
            "validating",
            ConditionRecord("c.example.com", False, 0, 0.001),
            None,
            None,
            id="MET-07: a plain match counts neither",
        ),
    ],
)
def test_match_condition_metrics(
    endpoint: str,
    condition: ConditionRecord,
    exclusions: dict[str, str] | None,
    errors: tuple[dict[str, str], float] | None,
) -> None:
    """MET-07: exclusions, evaluation errors and evaluation seconds: kind=webhook, type quirks."""
    m = Metrics()
    record_review(m, endpoint, report(endpoint, conditions=[condition]))
    s = scrape(m)
    base = {"name": "c.example.com", "kind": "webhook", "operation": "CREATE"}
    got_exclusions = series(s, P + "admission_match_condition_exclusions_total")
    assert got_exclusions == ({L(**base, **exclusions): 1.0} if exclusions else {})
    got_errors = series(s, P + "admission_match_condition_evaluation_errors_total")
    assert got_errors == ({L(**base, **errors[0]): errors[1]} if errors else {})
    evaluation_type = "validating" if endpoint == "validating" else "admit"
    seconds = series(s, P + "admission_match_condition_evaluation_seconds_count")
    assert seconds == {L(**base, type=evaluation_type): 1.0}  # [GW] every evaluation is observed


# --- MET-08 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "r", "code", "expected"),
    [
        pytest.param(
            "validating",
            report("validating", rec("a.example.com")),
            200,
            {"type": "validate", "operation": "CREATE", "rejected": "false"},
            id="MET-08: an allowed validating review is type validate, rejected false",
        ),
        pytest.param(
            "mutating",
            report("mutating", rec("a.example.com", "rejected", 403), operation="UPDATE"),
            200,
            {"type": "admit", "operation": "UPDATE", "rejected": "true"},
            id="MET-08: a denied mutating review is type admit, rejected true",
        ),
        pytest.param(
            "validating",
            report("validating", operation="CONNECT"),
            200,
            {"type": "validate", "operation": "CONNECT", "rejected": "false"},
            id="MET-08: a review no backend matched is still observed once",
        ),
        pytest.param("validating", None, 400, None, id="MET-08: a malformed request (400) is no review step"),
    ],
)
def test_step_metric_once_per_review(
    endpoint: str, r: DispatchReport | None, code: int, expected: dict[str, str] | None
) -> None:
    """MET-08: the step histogram is observed exactly once per answered inbound review."""
    m = Metrics()
    record_review(m, endpoint, r, code=code, seconds=0.02)
    got = series(scrape(m), P + "admission_step_admission_duration_seconds_count")
    assert got == ({L(**expected): 1.0} if expected else {})


def test_step_metric_for_a_deny_without_backends() -> None:
    """MET-08: a deny decided before any call (not ready, namespace not found) is observed as rejected."""
    m = Metrics()
    r = report("validating", operation="CREATE")
    r.allowed, r.denied_by = False, "not-ready"
    record_review(m, "validating", r)
    got = series(scrape(m), P + "admission_step_admission_duration_seconds_count")
    assert got == {L(type="validate", operation="CREATE", rejected="true"): 1.0}


# --- MET-09 ------------------------------------------------------------------------------------------


def test_inbound_requests_by_endpoint_and_code() -> None:
    """MET-09: inbound_requests_total{endpoint,code} counts every request, answered or not."""
    m = Metrics()
    record_review(m, "validating", report("validating", rec("a.example.com")))
    record_review(m, "validating", report("validating", rec("a.example.com")))
    record_review(m, "mutating", None, code=400)
    record_review(m, "mutating", None, code=413)
    record_review(m, "validating", None, code=499)
    assert series(scrape(m), P + "inbound_requests_total") == {
        L(endpoint="validating", code="200"): 2.0,
        L(endpoint="mutating", code="400"): 1.0,
        L(endpoint="mutating", code="413"): 1.0,
        L(endpoint="validating", code="499"): 1.0,
    }


@pytest.mark.parametrize(
    ("attempts", "reloads", "generation", "last_ok", "backends"),
    [
        pytest.param(
            [(True, 1, {"validating": 3, "mutating": 1})],
            {"success": 1.0, "failure": 0.0},
            1,
            1,
            (3, 1),
            id="MET-09: a successful load counts success and sets generation and backend gauges",
        ),
        pytest.param(
            [(True, 1, {"validating": 3, "mutating": 1}), (False, 1, {"validating": 3, "mutating": 1})],
            {"success": 1.0, "failure": 1.0},
            1,
            0,
            (3, 1),
            id="MET-09/CFG-25: a refused reload counts failure and keeps the generation in force",
        ),
        pytest.param(
            [(True, 1, {"validating": 3, "mutating": 1}), (True, 2, {"validating": 0, "mutating": 2})],
            {"success": 2.0, "failure": 0.0},
            2,
            1,
            (0, 2),
            id="MET-09: a second successful load moves generation and gauges",
        ),
    ],
)
def test_config_reloads(
    attempts: list[tuple[bool, int, dict[str, int]]],
    reloads: dict[str, float],
    generation: int,
    last_ok: int,
    backends: tuple[int, int],
) -> None:
    """MET-09: config_reloads_total{result}, backends{kind}, config_generation, last reload success."""
    m = Metrics()
    for ok, gen, counts in attempts:
        m.config_reloaded(ok, gen, counts)
    s = scrape(m)
    assert series(s, P + "config_reloads_total") == {L(result=k): v for k, v in reloads.items()}
    assert series(s, P + "config_generation") == {L(): float(generation)}
    assert series(s, P + "config_last_reload_successful") == {L(): float(last_ok)}
    assert series(s, P + "backends") == {L(kind="validating"): backends[0], L(kind="mutating"): backends[1]}


@pytest.mark.parametrize(
    ("endpoint", "exhausted", "expected"),
    [
        pytest.param(
            "validating",
            True,
            {L(type="validate"): 1.0},
            id="MET-09: FPT-08 in a validating review counts type validate",
        ),
        pytest.param(
            "mutating",
            True,
            {L(type="admit"): 1.0},
            id="MET-09: FPT-08 in a mutating review counts type admit",
        ),
        pytest.param("mutating", False, {}, id="MET-09: a review within its deadline counts nothing"),
    ],
)
def test_deadline_exhausted(endpoint: str, exhausted: bool, expected: dict[Labels, float]) -> None:
    """MET-09: deadline_exhausted_total{type} counts reviews whose budget ran out."""
    m = Metrics()
    record_review(
        m,
        endpoint,
        report(
            endpoint,
            rec("a.example.com", "failed_open", 503, error_kind="timeout"),
            deadline_exhausted=exhausted,
        ),
    )
    assert series(scrape(m), P + "deadline_exhausted_total") == expected


def test_reinvocations_by_name() -> None:
    """MET-09: reinvocations_total{name} counts every backend scheduled for the second round."""
    m = Metrics()
    r = report(
        "mutating",
        rec("a.example.com"),
        rec("b.example.com"),
        rec("a.example.com", round_=1),
        reinvoked=["a.example.com"],
    )
    record_review(m, "mutating", r)
    record_review(m, "mutating", r)
    s = scrape(m)
    assert series(s, P + "reinvocations_total") == {L(name="a.example.com"): 2.0}
    # MET-02: the reinvocation is a second invocation of the same backend.
    assert (
        series(s, P + "admission_webhook_request_total")[
            L(name="a.example.com", type="admit", operation="CREATE", code="200", rejected="false")
        ]
        == 4.0
    )


# --- [GW] finer views --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        pytest.param(
            rec("a.example.com", "failed_open", 503, error_kind="connect"),
            {"reason": "connect"},
            id="MET-09 [GW]: a refused connection counts reason connect, ignored or not",
        ),
        pytest.param(
            rec("a.example.com", "failed_closed", 503, error_kind="tls"),
            {"reason": "tls"},
            id="MET-09 [GW]: a TLS failure counts reason tls",
        ),
        pytest.param(
            rec("a.example.com", "failed_closed", 503, error_kind="timeout"),
            {"reason": "timeout"},
            id="MET-09 [GW]: a timeout counts reason timeout",
        ),
        pytest.param(
            rec("a.example.com", "failed_open", 503, error_kind="verification"),
            {"reason": "verification"},
            id="MET-09 [GW]: a verification failure counts reason verification",
        ),
        pytest.param(
            rec("a.example.com", "failed_closed", 500),
            {"reason": "internal"},
            id="MET-09 [GW]: a bug while handling a reply counts reason internal",
        ),
        pytest.param(
            rec("a.example.com", "failed_closed", 503, error_kind="Weird Kind!"),
            {"reason": "other"},
            id="MET-09 [GW]: an unexpected error kind is bounded to reason other",
        ),
        pytest.param(
            rec("a.example.com", "rejected", 403), None, id="MET-09 [GW]: a rejection is no call error"
        ),
        pytest.param(
            rec("a.example.com", "internal_error", 0),
            None,
            id="MET-09 [GW]: a patch failure is no call error",
        ),
    ],
)
def test_call_errors_by_reason(record: InvocationRecord, expected: dict[str, str] | None) -> None:
    """[GW] backend_call_errors_total{name,type,reason}: call errors by InvocationRecord.error_kind."""
    m = Metrics()
    record_review(m, "validating", report("validating", record))
    got = series(scrape(m), P + "backend_call_errors_total")
    assert got == ({L(name="a.example.com", type="validating", **expected): 1.0} if expected else {})


def test_fine_call_latency_below_five_milliseconds() -> None:
    """[GW] backend_call_duration_seconds tells 0.4 ms from 3 ms calls (upstream starts at 5 ms)."""
    m = Metrics()
    record_review(
        m,
        "validating",
        report("validating", rec("a.example.com", seconds=0.0004), rec("b.example.com", seconds=0.003)),
    )
    buckets = series(scrape(m), P + "backend_call_duration_seconds_bucket")
    assert buckets[L(name="a.example.com", type="validating", le="0.0005")] == 1
    assert buckets[L(name="b.example.com", type="validating", le="0.0025")] == 0
    assert buckets[L(name="b.example.com", type="validating", le="0.005")] == 1


@pytest.mark.parametrize(
    ("r", "code", "decision"),
    [
        pytest.param(
            report("validating", rec("a.example.com")),
            200,
            "allowed",
            id="[GW]: an allowed review has decision allowed",
        ),
        pytest.param(
            report("validating", rec("a.example.com", "rejected", 403)),
            200,
            "denied",
            id="[GW]: a denied review has decision denied",
        ),
        pytest.param(None, 400, "error", id="[GW]: a request without a verdict has decision error"),
    ],
)
def test_review_duration_by_decision(r: DispatchReport | None, code: int, decision: str) -> None:
    """[GW] review_duration_seconds{endpoint,decision} observes every request's end-to-end time."""
    m = Metrics()
    record_review(m, "validating", r, code=code, seconds=0.004)
    s = scrape(m)
    assert series(s, P + "review_duration_seconds_count") == {
        L(endpoint="validating", decision=decision): 1.0
    }
    assert series(s, P + "review_duration_seconds_sum") == {
        L(endpoint="validating", decision=decision): 0.004
    }


@pytest.mark.parametrize(
    ("endpoint", "durations", "overhead"),
    [
        pytest.param(
            "validating",
            (0.003, 0.005, 0.001),
            0.005,
            id="[GW]: validating overhead is total minus the slowest call",
        ),
        pytest.param(
            "mutating",
            (0.003, 0.005, 0.001),
            0.001,
            id="[GW]: mutating overhead is total minus the sum of calls",
        ),
    ],
)
def test_review_overhead(endpoint: str, durations: tuple[float, ...], overhead: float) -> None:
    """[GW] review_overhead_seconds = end-to-end time minus DispatchReport.backend_seconds."""
    m = Metrics()
    r = report(endpoint, *(rec(f"h{i}.example.com", seconds=d) for i, d in enumerate(durations)))
    record_review(m, endpoint, r, seconds=0.010)
    got = series(scrape(m), P + "review_overhead_seconds_sum")
    assert list(got) == [L(endpoint=endpoint)]
    assert got[L(endpoint=endpoint)] == pytest.approx(overhead)


def test_reviews_in_flight() -> None:
    """[GW] reviews_in_flight{endpoint} rises on arrival and falls when the review ends."""
    m = Metrics()
    m.review_started("validating")
    m.review_started("validating")
    m.review_started("mutating")
    m.review_finished("validating", code=200, seconds=0.001, operation="CREATE", allowed=True, report=None)
    assert series(scrape(m), P + "reviews_in_flight") == {
        L(endpoint="validating"): 1.0,
        L(endpoint="mutating"): 1.0,
    }


class _Origin:
    def __init__(self, text: str, tls: str) -> None:
        self.text, self.tls = text, tls

    def __str__(self) -> str:
        return self.text


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param(None, {}, id="[GW]: without a pool there are no connection series"),
        pytest.param(
            lambda: {"https://a.svc:443": 2, "http://127.0.0.1:8080": 1},
            {L(origin="https://a.svc:443"): 2.0, L(origin="http://127.0.0.1:8080"): 1.0},
            id="[GW]: open connections are exported per origin",
        ),
        pytest.param(
            lambda: {_Origin("https://a.svc:443", "x"): 2, _Origin("https://a.svc:443", "y"): 3},
            {L(origin="https://a.svc:443"): 5.0},
            id="[GW]: origins differing only in TLS settings are summed under one label",
        ),
        pytest.param(lambda: 1 / 0, {}, id="[GW]: a failing pool probe does not break the scrape"),
    ],
)
def test_open_connections_per_origin(source: object, expected: dict[Labels, float]) -> None:
    """[GW] backend_open_connections{origin} is read from the pool at scrape time."""
    m = Metrics()
    m.set_connection_source(source)  # type: ignore[arg-type]
    assert series(scrape(m), P + "backend_open_connections") == expected


@pytest.mark.parametrize(
    ("operation", "label"),
    [
        pytest.param("CREATE", "CREATE", id="[GW]: a known operation is its own label value"),
        pytest.param("HACK-${jndi}", "UNKNOWN", id="[GW]: an unknown operation cannot add series"),
    ],
)
def test_operation_label_is_a_closed_set(operation: str, label: str) -> None:
    """Label cardinality: request content never becomes a label value."""
    m = Metrics()
    record_review(m, "validating", report("validating", rec("a.example.com"), operation=operation))
    got = series(scrape(m), P + "admission_webhook_request_total")
    assert [dict(k)["operation"] for k in got] == [label]


# --- a scripted set of reviews -----------------------------------------------------------------------


def test_scripted_reviews_exact_counters() -> None:
    """MET-02..05/08/09: allow, deny, timeouts under Ignore and Fail, bad response: exact totals."""
    m = Metrics()
    allow = report(
        "validating",
        rec("allow.example.com"),
        rec("ignore.example.com", "failed_open", 503, error_kind="timeout"),
    )
    deny = report("validating", rec("allow.example.com"), rec("deny.example.com", "rejected", 403))
    fail = report("mutating", rec("fail.example.com", "failed_closed", 503, error_kind="timeout"))
    bad = report("mutating", rec("bad.example.com", "failed_closed", 503, error_kind="bad_response"))
    for r in (allow, deny, allow, fail, bad):
        record_review(m, r.kind, r)
    s = scrape(m)
    v, a = {"type": "validating", "operation": "CREATE"}, {"type": "admit", "operation": "CREATE"}
    assert series(s, P + "admission_webhook_request_total") == {
        L(name="allow.example.com", code="200", rejected="false", **v): 3.0,
        L(name="ignore.example.com", code="503", rejected="false", **v): 2.0,
        L(name="deny.example.com", code="403", rejected="true", **v): 1.0,
        L(name="fail.example.com", code="503", rejected="true", **a): 1.0,
        L(name="bad.example.com", code="503", rejected="true", **a): 1.0,
    }
    assert series(s, P + "admission_webhook_fail_open_count") == {
        L(name="ignore.example.com", type="validating"): 2.0
    }
    assert series(s, P + "admission_webhook_rejection_count") == {
        L(name="deny.example.com", error_type="no_error", rejection_code="403", **v): 1.0,
        L(name="fail.example.com", error_type="calling_webhook_error", rejection_code="503", **a): 1.0,
        L(name="bad.example.com", error_type="calling_webhook_error", rejection_code="503", **a): 1.0,
    }
    assert series(s, P + "admission_step_admission_duration_seconds_count") == {
        L(type="validate", operation="CREATE", rejected="false"): 2.0,
        L(type="validate", operation="CREATE", rejected="true"): 1.0,
        L(type="admit", operation="CREATE", rejected="true"): 2.0,
    }
    assert series(s, P + "backend_call_errors_total") == {
        L(name="ignore.example.com", type="validating", reason="timeout"): 2.0,
        L(name="fail.example.com", type="admit", reason="timeout"): 1.0,
        L(name="bad.example.com", type="admit", reason="bad_response"): 1.0,
    }
    assert series(s, P + "inbound_requests_total") == {
        L(endpoint="validating", code="200"): 3.0,
        L(endpoint="mutating", code="200"): 2.0,
    }
    assert without_le(series(s, P + "review_duration_seconds_bucket")) == {
        L(endpoint="validating", decision="allowed"),
        L(endpoint="validating", decision="denied"),
        L(endpoint="mutating", decision="denied"),
    }


# --- the hot path's caches change nothing --------------------------------------------------------------


def _reference_review_finished(
    m: Metrics,
    endpoint: str,
    *,
    code: int,
    seconds: float,
    operation: str = "",
    allowed: bool | None = None,
    report: DispatchReport | None = None,
) -> None:
    """MET-02..09 for one review, straight from the spec through ``Family.labels``: no caches at all."""
    webhook_type = {"validating": "validating", "mutating": "admit"}.get(endpoint, endpoint)
    step_type = {"validating": "validate", "mutating": "admit"}.get(endpoint, endpoint)
    m.reviews_in_flight.labels(endpoint).value -= 1
    decision = "error" if allowed is None else ("allowed" if allowed else "denied")
    m.inbound_requests.labels(endpoint, str(code)).value += 1
    m.review_duration.labels(endpoint, decision).observe(seconds)
    if allowed is None:
        return
    op = report.operation if report is not None else operation
    op = op if op in ("CREATE", "UPDATE", "DELETE", "CONNECT") else "UNKNOWN"
    m.step_duration.labels(step_type, op, "false" if allowed else "true").observe(seconds)
    if report is None:
        return
    m.review_overhead.labels(endpoint).observe(max(0.0, seconds - report.backend_seconds))
    for r in report.invocations:
        if r.outcome == "cancelled":
            continue
        capped = min(r.code, 600)
        rejected = "true" if r.rejected else "false"
        m.webhook_duration.labels(r.name, webhook_type, op, rejected).observe(r.duration_seconds)
        m.webhook_requests.labels(r.name, webhook_type, op, str(capped), rejected).value += 1
        m.call_duration.labels(r.name, webhook_type).observe(r.duration_seconds)
        if r.outcome == "allowed":
            continue
        reason = "internal" if not r.error_kind else r.error_kind
        if reason != "internal" and not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", reason):
            reason = "other"
        if r.outcome == "failed_open":
            m.webhook_fail_open.labels(r.name, webhook_type).value += 1
            m.call_errors.labels(r.name, webhook_type, reason).value += 1
            continue
        if r.outcome == "failed_closed":
            m.call_errors.labels(r.name, webhook_type, reason).value += 1
        rejection_code = "0" if r.outcome == "internal_error" else str(capped)
        m.webhook_rejections.labels(r.name, webhook_type, op, r.error_type, rejection_code).value += 1
    for c in report.conditions:
        if c.excluded:
            m.condition_exclusions.labels(c.name, "webhook", step_type, op).value += 1
        if c.evaluation_errors:
            m.condition_errors.labels(c.name, "webhook", webhook_type, op).value += c.evaluation_errors
        m.condition_seconds.labels(c.name, "webhook", webhook_type, op).observe(c.seconds)
    if report.deadline_exhausted:
        m.deadline_exhausted.labels(step_type).value += 1
    for name in report.reinvoked:
        m.reinvocations.labels(name).value += 1


def _scripted_reviews() -> list[tuple[str, dict[str, object]]]:
    """Reviews of every shape: endpoints, codes, decisions, outcomes, bucket edges, conditions."""
    reviews: list[tuple[str, dict[str, object]]] = [  # first of all: no report, then no verdict
        ("mutating", {"code": 200, "seconds": 0.002, "operation": "UPDATE", "allowed": True}),
        ("validating", {"code": 499, "seconds": 0.002}),
    ]
    outcomes: list[tuple[InvocationOutcome, int, str]] = [
        ("allowed", 200, ""), ("rejected", 403, ""), ("failed_closed", 503, "timeout"),
        ("failed_open", 502, "connect"), ("failed_open", 0, "shed"), ("failed_open", 700, "Bad Kind"),
        ("internal_error", 0, ""), ("cancelled", 0, ""), ("failed_closed", 900, ""),
    ]  # fmt: skip
    edges = [0.0, 0.0005, 0.0004999, 0.005, 0.0050001, 0.1, 25.0, 99.0]
    for i in range(60):
        endpoint = ("validating", "mutating")[i % 2]
        outcome, code, kind = outcomes[i % len(outcomes)]
        records = [
            rec(f"b{j}.example.com", outcome if j == 0 else "allowed", code if j == 0 else 200,
                edges[(i + j) % len(edges)], error_kind=kind)
            for j in range(1 + i % 3)
        ]  # fmt: skip
        extra: dict[str, object] = {}
        if i % 7 == 0:
            extra["conditions"] = [
                ConditionRecord("b0.example.com", i % 2 == 0, i % 3, edges[i % len(edges)])
            ]
        if i % 11 == 0:
            extra["deadline_exhausted"] = True
        if i % 5 == 0 and endpoint == "mutating":
            extra["reinvoked"] = ["b0.example.com"]
        operation = ("CREATE", "UPDATE", "DELETE", "CONNECT", "PATCH")[i % 5]
        r = report(endpoint, *records, operation=operation, **extra)
        seconds = edges[(i * 3) % len(edges)] + 0.001 * (i % 4)
        reviews.append((endpoint, {"code": 200, "seconds": seconds, "allowed": r.allowed, "report": r}))
        if i % 4 == 0:  # a verdict without report, and requests without verdict
            reviews.append(
                (endpoint, {"code": 200, "seconds": seconds, "operation": operation, "allowed": i % 8 == 0})
            )
            reviews.append((endpoint, {"code": (400, 413, 499, 500)[i // 4 % 4], "seconds": seconds}))
    return reviews


def test_cached_hot_path_records_what_the_spec_formulation_records() -> None:
    """Metrics.review_finished (with its per-label-set caches) renders the exposition, byte for byte and
    series in the same order, that the plain ``Family.labels`` formulation of MET-02..09 renders."""
    fast, reference = Metrics(), Metrics()
    for endpoint, kw in _scripted_reviews():
        fast.review_started(endpoint)
        fast.review_finished(endpoint, **kw)  # type: ignore[arg-type]
        reference.reviews_in_flight.labels(endpoint).value += 1
        _reference_review_finished(reference, endpoint, **kw)  # type: ignore[arg-type]

    def gateway_lines(m: Metrics) -> list[bytes]:
        return [line for line in m.render()[0].splitlines() if b"webhook_gateway_" in line]

    assert gateway_lines(fast) == gateway_lines(reference)
    assert len(gateway_lines(fast)) > 1000
