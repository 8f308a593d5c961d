"""Latency and outcome accounting: recording per request, percentiles, summaries, medians of runs.

Pure and synchronous; the generator records into a ``Recorder`` and the report reads summaries.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100); NaN when empty."""
    if not sorted_values:
        return math.nan
    if q <= 0:
        return sorted_values[0]
    return sorted_values[min(_rank(q, len(sorted_values)), len(sorted_values)) - 1]


def _rank(q: float, count: float) -> int:
    """The nearest rank of percentile ``q`` (0..100) among ``count`` values (1-based)."""
    # Rounding first: 99.9 / 100 * 1000 is 999.0000000000001 in floating point.
    return math.ceil(round(q * count / 100.0, 9))


@dataclass(frozen=True)
class LatencySummary:
    """Latency percentiles in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: Iterable[float]) -> LatencySummary:
        values = sorted(seconds)
        if not values:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan)
        p50, p90, p99, p999 = (percentile(values, q) * 1000 for q in PERCENTILES)
        return cls(len(values), statistics.fmean(values) * 1000, p50, p90, p99, p999, values[-1] * 1000)


@dataclass(frozen=True)
class BucketPercentiles:
    """Percentiles of what a Prometheus histogram observed between two scrapes.

    Each is the upper bound, in ms, of the bucket that holds it (a histogram knows no more):
    ``p99_ms = 5.0`` reads "99 % took at most 5 ms". ``inf`` beyond the last finite bound.
    """

    count: int
    p50_ms: float
    p99_ms: float
    p999_ms: float


def histogram_buckets(metrics: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts (upper bound in seconds -> count) of histogram ``name`` in a Prometheus
    text exposition, summed over its label sets."""
    out: dict[float, float] = {}
    wanted = f"{name}_bucket"
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == wanted:
                bound = float(sample.labels["le"])  # "+Inf" parses to inf
                out[bound] = out.get(bound, 0.0) + sample.value
    return out


def bucket_percentiles(before: dict[float, float], after: dict[float, float]) -> BucketPercentiles | None:
    """The percentiles of the observations made between the scrapes ``before`` and ``after`` of one
    histogram; None when nothing was observed (or the histogram is not exposed)."""
    bounds = sorted(after)
    if not bounds:
        return None
    cumulative = [after[b] - before.get(b, 0.0) for b in bounds]
    total = cumulative[-1]
    if total <= 0:
        return None

    def bound_of(q: float) -> float:
        rank = _rank(q, total)
        for bound, count in zip(bounds, cumulative, strict=True):
            if count >= rank:
                return bound * 1000
        return math.inf

    return BucketPercentiles(int(total), bound_of(50.0), bound_of(99.0), bound_of(99.9))


@dataclass
class Recorder:
    """Outcomes of one measured phase: latencies of correct answers by class, and errors by kind.

    A wrong answer is an error and never counts as throughput. ``injected`` counts correct answers
    that reflect an injected backend failure (``--error-rate``).
    """

    latencies: dict[str, array[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    injected: int = 0
    started: float = 0.0
    finished: float = 0.0

    def ok(self, latency_seconds: float, cls: str = "all") -> None:
        arr = self.latencies.get(cls)
        if arr is None:
            arr = self.latencies[cls] = array("d")
        arr.append(latency_seconds)

    def error(self, kind: str) -> None:
        self.errors[kind] += 1

    @property
    def ok_count(self) -> int:
        return sum(len(a) for a in self.latencies.values())

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def all_latencies(self) -> list[float]:
        out: list[float] = []
        for arr in self.latencies.values():
            out.extend(arr)
        return out


@dataclass(frozen=True)
class PhaseResult:
    """What one measured phase (gateway or direct) produced, ready for the report."""

    name: str
    elapsed_s: float
    ok: int
    errors: dict[str, int]
    injected: int
    throughput_rps: float
    latency: LatencySummary
    by_class: dict[str, LatencySummary]
    offered_rps: float | None = None
    cpu_s: float | None = None  # CPU of the measured server process (gateway, or backends when direct)
    cpu_us_per_review: float | None = None
    peak_rss_mb: float | None = None
    backend_cpu_us_per_review: float | None = None
    generator_cpu_us_per_review: float | None = None
    # The gateway's own view of the phase (its /metrics): whole reviews, and its own work in them.
    gateway_review: BucketPercentiles | None = None
    gateway_work: BucketPercentiles | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(name: str, rec: Recorder, offered_rps: float | None = None, **extra: Any) -> PhaseResult:
    """Turn a Recorder into a PhaseResult (throughput counts correct answers only)."""
    elapsed = max(rec.finished - rec.started, 1e-9)
    ok = rec.ok_count
    by_class = {k: LatencySummary.of(v) for k, v in rec.latencies.items()} if len(rec.latencies) > 1 else {}
    return PhaseResult(
        name=name,
        elapsed_s=elapsed,
        ok=ok,
        errors=dict(rec.errors),
        injected=rec.injected,
        throughput_rps=ok / elapsed,
        latency=LatencySummary.of(rec.all_latencies()),
        by_class=by_class,
        offered_rps=offered_rps,
        **extra,
    )


def median_result(results: Sequence[PhaseResult]) -> PhaseResult:
    """Element-wise median of repeated runs of the same phase (errors summed, for honesty)."""
    if len(results) == 1:
        return results[0]

    def med(values: Iterable[float | None]) -> float | None:
        vals = [v for v in values if v is not None and not math.isnan(v)]
        return statistics.median(vals) if vals else None

    def med_summary(summaries: Sequence[LatencySummary]) -> LatencySummary:
        return LatencySummary(
            count=int(statistics.median(s.count for s in summaries)),
            **{
                f: med(getattr(s, f) for s in summaries) or math.nan
                for f in ("mean_ms", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")
            },
        )

    def med_buckets(views: Iterable[BucketPercentiles | None]) -> BucketPercentiles | None:
        seen = [v for v in views if v is not None]
        if not seen:
            return None
        return BucketPercentiles(
            int(statistics.median(v.count for v in seen)),
            # median_high: an even number of runs still gives a bucket's bound, the higher one
            *(statistics.median_high(getattr(v, f) for v in seen) for f in ("p50_ms", "p99_ms", "p999_ms")),
        )

    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r.errors)
    classes = set().union(*(r.by_class for r in results))
    return PhaseResult(
        name=results[0].name,
        elapsed_s=med(r.elapsed_s for r in results) or 0.0,
        ok=int(statistics.median(r.ok for r in results)),
        errors=dict(errors),
        injected=sum(r.injected for r in results),
        throughput_rps=med(r.throughput_rps for r in results) or 0.0,
        latency=med_summary([r.latency for r in results]),
        by_class={
            c: med_summary([r.by_class[c] for r in results if c in r.by_class]) for c in sorted(classes)
        },
        offered_rps=med(r.offered_rps for r in results),
        cpu_s=med(r.cpu_s for r in results),
        cpu_us_per_review=med(r.cpu_us_per_review for r in results),
        peak_rss_mb=max((r.peak_rss_mb for r in results if r.peak_rss_mb is not None), default=None),
        backend_cpu_us_per_review=med(r.backend_cpu_us_per_review for r in results),
        generator_cpu_us_per_review=med(r.generator_cpu_us_per_review for r in results),
        gateway_review=med_buckets(r.gateway_review for r in results),
        gateway_work=med_buckets(r.gateway_work for r in results),
    )
