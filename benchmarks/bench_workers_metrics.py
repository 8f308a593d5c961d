"""Metrics with several worker processes: per-review cost of the candidates, and the scrape-time cost.

Run: python -m pytest benchmarks/bench_workers_metrics.py --benchmark-only --benchmark-columns=min,rounds

Per review (a validating review fanned out to 5 backends, as ``Metrics.review_finished`` records it:
in-flight gauge up and down, the inbound counter, three histograms per review, two histograms and a
counter per backend call, children already resolved, as the hot path caches them):

- ``hand-written``: the gateway's ``Metrics`` (plain attributes); with ``--workers`` each worker
  keeps these and publishes a snapshot every 0.5 s, merged at scrape time.
- ``prometheus_client multiprocess``: the same operations on prometheus_client's Counter, Gauge
  and Histogram with ``PROMETHEUS_MULTIPROC_DIR`` set, so every value lives in an mmap file.
- ``prometheus_client single process``: the same, in-memory values (reference).

Per scrape / per snapshot (not per review): capturing and encoding one worker's snapshot, and
merging and rendering 8 workers' snapshots.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values

from gateway.dispatch.report import DispatchReport, InvocationRecord
from gateway.observability.metrics import (
    FINE_DURATION_BUCKETS,
    OVERHEAD_BUCKETS,
    STEP_DURATION_BUCKETS,
    WEBHOOK_DURATION_BUCKETS,
    Metrics,
)
from gateway.server.workers import MetricsSnapshot, _encoder, _snapshot_decoder, capture, merge

BACKENDS = 5


def report() -> DispatchReport:
    rep = DispatchReport(kind="validating", operation="CREATE", matched=BACKENDS)
    for i in range(BACKENDS):
        rep.invocations.append(
            InvocationRecord(
                name=f"check-{i}.policy.example.com",
                configuration="policies",
                round=0,
                index=i,
                outcome="allowed",
                code=200,
                duration_seconds=0.0012 + i * 0.0003,
                version="v1",
            )
        )
    return rep


def hand_written() -> Callable[[], None]:
    metrics = Metrics()
    rep = report()

    def one_review() -> None:
        metrics.review_started("validating")
        metrics.review_finished(
            "validating", code=200, seconds=0.003, operation="CREATE", allowed=True, report=rep
        )

    return one_review


def prometheus_client_families() -> Callable[[], None]:
    """The same per-review operations on prometheus_client's own metric classes."""
    registry = CollectorRegistry()
    in_flight = Gauge("in_flight", "x", ["endpoint"], registry=registry, multiprocess_mode="livesum")
    inbound = Counter("inbound", "x", ["endpoint", "code"], registry=registry)
    review = Histogram(
        "review", "x", ["endpoint", "decision"], registry=registry, buckets=FINE_DURATION_BUCKETS
    )
    step = Histogram(
        "step", "x", ["type", "operation", "rejected"], registry=registry, buckets=STEP_DURATION_BUCKETS
    )
    overhead = Histogram("overhead", "x", ["endpoint"], registry=registry, buckets=OVERHEAD_BUCKETS)
    webhook = Histogram(
        "webhook",
        "x",
        ["name", "type", "operation", "rejected"],
        registry=registry,
        buckets=WEBHOOK_DURATION_BUCKETS,
    )
    requests = Counter("requests", "x", ["name", "type", "operation", "code", "rejected"], registry=registry)
    call = Histogram("call", "x", ["name", "type"], registry=registry, buckets=FINE_DURATION_BUCKETS)
    flight = in_flight.labels("validating")
    review_children = (inbound.labels("validating", "200"), review.labels("validating", "allowed"))
    step_child = step.labels("validate", "CREATE", "false")
    overhead_child = overhead.labels("validating")
    calls = [
        (
            webhook.labels(f"check-{i}.policy.example.com", "validating", "CREATE", "false"),
            requests.labels(f"check-{i}.policy.example.com", "validating", "CREATE", "200", "false"),
            call.labels(f"check-{i}.policy.example.com", "validating"),
            0.0012 + i * 0.0003,
        )
        for i in range(BACKENDS)
    ]

    def one_review() -> None:
        flight.inc()
        flight.dec()
        review_children[0].inc()
        review_children[1].observe(0.003)
        step_child.observe(0.003)
        overhead_child.observe(0.0006)
        for duration, counter, fine, seconds in calls:
            duration.observe(seconds)
            counter.inc()
            fine.observe(seconds)

    return one_review


@pytest.fixture
def multiprocess_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prometheus_client's multiprocess mode, as PROMETHEUS_MULTIPROC_DIR at start-up selects it."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())


def test_per_review_hand_written(benchmark) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = "per review, 5 backends"
    benchmark(hand_written())


def test_per_review_prometheus_client_multiprocess(benchmark, multiprocess_values) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = "per review, 5 backends"
    benchmark(prometheus_client_families())


def test_per_review_prometheus_client_single_process(benchmark) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = "per review, 5 backends"
    benchmark(prometheus_client_families())


def _busy_worker() -> Metrics:
    """A worker's metrics after a mix of reviews: 5 backends, both endpoints, a few error codes."""
    metrics = Metrics()
    rep = report()
    for endpoint in ("validating", "mutating"):
        for code in (200, 400, 499):
            metrics.review_started(endpoint)
            metrics.review_finished(
                endpoint,
                code=code,
                seconds=0.003,
                operation="CREATE",
                allowed=True if code == 200 else None,
                report=rep,
            )
    metrics.config_reloaded(True, 1, {"validating": 5, "mutating": 0})
    return metrics


def test_snapshot_one_worker(benchmark) -> None:  # type: ignore[no-untyped-def]
    """Every 0.5 s (when something changed): capture and encode one worker's metrics."""
    benchmark.group = "per snapshot / scrape"
    metrics = _busy_worker()
    benchmark(lambda: _encoder.encode(capture(metrics)))


def test_scrape_merging_8_workers(benchmark) -> None:  # type: ignore[no-untyped-def]
    """Per /metrics request: decode 7 snapshots, merge 8, render the text exposition."""
    benchmark.group = "per snapshot / scrape"
    data = _encoder.encode(capture(_busy_worker()))

    def scrape() -> bytes:
        snapshots: list[MetricsSnapshot] = [_snapshot_decoder.decode(data) for _ in range(8)]
        combined = Metrics()
        merge(combined, snapshots)
        return combined.render()[0]

    benchmark(scrape)


def test_scrape_one_process(benchmark) -> None:  # type: ignore[no-untyped-def]
    """Reference, per /metrics request with --workers 1: render one process's metrics."""
    benchmark.group = "per snapshot / scrape"
    metrics = _busy_worker()
    benchmark(lambda: metrics.render()[0])


def test_scrape_merging_2_workers(benchmark) -> None:  # type: ignore[no-untyped-def]
    """Per /metrics request with --workers 2."""
    benchmark.group = "per snapshot / scrape"
    data = _encoder.encode(capture(_busy_worker()))

    def scrape() -> bytes:
        combined = Metrics()
        merge(combined, [_snapshot_decoder.decode(data) for _ in range(2)])
        return combined.render()[0]

    benchmark(scrape)
