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

Why not prometheus_client's ``Counter``/``Histogram``: measured with 5 backends per review, their
per-call locking and bucket loops cost about 14 µs per review even with every child cached; the
plain-attribute children below cost about 4 µs. Everything runs on the one trio thread, so no lock
is needed. Exposition still goes through prometheus_client (its registry and text writer), and the
children are cached per label tuple so the hot path never formats or validates labels.

Label values come only from the configuration (backend names), from the gateway's own code (types,
outcomes, error kinds, HTTP codes) or from a small closed set (operations); never from free request
content, so cardinality is bounded by the configuration.
"""

from __future__ import annotations

import platform
import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Generic, Literal, TypeVar

from prometheus_client import CollectorRegistry, Info, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from gateway import __version__
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

_ERROR_KIND: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _go_float(bound: float) -> str:
    """A bucket bound as upstream's Go client writes it (``0.005``, ``1``, ``25``, ``+Inf``).

    prometheus_client would write ``1.0``; Prometheus 3 normalises both, Prometheus 2 does not.
    """
    if bound == float("inf"):
        return "+Inf"
    text = format(bound, "g")
    return text if float(text) == bound else repr(bound)


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


# --- storage: one child per label tuple, plain attributes, single-threaded ---------------------------


class CounterChild:
    """One counter series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class GaugeChild:
    """One gauge series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class HistogramChild:
    """One histogram series: per-bucket (non-cumulative) counts, the last one for +Inf."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left finds the first bound >= value: Prometheus buckets are "less than or equal".
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


Kind = Literal["counter", "gauge", "histogram"]


C = TypeVar("C", CounterChild, GaugeChild, HistogramChild)


class Family(Generic[C]):
    """A metric family: name, help, label names and its children by label values."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        factory: Callable[[], C],
        *,
        kind: Kind,
        buckets: tuple[float, ...] = (),
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.kind = kind
        self.buckets = buckets
        self.children: dict[tuple[str, ...], C] = {}
        self._factory: Callable[[], C] = factory

    def labels(self, *values: str) -> C:
        """The child for these label values (created on first use)."""
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self.children[values] = self._factory()
        return child

    def to_metric(self) -> Metric:
        """The family as prometheus_client's exposition model (upstream names, no ``_created``)."""
        family_name = self.name
        if self.kind == "counter" and family_name.endswith("_total"):
            family_name = family_name[:-6]  # the text writer adds "_total" back to HELP/TYPE
        metric = Metric(family_name, self.documentation, self.kind)
        names = self.labelnames
        samples = metric.samples
        for values, child in self.children.items():
            _append_samples(samples, self.name, dict(zip(names, values, strict=True)), child)
        return metric


def _append_samples(
    samples: list[Sample],
    name: str,
    labels: dict[str, str],
    child: CounterChild | GaugeChild | HistogramChild,
) -> None:
    if isinstance(child, HistogramChild):
        cumulative = 0
        for bound, count in zip((*child.bounds, float("inf")), child.counts, strict=True):
            cumulative += count
            samples.append(Sample(f"{name}_bucket", {**labels, "le": _go_float(bound)}, cumulative))
        samples.append(Sample(f"{name}_count", labels, cumulative))
        samples.append(Sample(f"{name}_sum", labels, child.sum))
    else:
        samples.append(Sample(name, labels, child.value))


def _counter(name: str, documentation: str, labelnames: Sequence[str]) -> Family[CounterChild]:
    return Family(PREFIX + name, documentation, labelnames, CounterChild, kind="counter")


def _gauge(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Family[GaugeChild]:
    return Family(PREFIX + name, documentation, labelnames, GaugeChild, kind="gauge")


def _histogram(
    name: str, documentation: str, labelnames: Sequence[str], buckets: tuple[float, ...]
) -> Family[HistogramChild]:
    return Family(
        PREFIX + name,
        documentation,
        labelnames,
        lambda: HistogramChild(buckets),
        kind="histogram",
        buckets=buckets,
    )


# --- the gateway's metrics ---------------------------------------------------------------------------


class Metrics:
    """All gateway metrics, in one registry of their own.

    Call ``review_started``/``review_finished`` around every review, ``config_reloaded`` after every
    reload attempt, and wire ``set_connection_source`` to the connection pool. ``render`` produces the
    text exposition served at ``/metrics``. Not thread-safe: use it from the trio thread only.
    """

    def __init__(self) -> None:
        webhook = ("name", "type", "operation")
        condition = ("name", "kind", "type", "operation")

        # --- MET-01..08: upstream's families -----------------------------------------------------
        self.webhook_duration = _histogram(
            "admission_webhook_admission_duration_seconds",
            "Backend webhook latency in seconds, per webhook name, type (admit or validating), "
            "operation and whether the invocation rejected the review.",
            (*webhook, "rejected"), WEBHOOK_DURATION_BUCKETS,
        )  # fmt: skip
        self.webhook_requests = _counter(
            "admission_webhook_request_total",
            "Backend webhook invocations, per webhook name, type, operation, status code and rejected.",
            (*webhook, "code", "rejected"),
        )  # fmt: skip
        self.webhook_rejections = _counter(
            "admission_webhook_rejection_count",
            "Backend webhook invocations that made the review fail, per webhook name, type, operation, "
            "error type (no_error, calling_webhook_error, apiserver_internal_error) and rejection code.",
            (*webhook, "error_type", "rejection_code"),
        )  # fmt: skip
        self.webhook_fail_open = _counter(
            "admission_webhook_fail_open_count",
            "Backend webhook call errors ignored under failurePolicy Ignore, per webhook name and type.",
            ("name", "type"),
        )  # fmt: skip
        self.condition_errors = _counter(
            "admission_match_condition_evaluation_errors_total",
            "Match condition expressions that failed to evaluate.",
            condition,
        )  # fmt: skip
        self.condition_exclusions = _counter(
            "admission_match_condition_exclusions_total",
            "Backend webhooks skipped because of their match conditions.",
            condition,
        )  # fmt: skip
        self.condition_seconds = _histogram(
            "admission_match_condition_evaluation_seconds",
            "Time to evaluate one backend webhook's match conditions, in seconds.",
            condition, MATCH_CONDITION_BUCKETS,
        )  # fmt: skip
        self.step_duration = _histogram(
            "admission_step_admission_duration_seconds",
            "Latency of one whole review in seconds, per type (admit or validate), operation and "
            "whether the review was denied.",
            ("type", "operation", "rejected"), STEP_DURATION_BUCKETS,
        )  # fmt: skip

        # --- MET-09: the gateway's own operational metrics --------------------------------------
        self.inbound_requests = _counter(
            "inbound_requests_total",
            "Requests to the review endpoints, per endpoint (validating, mutating) and HTTP status "
            "(499: the caller went away before the answer).",
            ("endpoint", "code"),
        )  # fmt: skip
        self.config_reloads = _counter(
            "config_reloads_total", "Configuration load attempts, per result (success, failure).", ("result",)
        )
        self.backends = _gauge(
            "backends",
            "Backend webhooks in the configuration in force, per kind (validating, mutating).",
            ("kind",),
        )
        self.deadline_exhausted = _counter(
            "deadline_exhausted_total",
            "Reviews in which the gateway's deadline ended unfinished backend calls (FPT-08), "
            "per type (admit, validate).",
            ("type",),
        )  # fmt: skip
        self.reinvocations = _counter(
            "reinvocations_total",
            "Mutating backend webhooks scheduled for the reinvocation round, per webhook name.",
            ("name",),
        )  # fmt: skip

        # --- [GW] finer views --------------------------------------------------------------------
        self.call_duration = _histogram(
            "backend_call_duration_seconds",
            "Backend webhook latency in seconds with buckets from 0.5 ms, per webhook name and type.",
            ("name", "type"), FINE_DURATION_BUCKETS,
        )  # fmt: skip
        self.call_errors = _counter(
            "backend_call_errors_total",
            "Backend webhook call errors (ignored or not), per webhook name, type and reason: connect, "
            "tls, transport, timeout, status (non-2xx), too_large, decode, invalid_response "
            "(verification), version, bad_response (patch), client_config, internal.",
            ("name", "type", "reason"),
        )  # fmt: skip
        self.review_duration = _histogram(
            "review_duration_seconds",
            "End-to-end latency of a review request in seconds, per endpoint and decision "
            "(allowed, denied, error).",
            ("endpoint", "decision"), FINE_DURATION_BUCKETS,
        )  # fmt: skip
        self.review_overhead = _histogram(
            "review_overhead_seconds",
            "Time a review spent in the gateway itself: end-to-end latency minus backend time "
            "(the longest call of a validating fan-out, the sum of a mutating chain).",
            ("endpoint",), OVERHEAD_BUCKETS,
        )  # fmt: skip
        self.reviews_in_flight = _gauge(
            "reviews_in_flight", "Reviews being handled now, per endpoint.", ("endpoint",)
        )
        self.config_generation = _gauge(
            "config_generation",
            "Generation of the configuration in force (increases with every successful reload).",
        )
        self.config_last_reload_ok = _gauge(
            "config_last_reload_successful", "1 if the last configuration load attempt succeeded, else 0."
        )
        self.connection_source: Callable[[], Mapping[Any, int]] | None = None

        self.families: tuple[Family[CounterChild] | Family[GaugeChild] | Family[HistogramChild], ...] = (
            self.webhook_duration, self.webhook_requests, self.webhook_rejections, self.webhook_fail_open,
            self.condition_errors, self.condition_exclusions, self.condition_seconds, self.step_duration,
            self.inbound_requests, self.config_reloads, self.backends, self.deadline_exhausted,
            self.reinvocations, self.call_duration, self.call_errors, self.review_duration,
            self.review_overhead, self.reviews_in_flight, self.config_generation, self.config_last_reload_ok,
        )  # fmt: skip
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        # process_* (CPU, memory, open files, start time) and which build is running, for dashboards.
        ProcessCollector(registry=self.registry)
        Info(
            "webhook_gateway_build", "The running gateway's version (value 1).", registry=self.registry
        ).info({"version": __version__, "python": platform.python_version()})

        # Series that exist at 0 before the first event, so that rate() and alerts work from the start.
        for result in ("success", "failure"):
            self.config_reloads.labels(result)
        for kind in ("validating", "mutating"):
            self.backends.labels(kind)
            self.reviews_in_flight.labels(kind)
        self.config_generation.labels()
        self.config_last_reload_ok.labels()

        # Hot-path caches: several children fetched with one dict lookup.
        self._invocation_children: dict[
            tuple[str, str, str, int, bool], tuple[HistogramChild, CounterChild, HistogramChild]
        ] = {}
        self._review_children: dict[tuple[str, int, str], tuple[CounterChild, HistogramChild]] = {}

    # --- per review ------------------------------------------------------------------------------

    def review_started(self, endpoint: Endpoint) -> None:
        """A review request arrived (in-flight gauge)."""
        self.reviews_in_flight.labels(endpoint).value += 1

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
        self.reviews_in_flight.labels(endpoint).value -= 1
        decision = "error" if allowed is None else ("allowed" if allowed else "denied")
        key = (endpoint, code, decision)
        review = self._review_children.get(key)
        if review is None:
            review = self._review_children[key] = (
                self.inbound_requests.labels(endpoint, str(code)),
                self.review_duration.labels(endpoint, decision),
            )
        review[0].value += 1
        review[1].observe(seconds)
        if allowed is None:
            return

        op = _operation(report.operation if report is not None else operation)
        self.step_duration.labels(_STEP_TYPE.get(endpoint, endpoint), op, _bool(not allowed)).observe(seconds)
        if report is None:
            return
        self.review_overhead.labels(endpoint).observe(max(0.0, seconds - report.backend_seconds))

        webhook_type = _WEBHOOK_TYPE.get(endpoint, endpoint)
        for record in report.invocations:
            self._observe_invocation(record, webhook_type, op)
        if report.conditions:
            self._observe_conditions(report, endpoint, op)
        if report.deadline_exhausted:
            self.deadline_exhausted.labels(_STEP_TYPE.get(endpoint, endpoint)).value += 1
        for name in report.reinvoked:
            self.reinvocations.labels(name).value += 1

    def _observe_invocation(self, record: InvocationRecord, webhook_type: str, op: str) -> None:
        outcome = record.outcome
        if outcome == "cancelled":
            # FPT-03/MET-04/MET-05: a call abandoned because the caller went away is not counted.
            return
        code = 600 if record.code > 600 else record.code  # MET-03/05
        rejected = record.rejected  # MET-06
        name = record.name
        key = (name, webhook_type, op, code, rejected)
        children = self._invocation_children.get(key)
        if children is None:
            children = self._invocation_children[key] = (
                self.webhook_duration.labels(name, webhook_type, op, _bool(rejected)),
                self.webhook_requests.labels(name, webhook_type, op, str(code), _bool(rejected)),
                self.call_duration.labels(name, webhook_type),
            )
        seconds = record.duration_seconds
        children[0].observe(seconds)  # MET-02
        children[1].value += 1  # MET-03
        children[2].observe(seconds)
        if outcome == "allowed":
            return
        if outcome == "failed_open":
            self.webhook_fail_open.labels(name, webhook_type).value += 1  # MET-04
            self.call_errors.labels(name, webhook_type, _error_reason(record)).value += 1
            return
        if outcome == "failed_closed":
            self.call_errors.labels(name, webhook_type, _error_reason(record)).value += 1
        elif outcome == "internal_error":
            code = 0
        self.webhook_rejections.labels(
            name, webhook_type, op, record.error_type, str(code)
        ).value += 1  # MET-05

    def _observe_conditions(self, report: DispatchReport, endpoint: Endpoint, op: str) -> None:
        """MET-07 / MAT-30: the matcher decided what counts; this only applies the label quirks."""
        exclusion_type = _EXCLUSION_TYPE.get(endpoint, endpoint)
        evaluation_type = _EVALUATION_TYPE.get(endpoint, endpoint)
        for condition in report.conditions:
            name = condition.name
            if condition.excluded:
                self.condition_exclusions.labels(name, "webhook", exclusion_type, op).value += 1
            errors = condition.evaluation_errors
            if errors:
                self.condition_errors.labels(name, "webhook", evaluation_type, op).value += errors
            # [GW] every evaluation is observed, not only those that did not plainly match.
            self.condition_seconds.labels(name, "webhook", evaluation_type, op).observe(condition.seconds)

    # --- configuration and pool ------------------------------------------------------------------

    def config_reloaded(self, ok: bool, generation: int, backends: Mapping[str, int]) -> None:
        """Record one configuration load attempt (MET-09, CFG-25).

        ``generation`` and ``backends`` (kind -> count) describe the configuration in force after the
        attempt: the new one on success, the last good one on failure.
        """
        self.config_reloads.labels("success" if ok else "failure").value += 1
        self.config_last_reload_ok.labels().value = 1 if ok else 0
        self.config_generation.labels().value = generation
        for kind, count in backends.items():
            self.backends.labels(kind).value = count

    def set_connection_source(self, source: Callable[[], Mapping[Any, int]] | None) -> None:
        """At every scrape, ``source()`` gives the open connections per backend origin.

        Keys are origins (``transport.resolve.Origin`` or str); their ``str`` (``scheme://host:port``)
        is the label, so origins that differ only in TLS settings or credentials are summed.
        """
        self.connection_source = source

    # --- exposition ------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition (format 0.0.4, as Go clients serve it) and its content type."""
        body = generate_latest(self.registry)
        # prometheus_client's writer appends "_total" to every counter's HELP/TYPE name; upstream's
        # two "..._count" counters have no such suffix (MET-01: identical names).
        for family in (self.webhook_rejections, self.webhook_fail_open):
            for line in (b"# HELP ", b"# TYPE "):
                body = body.replace(
                    line + family.name.encode() + b"_total ", line + family.name.encode() + b" ", 1
                )
        return body, CONTENT_TYPE_PLAIN_0_0_4

    def connection_metric(self) -> Metric:
        """Open connections per backend origin, read from the pool now."""
        metric = Metric(
            PREFIX + "backend_open_connections",
            "Open connections of the backend connection pool, per origin (scheme://host:port).",
            "gauge",
        )
        source = self.connection_source
        if source is not None:
            counts: dict[str, float] = {}
            try:
                for key, open_count in source().items():
                    label = str(key)
                    counts[label] = counts.get(label, 0.0) + open_count
            except Exception:  # noqa: BLE001 - a broken pool probe must not break the whole scrape
                counts = {}
            for label, total in sorted(counts.items()):
                metric.samples.append(Sample(metric.name, {"origin": label}, total))
        return metric


class _Collector(Collector):
    """Hands every family to prometheus_client's registry at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        for family in self._metrics.families:
            yield family.to_metric()
        yield self._metrics.connection_metric()
