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
children are cached per label tuple so the hot path never formats or validates labels. With
``--workers N``, prometheus_client's multiprocess mode (mmap-backed values) would cost about 32 µs per
such review; instead each worker keeps these and ``server/workers.py`` merges their snapshots at
scrape time (docs/performance.md).

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
from gateway.config.trust import CaExpiry
from gateway.conversion.convert import ConversionReport
from gateway.dispatch.report import DispatchReport, InvocationRecord

PREFIX: Final = "webhook_gateway_"

# MET-01: upstream's buckets, exactly (k8s.io/apiserver pkg/admission/metrics/metrics.go).
WEBHOOK_DURATION_BUCKETS: Final = (0.005, 0.025, 0.1, 0.5, 1.0, 2.5, 10.0, 25.0)
STEP_DURATION_BUCKETS: Final = (0.005, 0.025, 0.1, 0.5, 1.0, 2.5)
MATCH_CONDITION_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.1, 0.2, 0.25)

# MET-10: upstream's conversion buckets (k8s.io/apiextensions-apiserver pkg/apiserver/conversion/metrics.go).
CONVERSION_DURATION_BUCKETS: Final = (
    0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip
CRD_CONVERSION_BUCKETS: Final = tuple(0.001 * 2**k for k in range(15))

# [GW] Backends on the same node answer in well under 5 ms, where upstream's first bucket ends.
FINE_DURATION_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
OVERHEAD_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

Endpoint = str  # "validating" | "mutating"
CircuitSource = Callable[[], Iterable[tuple[str, int, bool]]]  # (webhook, state value, shared)

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


class _ReviewCells:
    """The children one kind of finished review updates (per endpoint, code, decision, operation)."""

    __slots__ = ("duration", "in_flight", "overhead", "requests", "step", "webhook_type")

    def __init__(
        self,
        *,
        in_flight: GaugeChild,
        requests: CounterChild,
        duration: HistogramChild,
        step: HistogramChild | None,
        overhead: HistogramChild | None,
        webhook_type: str,
    ) -> None:
        self.in_flight = in_flight  # reviews_in_flight
        self.requests = requests  # inbound_requests_total
        self.duration = duration  # review_duration_seconds
        self.step = step  # MET-08, with a verdict
        self.overhead = overhead  # review_overhead_seconds, with a report
        self.webhook_type = webhook_type  # MET-06's type label of the invocations


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
            "(verification), version, bad_response (patch), client_config, internal; calls not made: "
            "circuit_open, max_in_flight (backend-policy), shed (gateway overloaded).",
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
        self.backend_timeout = _gauge(
            "backend_timeout_seconds",
            "timeoutSeconds of each backend webhook in the configuration in force, per webhook name and "
            "type: compare with backend_call_duration_seconds.",
            ("name", "type"),
        )  # fmt: skip
        self.serving_certificate_expiry = _gauge(
            "serving_certificate_expiry_timestamp_seconds",
            "When the serving certificate in use expires (notAfter), in seconds since the Unix epoch; "
            "absent without TLS.",
        )  # fmt: skip
        self.connection_source: Callable[[], Mapping[Any, int]] | None = None

        # --- [GW] inbound connections (docs/inbound.md) ---------------------------------------------
        self.inbound_closed = _counter(
            "inbound_connections_closed_total",
            "Inbound connections the gateway closed because a limit was reached, per reason: "
            "handshake_timeout, handshake_evicted (the oldest pending connection made room for a new one), "
            "header_timeout, body_timeout (HTTP/2: the stream is reset), idle_timeout, write_timeout, "
            "h2_flood (GOAWAY: over the frame budget), h1_flood (HTTP/1.1 over the frame budget: tiny "
            "chunks), stream_limit (HTTP/2: one stream over the concurrent-stream limit is refused).",
            ("reason",),
        )  # fmt: skip
        self.inbound_rejected = _counter(
            "inbound_connections_rejected_total",
            "Inbound connections refused at accept, per reason: limit (the connection bound "
            "reached), accept_error (out of file descriptors or memory; accept backs off).",
            ("reason",),
        )  # fmt: skip
        self.handshakes_abandoned = _counter(
            "inbound_handshakes_abandoned_total",
            "TLS handshakes not computed because the client had closed the connection (a dial its "
            "caller gave up) while it waited, per where: accept_queue (the kernel's accept queue, "
            "while accepting was paused), gate (behind the established connections).",
            ("where",),
        )  # fmt: skip
        self.connections_unused = _counter(
            "inbound_connections_unused_total",
            "Inbound connections their client closed before sending any request: a handshake spent on "
            "a dial the client did not need (client-go closes a new connection at once when its idle "
            "pool already holds 25: the dials of a stall that completed after it).",
            (),
        )
        self.handshakes_failed = _counter(
            "inbound_handshakes_failed_total",
            "TLS handshakes the gateway began (its part of the crypto computed) that did not complete, "
            "per reason: client_gone (the client closed or reset the connection meanwhile: a dial its "
            "caller gave up too late), refused (TLS refused it: no common version or cipher, no or an "
            "unverifiable client certificate, not TLS at all; an alert was sent).",
            ("reason",),
        )  # fmt: skip
        self.accept_paused = _counter(
            "inbound_accept_paused_seconds_total",
            "Seconds the gateway accepted no connection because --max-waiting-handshakes TLS "
            "handshakes waited for its event loop; new dials waited in the kernel's accept queue.",
            (),
        )  # fmt: skip
        self.h2_goaways = _counter(
            "inbound_h2_goaway_total",
            "GOAWAY frames sent to HTTP/2 callers, per reason: flood (ENHANCE_YOUR_CALM, over the "
            "frame budget), drain (shutting down).",
            ("reason",),
        )  # fmt: skip
        self.certificate_reloads = _counter(
            "serving_certificate_reloads_total",
            "Serving certificate reload attempts, per result (success, failure: the previous "
            "certificate keeps serving).",
            ("result",),
        )  # fmt: skip
        self.inbound_source: Callable[[], int] | None = None

        # --- [GW] the gateway's own log output (observability/logsink.py) --------------------------
        # Incremented by the log sink (``logs.count_dropped_lines``), from the thread that logs or the
        # sink's writer thread, under the sink's lock: the only child not updated on the trio thread.
        self.log_lines_dropped = _counter(
            "log_lines_dropped_total",
            "Log lines not written: stdout was not read fast enough (more than 8 MiB of lines waiting) "
            "or writing failed (reader gone). Where lines are missing, the log says how many in a "
            '"log lines dropped" line.',
            (),
        )  # fmt: skip

        # --- [GW] full garbage collections (server/gcgovernor.py, docs/performance.md) ---------------
        self.gc_full_collections = _counter(
            "gc_full_collections_total",
            "Full (generation-2) garbage collections the gateway made once serving, per reason: quiet "
            "(no request in flight), interval (the time bound reached under load), growth (the "
            "resident set grew by the bound under load). The event loop stops for each.",
            ("reason",),
        )  # fmt: skip
        self.gc_full_collection_seconds = _counter(
            "gc_full_collection_seconds_total",
            "Seconds the event loop was stopped by those full garbage collections, per reason.",
            ("reason",),
        )  # fmt: skip

        self.families: tuple[Family[CounterChild] | Family[GaugeChild] | Family[HistogramChild], ...] = (
            self.webhook_duration, self.webhook_requests, self.webhook_rejections, self.webhook_fail_open,
            self.condition_errors, self.condition_exclusions, self.condition_seconds, self.step_duration,
            self.inbound_requests, self.config_reloads, self.backends, self.deadline_exhausted,
            self.reinvocations, self.call_duration, self.call_errors, self.review_duration,
            self.review_overhead, self.reviews_in_flight, self.config_generation, self.config_last_reload_ok,
            self.backend_timeout, self.serving_certificate_expiry,
            self.inbound_closed, self.inbound_rejected, self.handshakes_abandoned, self.handshakes_failed,
            self.connections_unused, self.accept_paused,
            self.h2_goaways, self.certificate_reloads,
            self.log_lines_dropped, self.gc_full_collections, self.gc_full_collection_seconds,
        )  # fmt: skip
        self._init_conversion()
        self._init_resilience()
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
        for reason in (
            "handshake_timeout", "handshake_evicted", "header_timeout", "body_timeout", "idle_timeout",
            "write_timeout", "h2_flood", "h1_flood", "stream_limit",
        ):  # fmt: skip
            self.inbound_closed.labels(reason)
        for reason in ("limit", "accept_error"):
            self.inbound_rejected.labels(reason)
        for where in ("accept_queue", "gate"):
            self.handshakes_abandoned.labels(where)
        for reason in ("client_gone", "refused"):
            self.handshakes_failed.labels(reason)
        self.accept_paused.labels()
        self.connections_unused.labels()
        for reason in ("flood", "drain"):
            self.h2_goaways.labels(reason)
        for result in ("success", "failure"):
            self.certificate_reloads.labels(result)
        self.log_lines_dropped.labels()
        for reason in ("quiet", "interval", "growth"):
            self.gc_full_collections.labels(reason)
            self.gc_full_collection_seconds.labels(reason)

        # Hot-path caches: every child a review or an invocation updates, fetched with one dict lookup.
        # Children are still created on first use, in the same order (``labels`` creates them), so the
        # exposition is the same as without the caches; the keys are label values (plus the outcome
        # and whether there is a report), so these grow with the families and no further.
        self._in_flight: dict[str, GaugeChild] = {}
        self._review_cells: dict[tuple[str, int, bool | None, str, bool], _ReviewCells] = {}
        self._invocation_children: dict[
            tuple[str, str, str, int, str], tuple[HistogramChild, CounterChild, HistogramChild]
        ] = {}

    # --- per review ------------------------------------------------------------------------------

    def review_started(self, endpoint: Endpoint) -> None:
        """A review request arrived (in-flight gauge)."""
        child = self._in_flight.get(endpoint)
        if child is None:
            child = self._in_flight[endpoint] = self.reviews_in_flight.labels(endpoint)
        child.value += 1

    def review_finished(
        self,
        endpoint: Endpoint,
        *,
        code: int,
        seconds: float,
        operation: str = "",
        allowed: bool | None = None,
        report: DispatchReport | None = None,
        backend_seconds: float | None = None,
    ) -> None:
        """Record one finished review request.

        ``allowed`` is None when the request got no verdict (400, 413, caller gone); then only the
        inbound counters and the end-to-end latency are recorded. With a verdict, MET-08's step
        metric is observed once, and each invocation in ``report`` per MET-02..07.
        ``backend_seconds`` is ``report.backend_seconds`` when the caller has it already.
        """
        # The operation label is a closed set, so that a malformed review cannot add series.
        if allowed is None:
            op = ""
        elif report is not None:
            op = report.operation if report.operation in OPERATIONS else "UNKNOWN"
        else:
            op = operation if operation in OPERATIONS else "UNKNOWN"
        key = (endpoint, code, allowed, op, report is not None)
        cells = self._review_cells.get(key)
        if cells is None:
            cells = self._review_cells[key] = self._new_review_cells(key)
        cells.in_flight.value -= 1
        cells.requests.value += 1
        cells.duration.observe(seconds)
        step = cells.step
        if step is None:  # no verdict
            return
        step.observe(seconds)
        overhead = cells.overhead
        if overhead is None or report is None:
            return
        if backend_seconds is None:
            backend_seconds = report.backend_seconds
        overhead.observe(seconds - backend_seconds if seconds > backend_seconds else 0.0)

        webhook_type = cells.webhook_type
        children_of = self._invocation_children
        for record in report.invocations:
            outcome = record.outcome
            if outcome == "cancelled":
                # FPT-03/MET-04/MET-05: a call abandoned because the caller went away is not counted.
                continue
            capped = 600 if record.code > 600 else record.code  # MET-03/05
            children = children_of.get((record.name, webhook_type, op, capped, outcome))
            if children is None:
                children = self._new_invocation_children(record, webhook_type, op, capped)
            duration = record.duration_seconds
            # MET-02 and the fine view; HistogramChild.observe, inlined: one call less each.
            histogram = children[0]
            histogram.counts[bisect_left(histogram.bounds, duration)] += 1
            histogram.sum += duration
            children[1].value += 1  # MET-03
            histogram = children[2]
            histogram.counts[bisect_left(histogram.bounds, duration)] += 1
            histogram.sum += duration
            if outcome != "allowed":
                self._observe_call_error(record, webhook_type, op, capped)
        if report.conditions:
            self._observe_conditions(report, endpoint, op)
        if report.deadline_exhausted:
            self.deadline_exhausted.labels(_STEP_TYPE.get(endpoint, endpoint)).value += 1
        for name in report.reinvoked:
            self.reinvocations.labels(name).value += 1

    def _new_review_cells(self, key: tuple[str, int, bool | None, str, bool]) -> _ReviewCells:
        """The children one kind of review updates, created (if new) in the order they are updated."""
        endpoint, code, allowed, op, has_report = key
        decision = "error" if allowed is None else ("allowed" if allowed else "denied")
        in_flight = self._in_flight.get(endpoint)
        if in_flight is None:
            in_flight = self._in_flight[endpoint] = self.reviews_in_flight.labels(endpoint)
        requests = self.inbound_requests.labels(endpoint, str(code))
        duration = self.review_duration.labels(endpoint, decision)
        step = overhead = None
        if allowed is not None:
            step = self.step_duration.labels(_STEP_TYPE.get(endpoint, endpoint), op, _bool(not allowed))
            if has_report:
                overhead = self.review_overhead.labels(endpoint)
        return _ReviewCells(
            in_flight=in_flight,
            requests=requests,
            duration=duration,
            step=step,
            overhead=overhead,
            webhook_type=_WEBHOOK_TYPE.get(endpoint, endpoint),
        )

    def _new_invocation_children(
        self, record: InvocationRecord, webhook_type: str, op: str, code: int
    ) -> tuple[HistogramChild, CounterChild, HistogramChild]:
        name, rejected = record.name, _bool(record.rejected)  # MET-06
        children = self._invocation_children[(name, webhook_type, op, code, record.outcome)] = (
            self.webhook_duration.labels(name, webhook_type, op, rejected),
            self.webhook_requests.labels(name, webhook_type, op, str(code), rejected),
            self.call_duration.labels(name, webhook_type),
        )
        return children

    def _observe_call_error(self, record: InvocationRecord, webhook_type: str, op: str, code: int) -> None:
        """MET-04/05 and call errors by reason, for an invocation that was not plainly allowed."""
        outcome, name = record.outcome, record.name
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

    # --- CRD conversion (MET-10/11) -----------------------------------------------------------------

    def _init_conversion(self) -> None:
        self.conversion_requests = _counter(
            "conversion_webhook_request_total",
            "CRD conversion requests answered, per result (success, failure) and failure type.",
            ("result", "failure_type"),
        )  # fmt: skip
        self.conversion_duration = _histogram(
            "conversion_webhook_duration_seconds",
            "CRD conversion latency in seconds, per result and failure type.",
            ("result", "failure_type"), CONVERSION_DURATION_BUCKETS,
        )  # fmt: skip
        self.crd_conversion_duration = _histogram(
            "crd_conversion_webhook_duration_seconds",
            "CRD conversion latency in seconds, per CRD, from and to version and whether it succeeded "
            "(only conversions between different versions).",
            ("crd_name", "from_version", "to_version", "succeeded"), CRD_CONVERSION_BUCKETS,
        )  # fmt: skip
        self.crd_conversion_failures = _counter(
            "crd_conversion_webhook_failures_total",
            "Failed CRD conversions, per CRD and failure type.",
            ("crd_name", "failure_type"),
        )  # fmt: skip
        self.crd_conversion_timeouts = _counter(
            "crd_conversion_webhook_timeouts_total",
            "CRD conversions that failed because the conversion webhook did not answer in time, per CRD.",
            ("crd_name",),
        )  # fmt: skip
        self.conversion_cache_hits = _counter(
            "conversion_cache_hits_total",
            "Objects answered from the conversion cache, per CRD.",
            ("crd_name",),
        )
        self.conversion_cache_misses = _counter(
            "conversion_cache_misses_total",
            "Objects of cache-enabled CRDs sent to the conversion webhook, per CRD.",
            ("crd_name",),
        )  # fmt: skip
        self.conversion_cache_evictions = _counter(
            "conversion_cache_evictions_total",
            "Converted objects dropped from the conversion cache (expired, over the bounds, or "
            "invalidated by a change of the CRD's conversion), per CRD.",
            ("crd_name",),
        )  # fmt: skip
        self.conversion_cache_bytes = _gauge("conversion_cache_bytes", "Bytes held by the conversion cache.")
        self.conversion_cache_entries = _gauge(
            "conversion_cache_entries", "Converted objects held by the conversion cache."
        )
        self.families += (
            self.conversion_requests, self.conversion_duration, self.crd_conversion_duration,
            self.crd_conversion_failures, self.crd_conversion_timeouts, self.conversion_cache_hits,
            self.conversion_cache_misses, self.conversion_cache_evictions, self.conversion_cache_bytes,
            self.conversion_cache_entries,
        )  # fmt: skip
        self.conversion_requests.labels("success", "")
        self.conversion_cache_bytes.labels()
        self.conversion_cache_entries.labels()

    def conversion_finished(self, report: ConversionReport) -> None:
        """Record one conversion request (MET-10/11 and the cache)."""
        self.inbound_requests.labels("conversion", str(report.code)).value += 1
        crd = report.crd
        if report.cache_hits:
            self.conversion_cache_hits.labels(crd).value += report.cache_hits
        if report.cache_misses:
            self.conversion_cache_misses.labels(crd).value += report.cache_misses
        if report.cache_evictions:
            self.conversion_cache_evictions.labels(crd).value += report.cache_evictions
        self.conversion_cache_bytes.labels().value = report.cache_bytes
        self.conversion_cache_entries.labels().value = report.cache_entries
        if report.result not in ("success", "failure"):
            return  # 400/404: no conversion took place
        self.conversion_requests.labels(report.result, report.failure_type).value += 1
        self.conversion_duration.labels(report.result, report.failure_type).observe(report.seconds)
        if report.from_version and report.from_version != report.to_version:
            self.crd_conversion_duration.labels(
                crd, report.from_version, report.to_version, _bool(report.result == "success")
            ).observe(report.seconds)
        if report.result == "failure":
            self.crd_conversion_failures.labels(crd, report.failure_type).value += 1
            if report.timed_out:
                self.crd_conversion_timeouts.labels(crd).value += 1

    # --- backend protections and overload shedding (gateway.resilience) --------------------------

    def _init_resilience(self) -> None:
        self.circuit_state = _gauge(
            "backend_circuit_state",
            "Circuit breaker state per backend webhook name: 0 closed, 1 open, 2 half-open.",
            ("webhook",),
        )
        self.circuit_transitions = _counter(
            "backend_circuit_transitions_total",
            "Circuit breaker transitions per backend webhook name and the state entered "
            "(closed, open, half-open).",
            ("webhook", "state"),
        )
        self.calls_refused = _counter(
            "backend_calls_refused_total",
            "Backend calls not made, answered at once as call errors under the webhook's failurePolicy, "
            "per webhook name and reason (circuit_open, max_in_flight).",
            ("webhook", "reason"),
        )
        self.reviews_shed = _counter(
            "reviews_shed_total",
            "Reviews answered at once because the gateway was overloaded, as if every matched backend "
            "had a call error under its own failurePolicy, per reason (in_flight, event_loop_lag, cpu).",
            ("reason",),
        )
        self.shadow_decisions = _counter(
            "shadow_decisions_total",
            "Results of backend webhooks in Shadow mode, which never change the answer, per webhook name "
            "and outcome (allowed, denied, mutated, error).",
            ("webhook", "outcome"),
        )
        # --- backend trust (caFrom references, docs/configuration.md#backend-ca-bundles-cafrom) ----
        self.backend_ca_expiry = _gauge(
            "backend_ca_expiry_timestamp_seconds",
            "When each CA certificate a backend webhook is verified against expires (notAfter), in "
            "seconds since the Unix epoch, per webhook name, type (validating, admit, conversion), "
            "source (caBundle, or the caFrom reference it was read from) and certificate (its subject "
            "and the start of its SHA-256 fingerprint). Backends verified against the system roots are "
            "not listed.",
            ("name", "type", "source", "certificate"),
        )  # fmt: skip
        self.backend_ca_updates = _counter(
            "backend_ca_updates_total",
            "Values read from caFrom references (watched objects and files), per source and result: "
            "changed (the new bundle is in force), unchanged, refused (not usable: the last good bundle "
            "stays in force; the log says why).",
            ("source", "result"),
        )  # fmt: skip
        self.backend_certificate_expiry = _gauge(
            "backend_certificate_expiry_timestamp_seconds",
            "When the serving certificate a backend presented in the latest TLS handshake with it "
            "expires (notAfter), in seconds since the Unix epoch, per TLS server name.",
            ("server",),
        )  # fmt: skip
        self.families += (
            self.circuit_state, self.circuit_transitions, self.calls_refused, self.reviews_shed,
            self.shadow_decisions, self.backend_ca_expiry, self.backend_ca_updates,
            self.backend_certificate_expiry,
        )  # fmt: skip
        for reason in ("in_flight", "event_loop_lag", "cpu"):
            self.reviews_shed.labels(reason)
        self.circuit_source: CircuitSource | None = None

    def set_circuit_source(self, source: CircuitSource | None) -> None:
        """At every scrape, ``source()`` gives each circuit's state as the guards act on it now.

        Rows are ``(webhook, state value, shared)``; ``shared`` is false for a circuit that is this
        worker's own although the others share theirs (the shared table was full).
        """
        self.circuit_source = source

    def refresh_circuit_states(self) -> list[str]:
        """Set ``backend_circuit_state`` from the source (removed backends vanish); the webhook
        names whose circuit is not shared."""
        source = self.circuit_source
        if source is None:
            return []
        unshared: list[str] = []
        children = self.circuit_state.children
        children.clear()
        try:
            for webhook, state, shared in source():
                self.circuit_state.labels(webhook).value = state
                if not shared:
                    unshared.append(webhook)
        except Exception:  # noqa: BLE001 - a broken probe must not break the whole scrape
            children.clear()
        return unshared

    MAX_BACKEND_CERTIFICATE_SERVERS = 1024

    def backend_cas_trusted(self, expiries: Iterable[CaExpiry]) -> None:
        """The CA certificates backends are verified against now (replaces the previous set)."""
        self.backend_ca_expiry.children.clear()
        for e in expiries:
            labels = (e.webhook, _WEBHOOK_TYPE.get(e.kind, e.kind), e.source, e.certificate)
            self.backend_ca_expiry.labels(*labels).value = e.not_after

    def backend_ca_updated(self, source: str, result: str) -> None:
        self.backend_ca_updates.labels(source, result).value += 1

    def backend_certificate_seen(self, server: str, not_after: float) -> None:
        children = self.backend_certificate_expiry.children
        if (server,) not in children and len(children) >= self.MAX_BACKEND_CERTIFICATE_SERVERS:
            return  # bounded: the configuration names far fewer servers
        self.backend_certificate_expiry.labels(server).value = not_after

    def circuit_changed(self, webhook: str, state: int, label: str) -> None:
        """A circuit moved to ``state`` (its gauge value) named ``label`` (closed, open, half-open)."""
        self.circuit_state.labels(webhook).value = state
        self.circuit_transitions.labels(webhook, label).value += 1

    def call_refused(self, webhook: str, reason: str) -> None:
        """A backend call was not made (reason: circuit_open or max_in_flight)."""
        self.calls_refused.labels(webhook, reason).value += 1

    def review_shed(self, reason: str) -> None:
        """A review was answered at once because the gateway was overloaded."""
        self.reviews_shed.labels(reason).value += 1

    def shadow_decision(self, webhook: str, outcome: str) -> None:
        """A Shadow-mode backend's result (allowed, denied, mutated, error)."""
        self.shadow_decisions.labels(webhook, outcome).value += 1

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

    def backends_configured(self, timeouts: Iterable[tuple[str, str, float]]) -> None:
        """The configuration in force: ``(webhook name, kind, timeoutSeconds)`` per backend."""
        self.backend_timeout.children.clear()
        for name, kind, seconds in timeouts:
            self.backend_timeout.labels(name, _WEBHOOK_TYPE.get(kind, kind)).value = seconds

    def serving_certificate_loaded(self, not_after: float) -> None:
        """The serving certificate now in use expires at ``not_after`` (Unix seconds)."""
        self.serving_certificate_expiry.labels().value = not_after

    def set_connection_source(self, source: Callable[[], Mapping[Any, int]] | None) -> None:
        """At every scrape, ``source()`` gives the open connections per backend origin.

        Keys are origins (``transport.resolve.Origin`` or str); their ``str`` (``scheme://host:port``)
        is the label, so origins that differ only in TLS settings or credentials are summed.
        """
        self.connection_source = source

    # --- inbound connections ---------------------------------------------------------------------

    def inbound_connection_closed(self, reason: str) -> None:
        """The gateway closed an inbound connection because a limit was reached."""
        self.inbound_closed.labels(reason).value += 1

    def inbound_connection_rejected(self, reason: str) -> None:
        """An inbound connection was refused at accept."""
        self.inbound_rejected.labels(reason).value += 1

    def inbound_handshake_abandoned(self, where: str) -> None:
        """A dial's client closed it before its handshake was computed (``where`` it waited)."""
        self.handshakes_abandoned.labels(where).value += 1

    def inbound_handshake_failed(self, reason: str) -> None:
        """A TLS handshake the gateway began did not complete (``client_gone`` or ``refused``)."""
        self.handshakes_failed.labels(reason).value += 1

    def inbound_connection_unused(self) -> None:
        """An inbound connection's client closed it before sending any request."""
        self.connections_unused.labels().value += 1

    def inbound_accept_paused(self, seconds: float) -> None:
        """The listener accepted nothing for ``seconds``: handshakes waited for the event loop."""
        self.accept_paused.labels().value += seconds

    def h2_goaway(self, reason: str) -> None:
        self.h2_goaways.labels(reason).value += 1

    def certificate_reloaded(self, ok: bool) -> None:
        self.certificate_reloads.labels("success" if ok else "failure").value += 1

    def gc_collected(self, reason: str, seconds: float) -> None:
        """A full garbage collection for ``reason`` stopped the event loop for ``seconds``."""
        self.gc_full_collections.labels(reason).value += 1
        self.gc_full_collection_seconds.labels(reason).value += seconds

    def set_inbound_source(self, source: Callable[[], int] | None) -> None:
        """At every scrape, ``source()`` gives the open inbound connections."""
        self.inbound_source = source

    def inbound_metric(self) -> Metric:
        metric = Metric(
            PREFIX + "inbound_open_connections",
            "Open inbound connections of the review listener.",
            "gauge",
        )
        if self.inbound_source is not None:
            metric.samples.append(Sample(metric.name, {}, float(self.inbound_source())))
        return metric

    # --- exposition ------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition (format 0.0.4, as Go clients serve it) and its content type."""
        self.refresh_circuit_states()
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
        yield self._metrics.inbound_metric()
