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


def counter_total(metrics: str, name: str) -> float:
    """The value of counter ``name`` (without its ``_total`` suffix) in a Prometheus text
    exposition, summed over its label sets; 0 when it is not exposed."""
    wanted = f"{name}_total"
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == wanted
    )


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
    that reflect an injected backend failure (``--error-rate``). ``late`` counts reviews abandoned
    at their deadline (the caller's ``?timeout=``, from the scheduled arrival): no answer, and not a
    wrong one. ``due``/``outcome`` keep every review's scheduled time (seconds from ``started``) and
    latency (NaN: late or wrong) for per-second windows.
    """

    latencies: dict[str, array[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    injected: int = 0
    late: int = 0
    started: float = 0.0
    finished: float = 0.0
    due: array[float] = field(default_factory=lambda: array("d"))
    outcome: array[float] = field(default_factory=lambda: array("d"))

    def ok(self, latency_seconds: float, cls: str = "all", intended: float | None = None) -> None:
        arr = self.latencies.get(cls)
        if arr is None:
            arr = self.latencies[cls] = array("d")
        arr.append(latency_seconds)
        if intended is not None:
            self.due.append(intended - self.started)
            self.outcome.append(latency_seconds)

    def error(self, kind: str, intended: float | None = None) -> None:
        self.errors[kind] += 1
        if intended is not None:
            self.due.append(intended - self.started)
            self.outcome.append(math.nan)

    def abandoned(self, intended: float) -> None:
        self.late += 1
        self.due.append(intended - self.started)
        self.outcome.append(math.nan)

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


def windows(
    due: Sequence[float], outcome: Sequence[float], seconds: float, dials: Sequence[float] = ()
) -> list[dict[str, float]]:
    """One row per second of a phase, by scheduled time: reviews due, answered correctly in time,
    not answered (late or wrong), p99 of the answered (ms), and new connections opened (by the time
    their handshake completed)."""
    count = max(math.ceil(seconds), 1)
    answered: list[list[float]] = [[] for _ in range(count)]
    missing = [0] * count
    opened = [0] * count
    for d, lat in zip(due, outcome, strict=True):
        k = min(max(int(d), 0), count - 1)
        if math.isnan(lat):
            missing[k] += 1
        else:
            answered[k].append(lat)
    for t in dials:
        if 0 <= t < count:
            opened[int(t)] += 1
    rows = []
    for k in range(count):
        lats = sorted(answered[k])
        rows.append(
            {
                "second": float(k),
                "due": float(len(lats) + missing[k]),
                "answered": float(len(lats)),
                "missing": float(missing[k]),
                "p99_ms": percentile(lats, 99) * 1000 if lats else math.nan,
                "new_connections": float(opened[k]),
            }
        )
    return rows


def normal_p99_ms(before_ms: float) -> float:
    """The p99 (ms) a one-second window may have and still count as normal after a burst: twice the
    p99 before it, and at least 5 ms above it (one second of a few hundred reviews is noisy)."""
    return max(2 * before_ms, before_ms + 5.0) if not math.isnan(before_ms) else math.inf


def recovery_seconds(rows: Sequence[dict[str, float]], since: float, normal_ms: float) -> float | None:
    """Seconds from ``since`` to the start of the first window from which every window is normal
    (p99 at or under ``normal_ms``, nothing missing); None when the last one is not."""
    recovered: float | None = None
    for r in rows:
        if r["second"] < since:
            continue
        normal = r["missing"] == 0 and (math.isnan(r["p99_ms"]) or r["p99_ms"] <= normal_ms)
        if not normal:
            recovered = None
        elif recovered is None:
            recovered = r["second"] - since
    return recovered


@dataclass(frozen=True)
class SegmentSummary:
    """One segment of a scheduled phase (``--burst``: before, burst, after)."""

    name: str
    start_s: float
    seconds: float
    offered_rps: float
    answered_rps: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    missing: int  # late (abandoned at the deadline) or wrong
    new_connections_per_s: float


def summarize_segment(
    name: str, start: float, seconds: float, rec: Recorder, dials: Sequence[float] = ()
) -> SegmentSummary:
    lats: list[float] = []
    due = missing = 0
    for d, lat in zip(rec.due, rec.outcome, strict=True):
        if start <= d < start + seconds:
            due += 1
            if math.isnan(lat):
                missing += 1
            else:
                lats.append(lat)
    lats.sort()
    opened = sum(1 for t in dials if start <= t < start + seconds)
    return SegmentSummary(
        name,
        start,
        seconds,
        due / seconds,
        len(lats) / seconds,
        percentile(lats, 50) * 1000,
        percentile(lats, 99) * 1000,
        lats[-1] * 1000 if lats else math.nan,
        missing,
        opened / seconds,
    )


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
    late: int = 0  # abandoned at the deadline (no answer)
    # The generator's connections (loadtests.transport.ConnectionStats, plus new_per_s and per_review).
    connections: dict[str, float] | None = None
    generator_cpu_pct: float | None = None  # the generator's CPU during the phase, % of one core
    generator_lag_p99_ms: float | None = None  # how late the generator's own timers fired
    generator_lag_max_ms: float | None = None
    # Runnable but waiting for a CPU (schedstat), % of the phase: the server process, the generator.
    cpu_wait_pct: float | None = None
    generator_cpu_wait_pct: float | None = None
    generator_gc_max_ms: float | None = None  # the generator's own longest garbage collection
    generator_gc_pct: float | None = None  # ... and the share of the phase it spent collecting
    generator_gc_max_cpu_ms: float | None = None  # the CPU of the collection that took most CPU
    # --burst: the schedule's segments, seconds from the burst's end until every window is normal.
    segments: list[SegmentSummary] | None = None
    recovery_s: float | None = None
    normal_p99_ms: float | None = None
    windows: list[dict[str, float]] | None = None
    gc: dict[str, Any] | None = None  # --gc-stats: the gateway's collections during the phase

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(name: str, rec: Recorder, offered_rps: float | None = None, **extra: Any) -> PhaseResult:
    """Turn a Recorder into a PhaseResult (throughput counts correct answers only)."""
    elapsed = max(rec.finished - rec.started, 1e-9)
    extra.setdefault("late", rec.late)
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
        late=sum(r.late for r in results),
        connections=_med_dicts([r.connections for r in results], med),
        generator_cpu_pct=med(r.generator_cpu_pct for r in results),
        generator_lag_p99_ms=med(r.generator_lag_p99_ms for r in results),
        generator_lag_max_ms=med(r.generator_lag_max_ms for r in results),
        cpu_wait_pct=med(r.cpu_wait_pct for r in results),
        generator_cpu_wait_pct=med(r.generator_cpu_wait_pct for r in results),
        generator_gc_max_ms=med(r.generator_gc_max_ms for r in results),
        generator_gc_pct=med(r.generator_gc_pct for r in results),
        generator_gc_max_cpu_ms=med(r.generator_gc_max_cpu_ms for r in results),
        segments=_med_segments([r.segments for r in results], med),
        recovery_s=_med_recovery([r.recovery_s for r in results if r.segments]),
        normal_p99_ms=med(r.normal_p99_ms for r in results),
        windows=None,  # per run only
        gc=_med_gc([r.gc for r in results], med),
    )


def _med_dicts(dicts: Sequence[dict[str, float] | None], med: Any) -> dict[str, float] | None:
    seen = [d for d in dicts if d is not None]
    if not seen:
        return None
    return {k: med(d.get(k) for d in seen) for k in seen[0]}


def _med_gc(views: Sequence[dict[str, Any] | None], med: Any) -> dict[str, Any] | None:
    seen = [v for v in views if v is not None]
    if not seen:
        return None
    out: dict[str, Any] = {}
    for gen in seen[0]:
        out[gen] = {k: med(v.get(gen, {}).get(k) for v in seen) for k in seen[0][gen]}
    return out


def _med_segments(runs: Sequence[list[SegmentSummary] | None], med: Any) -> list[SegmentSummary] | None:
    seen = [r for r in runs if r]
    if not seen:
        return None
    out = []
    for i, first in enumerate(seen[0]):
        same = [r[i] for r in seen if len(r) > i]
        values = {
            f: med(getattr(s, f) for s in same)
            for f in ("offered_rps", "answered_rps", "p50_ms", "p99_ms", "max_ms", "new_connections_per_s")
        }
        missing = int(statistics.median(s.missing for s in same))
        out.append(
            SegmentSummary(
                first.name,
                first.start_s,
                first.seconds,
                missing=missing,
                **{k: (math.nan if v is None else v) for k, v in values.items()},
            )
        )
    return out


def _med_recovery(values: Sequence[float | None]) -> float | None:
    """The median recovery; a run that never recovered counts as infinitely long."""
    if not values:
        return None
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else m
