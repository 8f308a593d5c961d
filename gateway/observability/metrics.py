"""Prometheus metrics: the per-backend detail the caller's own admission metrics cannot show (§11).

Consumes what dispatch recorded (``DispatchReport``) after each review; nothing below this layer
imports it. ``Metrics`` owns its own ``CollectorRegistry`` (no module-global state) and is built in
``server/serve.py``.

Three groups of families:

- upstream's admission metrics with ``apiserver_`` replaced by ``webhook_gateway_`` (MET-01..08),
  same names, labels, label values and buckets;
- the gateway's operational metrics (MET-09);
- finer views an operator of a gateway needs: backend call latency with buckets from 0.5 ms, call
  errors by reason, per-review end-to-end latency and overhead, in-flight reviews, open connections
  per backend origin, configuration generation.

Hot path: prometheus_client's ``.labels(...)`` costs about a microsecond (it validates, joins and
locks), so every child is looked up once per label tuple and kept in a plain dict. Label values come
only from the configuration (backend names), from the gateway's own code (types, outcomes, error
kinds, HTTP codes) or from a small closed set (operations); never from free request content.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.admission import OPERATIONS
from gateway.dispatch.report import DispatchReport, InvocationRecord

PREFIX: Final = "webhook_gateway_"

# MET-01: upstream's buckets, exactly (k8s.io/apiserver pkg/admission/metrics/metrics.go).
WEBHOOK_DURATION_BUCKETS: Final = (0.005, 0.025, 0.1, 0.5, 1.0, 2.5, 10.0, 25.0)
STEP_DURATION_BUCKETS: Final = (0.005, 0.025, 0.1, 0.5, 1.0, 2.5)
MATCH_CONDITION_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.1, 0.2, 0.25)

# [GW] Backends on the same node answer in well under 5 ms, where upstream's first bucket ends.
FINE_DURATION_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
OVERHEAD_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

Endpoint = str  # "validating" | "mutating"

# MET-06 [UP-quirk]: the webhook_* metrics say "validating", the step metric says "validate".
_WEBHOOK_TYPE: Final = {"validating": "validating", "mutating": "admit"}
_STEP_TYPE: Final = {"validating": "validate", "mutating": "admit"}
# MET-07 [UP-quirk]: exclusions use admit/validate; evaluation errors and seconds use admit/validating.
_EXCLUSION_TYPE: Final = _STEP_TYPE
_EVALUATION_TYPE: Final = _WEBHOOK_TYPE

_REJECTING: Final = frozenset({"rejected", "failed_closed", "internal_error"})  # MET-06
_ERROR_KIND: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")

# prometheus_client's text writer always appends "_total" to a counter's name; upstream's two
# "..._count" counters have no such suffix (MET-01: identical names), so render() restores them.
_UNSUFFIXED_COUNTERS: Final = (
    PREFIX + "admission_webhook_rejection_count",
    PREFIX + "admission_webhook_fail_open_count",
)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _operation(operation: str) -> str:
    """The operation label: a closed set, so that a malformed review cannot add series."""
    return operation if operation in OPERATIONS else "UNKNOWN"


def _error_reason(record: InvocationRecord) -> str:
    kind = record.error_kind
    if not kind:
        return "internal"  # a bug while handling the reply (VAL-06), not a transport failure
    return kind if _ERROR_KIND.fullmatch(kind) else "other"


class Metrics:
    """All gateway metrics, in one registry of their own.

    Call ``review_started``/``review_finished`` around every review, ``config_reloaded`` after every
    reload attempt, and wire ``set_connection_source`` to the connection pool. ``render`` produces the
    text exposition served at ``/metrics``.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        p = PREFIX
        webhook = ("name", "type", "operation")
        condition = ("name", "kind", "type", "operation")

        # --- MET-01..08: upstream's families -----------------------------------------------------
        self._webhook_duration = Histogram(
            p + "admission_webhook_admission_duration_seconds",
            "Backend webhook latency in seconds, per webhook name, type (admit or validating), "
            "operation and whether the invocation rejected the review.",
            (*webhook, "rejected"), buckets=WEBHOOK_DURATION_BUCKETS, registry=reg,
        )  # fmt: skip
        self._webhook_requests = Counter(
            p + "admission_webhook_request_total",
            "Backend webhook invocations, per webhook name, type, operation, status code and rejected.",
            (*webhook, "code", "rejected"), registry=reg,
        )  # fmt: skip
        self._webhook_rejections = Counter(
            p + "admission_webhook_rejection_count",
            "Backend webhook invocations that made the review fail, per webhook name, type, operation, "
            "error type (no_error, calling_webhook_error, apiserver_internal_error) and rejection code.",
            (*webhook, "error_type", "rejection_code"), registry=reg,
        )  # fmt: skip
        self._webhook_fail_open = Counter(
            p + "admission_webhook_fail_open_count",
            "Backend webhook call errors ignored under failurePolicy Ignore, per webhook name and type.",
            ("name", "type"), registry=reg,
        )  # fmt: skip
        self._condition_errors = Counter(
            p + "admission_match_condition_evaluation_errors_total",
            "Match condition expressions that failed to evaluate.",
            condition, registry=reg,
        )  # fmt: skip
        self._condition_exclusions = Counter(
            p + "admission_match_condition_exclusions_total",
            "Backend webhooks skipped because of their match conditions.",
            condition, registry=reg,
        )  # fmt: skip
        self._condition_seconds = Histogram(
            p + "admission_match_condition_evaluation_seconds",
            "Time to evaluate one backend webhook's match conditions, in seconds.",
            condition, buckets=MATCH_CONDITION_BUCKETS, registry=reg,
        )  # fmt: skip
        self._step_duration = Histogram(
            p + "admission_step_admission_duration_seconds",
            "Latency of one whole review in seconds, per type (admit or validate), operation and "
            "whether the review was denied.",
            ("type", "operation", "rejected"), buckets=STEP_DURATION_BUCKETS, registry=reg,
        )  # fmt: skip

        # --- MET-09: the gateway's own operational metrics --------------------------------------
        self._inbound = Counter(
            p + "inbound_requests_total",
            "Requests to the review endpoints, per endpoint (validating, mutating) and HTTP status "
            "(499: the caller went away before the answer).",
            ("endpoint", "code"), registry=reg,
        )  # fmt: skip
        self._reloads = Counter(
            p + "config_reloads_total",
            "Configuration load attempts, per result (success, failure).",
            ("result",), registry=reg,
        )  # fmt: skip
        self._backends = Gauge(
            p + "backends",
            "Backend webhooks in the configuration in force, per kind (validating, mutating).",
            ("kind",), registry=reg,
        )  # fmt: skip
        self._deadline_exhausted = Counter(
            p + "deadline_exhausted_total",
            "Reviews in which the gateway's deadline ended unfinished backend calls (FPT-08), "
            "per type (admit, validate).",
            ("type",), registry=reg,
        )  # fmt: skip
        self._reinvocations = Counter(
            p + "reinvocations_total",
            "Mutating backend webhooks scheduled for the reinvocation round, per webhook name.",
            ("name",), registry=reg,
        )  # fmt: skip

        # --- [GW] finer views --------------------------------------------------------------------
        self._call_duration = Histogram(
            p + "backend_call_duration_seconds",
            "Backend webhook latency in seconds with buckets from 0.5 ms, per webhook name and type.",
            ("name", "type"), buckets=FINE_DURATION_BUCKETS, registry=reg,
        )  # fmt: skip
        self._call_errors = Counter(
            p + "backend_call_errors_total",
            "Backend webhook call errors (ignored or not), per webhook name, type and reason "
            "(connect, tls, timeout, status, bad_response, verification, version, client_config, ...).",
            ("name", "type", "reason"), registry=reg,
        )  # fmt: skip
        self._review_duration = Histogram(
            p + "review_duration_seconds",
            "End-to-end latency of a review request in seconds, per endpoint and decision "
            "(allowed, denied, error).",
            ("endpoint", "decision"), buckets=FINE_DURATION_BUCKETS, registry=reg,
        )  # fmt: skip
        self._overhead = Histogram(
            p + "review_overhead_seconds",
            "Time a review spent in the gateway itself: end-to-end latency minus backend time "
            "(the longest call of a validating fan-out, the sum of a mutating chain).",
            ("endpoint",), buckets=OVERHEAD_BUCKETS, registry=reg,
        )  # fmt: skip
        self._in_flight = Gauge(
            p + "reviews_in_flight", "Reviews being handled now, per endpoint.", ("endpoint",), registry=reg
        )
        self._generation = Gauge(
            p + "config_generation",
            "Generation of the configuration in force (increases with every successful reload).",
            registry=reg,
        )
        self._last_reload_ok = Gauge(
            p + "config_last_reload_successful",
            "1 if the last configuration load attempt succeeded, else 0.",
            registry=reg,
        )
        self._connections = _ConnectionCollector()
        reg.register(self._connections)

        # Series that should exist at 0 before the first event, so that rate() and alerts work.
        for result in ("success", "failure"):
            self._reloads.labels(result)
        for kind in ("validating", "mutating"):
            self._backends.labels(kind)

        # Child caches: label tuple -> child metric(s).
        self._invocation_children: dict[
            tuple[str, str, str, int, bool], tuple[Histogram, Counter, Histogram]
        ] = {}
        self._rejection_children: dict[tuple[str, str, str, str, int], Counter] = {}
        self._fail_open_children: dict[tuple[str, str], Counter] = {}
        self._error_children: dict[tuple[str, str, str], Counter] = {}
        self._condition_children: dict[tuple[str, str, str, bool], tuple[Counter, Counter, Histogram]] = {}
        self._review_children: dict[tuple[str, int, str, str], tuple[Counter, Histogram]] = {}
        self._step_children: dict[tuple[str, str, bool], Histogram] = {}
        self._overhead_children: dict[str, Histogram] = {}
        self._in_flight_children: dict[str, Gauge] = {}
        self._deadline_children: dict[str, Counter] = {}
        self._reinvocation_children: dict[str, Counter] = {}

    # --- per review ------------------------------------------------------------------------------

    def review_started(self, endpoint: Endpoint) -> None:
        """A review request arrived (in-flight gauge)."""
        self._in_flight_child(endpoint).inc()

    def review_finished(
        self,
        endpoint: Endpoint,
        *,
        code: int,
        seconds: float,
        operation: str = "",
        allowed: bool | None = None,
        report: DispatchReport | None = None,
    ) -> None:
        """Record one finished review request.

        ``allowed`` is None when the request got no verdict (400, 413, caller gone); then only the
        inbound counters and the end-to-end latency are recorded. With a verdict, MET-08's step
        metric is observed once, and each invocation in ``report`` per MET-02..07.
        """
        self._in_flight_child(endpoint).dec()
        decision = "error" if allowed is None else ("allowed" if allowed else "denied")
        op = _operation(report.operation if report is not None else operation)
        key = (endpoint, code, decision, op)
        review = self._review_children.get(key)
        if review is None:
            review = self._review_children[key] = (
                self._inbound.labels(endpoint, str(code)),
                self._review_duration.labels(endpoint, decision),
            )
        review[0].inc()
        review[1].observe(seconds)
        if allowed is None:
            return

        step_key = (endpoint, op, not allowed)
        step = self._step_children.get(step_key)
        if step is None:
            step_type = _STEP_TYPE.get(endpoint, endpoint)
            step = self._step_children[step_key] = self._step_duration.labels(
                step_type, op, _bool(not allowed)
            )
        step.observe(seconds)  # MET-08
        if report is None:
            return

        overhead = self._overhead_children.get(endpoint)
        if overhead is None:
            overhead = self._overhead_children[endpoint] = self._overhead.labels(endpoint)
        overhead.observe(max(0.0, seconds - report.backend_seconds))

        webhook_type = _WEBHOOK_TYPE.get(endpoint, endpoint)
        for record in report.invocations:
            self._observe_invocation(record, webhook_type, op)
        if report.conditions:
            self._observe_conditions(report, endpoint, op)
        if report.deadline_exhausted:
            counter = self._deadline_children.get(endpoint)
            if counter is None:
                counter = self._deadline_children[endpoint] = self._deadline_exhausted.labels(
                    _STEP_TYPE.get(endpoint, endpoint)
                )
            counter.inc()
        for name in report.reinvoked:
            counter = self._reinvocation_children.get(name)
            if counter is None:
                counter = self._reinvocation_children[name] = self._reinvocations.labels(name)
            counter.inc()

    def _observe_invocation(self, record: InvocationRecord, webhook_type: str, op: str) -> None:
        outcome = record.outcome
        if outcome == "cancelled":
            # FPT-03/MET-04/MET-05: a call abandoned because the caller went away is not counted.
            return
        code = 600 if record.code > 600 else record.code  # MET-03/05
        rejected = outcome in _REJECTING  # MET-06
        name = record.name
        key = (name, webhook_type, op, code, rejected)
        children = self._invocation_children.get(key)
        if children is None:
            children = self._invocation_children[key] = (
                self._webhook_duration.labels(name, webhook_type, op, _bool(rejected)),
                self._webhook_requests.labels(name, webhook_type, op, str(code), _bool(rejected)),
                self._call_duration.labels(name, webhook_type),
            )
        seconds = record.duration_seconds
        children[0].observe(seconds)  # MET-02
        children[1].inc()  # MET-03
        children[2].observe(seconds)
        if outcome == "allowed":
            return
        if outcome == "failed_open":
            fail_open = self._fail_open_children.get((name, webhook_type))
            if fail_open is None:
                fail_open = self._fail_open_children[(name, webhook_type)] = self._webhook_fail_open.labels(
                    name, webhook_type
                )
            fail_open.inc()  # MET-04
            self._count_call_error(record, webhook_type)
            return
        if outcome == "failed_closed":
            error_type = "calling_webhook_error"
            self._count_call_error(record, webhook_type)
        elif outcome == "internal_error":
            error_type, code = "apiserver_internal_error", 0
        else:
            error_type = "no_error"
        rkey = (name, webhook_type, op, error_type, code)
        rejection = self._rejection_children.get(rkey)
        if rejection is None:
            rejection = self._rejection_children[rkey] = self._webhook_rejections.labels(
                name, webhook_type, op, error_type, str(code)
            )
        rejection.inc()  # MET-05

    def _count_call_error(self, record: InvocationRecord, webhook_type: str) -> None:
        key = (record.name, webhook_type, _error_reason(record))
        counter = self._error_children.get(key)
        if counter is None:
            counter = self._error_children[key] = self._call_errors.labels(*key)
        counter.inc()

    def _observe_conditions(self, report: DispatchReport, endpoint: Endpoint, op: str) -> None:
        """MET-07 / MAT-30: the matcher decided what counts; this only applies the label quirks."""
        for condition in report.conditions:
            key = (condition.name, endpoint, op, False)
            children = self._condition_children.get(key)
            if children is None:
                exclusion_type = _EXCLUSION_TYPE.get(endpoint, endpoint)
                evaluation_type = _EVALUATION_TYPE.get(endpoint, endpoint)
                children = self._condition_children[key] = (
                    self._condition_exclusions.labels(condition.name, "webhook", exclusion_type, op),
                    self._condition_errors.labels(condition.name, "webhook", evaluation_type, op),
                    self._condition_seconds.labels(condition.name, "webhook", evaluation_type, op),
                )
            if condition.excluded:
                children[0].inc()
            if condition.evaluation_errors:
                children[1].inc(condition.evaluation_errors)
            children[2].observe(condition.seconds)  # [GW] every evaluation, not only non-matches

    def _in_flight_child(self, endpoint: Endpoint) -> Gauge:
        gauge = self._in_flight_children.get(endpoint)
        if gauge is None:
            gauge = self._in_flight_children[endpoint] = self._in_flight.labels(endpoint)
        return gauge

    # --- configuration and pool ------------------------------------------------------------------

    def config_reloaded(self, ok: bool, generation: int, backends: Mapping[str, int]) -> None:
        """Record one configuration load attempt (MET-09, CFG-25).

        ``generation`` and ``backends`` (kind -> count) describe the configuration in force after the
        attempt: the new one on success, the last good one on failure.
        """
        self._reloads.labels("success" if ok else "failure").inc()
        self._last_reload_ok.set(1 if ok else 0)
        self._generation.set(generation)
        for kind, count in backends.items():
            self._backends.labels(kind).set(count)

    def set_connection_source(self, source: Callable[[], Mapping[str, int]] | None) -> None:
        """At every scrape, ``source()`` gives the open connections per backend origin."""
        self._connections.source = source

    # --- exposition ------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition (format 0.0.4, as Go clients serve it) and its content type."""
        body = generate_latest(_Exposition(self.registry))
        for name in _UNSUFFIXED_COUNTERS:
            body = body.replace(f"# HELP {name}_total ".encode(), f"# HELP {name} ".encode(), 1)
            body = body.replace(f"# TYPE {name}_total ".encode(), f"# TYPE {name} ".encode(), 1)
        return body, CONTENT_TYPE_PLAIN_0_0_4


class _ConnectionCollector(Collector):
    """Open connections per backend origin, read from the pool at scrape time."""

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, int]] | None = None

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        source = self.source
        if source is not None:
            try:
                counts = dict(source())
            except Exception:  # noqa: BLE001 - a broken pool probe must not break the whole scrape
                counts = {}
            for origin, count in sorted(counts.items()):
                family.add_metric([origin], count)
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            PREFIX + "backend_open_connections",
            "Open connections of the backend connection pool, per origin (scheme://host:port).",
            labels=["origin"],
        )


class _Exposition(Collector):
    """The registry as upstream would expose it: no ``_created`` series, unsuffixed ``_count`` counters.

    prometheus_client adds a ``<name>_created`` series to every counter and histogram child
    (an OpenMetrics feature); Go's client, which the upstream metrics come from, does not.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            unsuffixed = family.name in _UNSUFFIXED_COUNTERS
            samples = []
            for sample in family.samples:
                if sample.name == created:
                    continue
                if unsuffixed:
                    sample = sample._replace(name=family.name)  # noqa: PLW2901
                samples.append(sample)
            family.samples = samples
            yield family
