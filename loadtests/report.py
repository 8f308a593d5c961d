"""The report: a terminal table, a JSON document for machines, and a PNG plot (latency percentiles
vs load, and a latency histogram)."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec

from loadtests.runner import CAPACITY_CLIENTS, Options, RunResult
from loadtests.soak import describe_rss, summarize_rss
from loadtests.stats import BucketPercentiles, LatencySummary, PhaseResult, median_result


def _f(value: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def medians(result: RunResult) -> list[dict[str, PhaseResult]]:
    """Per load point, the median of the repeated runs of each phase."""
    return [{name: median_result(runs) for name, runs in point.items() if runs} for point in result.points]


def _in_flight(o: Options) -> str:
    if o.protocol == "h2" or o.connection_policy == "fixed":
        return f"{o.concurrency} workers (arrivals wait for a free one; latency counts from the schedule)"
    return "every arrival sent at its time, however many are in flight"


def _connections(result: RunResult) -> str:
    """How the generator connects: the apiserver's policy, or which other one."""
    o = result.options
    text = _policy(o)
    if o.tls and not o.target:
        text += f"; certificate: {'RSA 2048' if o.key_type == 'rsa' else 'ECDSA P-256'}"
    return text


def _policy(o: Options) -> str:
    deadline = f"a review is abandoned {o.timeout:g} s (its ?timeout=) after its scheduled arrival"
    if o.protocol == "h2":
        return f"connections: one HTTP/2 connection, streams reset when abandoned; {deadline}"
    if o.connection_policy == "fixed":
        return (
            f"connections: FIXED, one per worker opened before the measurement (not the apiserver's "
            f"policy: it never dials under a stall); {deadline} and that connection replaced"
        )
    if o.connection_policy == "per-review":
        return (
            "connections: a NEW one per review (connect, full TLS handshake, one review, close): "
            "CPU µs/rev is the cost of a new connection (the gateway with --handshake-rate 0: "
            f"admitted as fast as they come); {deadline}"
        )
    return (
        f"connections: client-go's policy (keep-alive, at most {o.max_idle} idle per host, a new one "
        f"dialled whenever none is idle, full TLS handshakes); {deadline} and its connection closed"
    )


def describe(result: RunResult) -> str:
    """One paragraph saying what was measured and how."""
    o = result.options
    proto = "HTTP/2" if o.protocol == "h2" else "HTTP/1.1 keep-alive"
    tls = o.target.lower().startswith("https://") if o.target else o.tls  # what --target really speaks
    proto += " over TLS" if tls else " (plaintext)"
    arrivals = " Poisson" if o.poisson else ""
    if o.capacity_shares:
        shares = ", ".join(f"{100 * s:g}%" for s in o.capacity_shares)
        probed = "; ".join(", ".join(f"{c:,.0f}" for c in point) for point in result.capacities)
        shape = (
            f"open loop at {shares} of capacity{arrivals}, {_in_flight(o)} (capacity: "
            f"reviews/s in a closed loop of {CAPACITY_CLIENTS} clients right before each repeat: {probed})"
        )
    elif o.rates:
        rates = ", ".join(f"{r:g}" for r in o.rates)
        shape = f"open loop {rates}/s{arrivals}, {_in_flight(o)}"
    else:
        shape = f"closed loop, {o.concurrency} clients"
    if o.burst_peak is not None and (o.rates or o.capacity_shares):
        peak = f"{100 * o.burst_peak:g}% of capacity" if o.capacity_shares else f"{o.burst_peak:g}/s"
        shape += f"; then a burst of {peak} for {o.burst_seconds:g} s, then {o.burst_after:g} s at the rate"
    bound = f"{o.duration:g} s" + (f" or {o.requests:,} reviews" if o.requests else "")
    size = f"~{o.size_kb:g} KB Pod reviews ({o.review_version})"
    what = (
        f"target {o.target}: its own configuration (answers checked for protocol only)"
        if o.target
        else f"scenario {result.scenario.name}: {result.scenario.description}"
    )
    cpus, usable = os.cpu_count(), len(os.sched_getaffinity(0))
    backend = "Go backend (loadtests/gobackend)" if o.backend == "go" else "backend fleet"
    where = (
        f"the generator ran on this machine ({cpus} CPUs, {usable} usable), the gateway at the target"
        if o.target
        else f"generator, {backend} and gateway all ran on this machine ({cpus} CPUs, {usable} usable)"
    )
    if o.pin:
        where += "\n" + _pinned(result.placement)
    if o.gateway_cpu is not None and not o.target:
        share = f"{o.gateway_cpu:g}"
        where += f"\nthe measured server (gateway, baseline, nginx) each on {share} of a CPU (a CFS quota)"
    text = (
        f"{what}\n{proto}; {shape}; {bound}; {size}; medians of {o.repeat} run(s)\n"
        f"{_connections(result)}\n{where}"
    )
    if o.baseline_tree:
        revision = result.baseline_revision or "?"
        text += f"\nbaseline: the gateway of {o.baseline_tree} ({revision}), run beside it"
    return text


def _pinned(placement: dict[str, list[int]]) -> str:
    """``--pin``: which processes were allowed which CPUs, as read from them during the phases."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for role, cpus in placement.items():
        groups.setdefault(tuple(cpus), []).append(role)
    where = "; ".join(
        f"{', '.join(roles)} on CPU {','.join(map(str, cpus))}" for cpus, roles in sorted(groups.items())
    )
    return f"pinned (--pin; the CPUs each process's threads were allowed in the measured phases): {where}"


_COLUMNS = (
    ("phase", 10),
    ("offered/s", 10),
    ("reviews/s", 11),
    ("p50 ms", 9),
    ("p90 ms", 9),
    ("p99 ms", 9),
    ("p99.9 ms", 10),
    ("max ms", 9),
    ("errors", 8),
    ("late", 7),
    ("new conn/s", 11),
    ("CPU µs/rev", 12),
    ("RSS MB", 8),
    ("backend µs", 12),
)


def _row(cells: Sequence[str]) -> str:
    out = []
    for k, (cell, (_, width)) in enumerate(zip(cells, _COLUMNS, strict=False)):
        out.append(f"{cell:<{width}}" if k == 0 else f"{cell:>{width}}")
    return "".join(out)


def _latency_cells(s: LatencySummary) -> list[str]:
    return [_f(v, "{:.2f}") for v in (s.p50_ms, s.p90_ms, s.p99_ms, s.p999_ms)] + [_f(s.max_ms, "{:.1f}")]


def _bound(ms: float) -> str:
    return "above every bucket" if math.isinf(ms) else f"≤ {ms:g} ms"


def _own_view(review: BucketPercentiles, work: BucketPercentiles | None) -> str:
    """The gateway phase as the gateway's own /metrics saw it (bucket bounds, ms)."""

    def three(p: BucketPercentiles) -> str:
        return f"p50 {_bound(p.p50_ms)}, p99 {_bound(p.p99_ms)}, p99.9 {_bound(p.p999_ms)}"

    text = f"  gateway's own /metrics: reviews {three(review)}"
    if work is not None:
        text += f"; its own work in them {three(work)}"
    return text


def table(result: RunResult) -> str:
    """The terminal table: one row per phase and load point, then ratios and errors."""
    o = result.options
    head = _row([name for name, _ in _COLUMNS])
    lines = [describe(result), "", head, "-" * len(head)]
    for point in medians(result):
        for name, r in point.items():
            lines.append(
                _row(
                    [
                        name,
                        _f(r.offered_rps, "{:,.0f}"),
                        _f(r.throughput_rps, "{:,.0f}"),
                        *_latency_cells(r.latency),
                        f"{sum(r.errors.values()):,}",
                        f"{r.late:,}",
                        _f(r.connections.get("new_per_s") if r.connections else None, "{:,.1f}"),
                        _f(r.cpu_us_per_review, "{:,.0f}"),
                        _f(r.peak_rss_mb, "{:.0f}"),
                        _f(r.backend_cpu_us_per_review, "{:,.0f}"),
                    ]
                )
            )
            for cls, s in r.by_class.items():
                lines.append(_row([f"  {cls}", "", f"n={s.count:,}", *_latency_cells(s)]))
            if r.gateway_review is not None:
                lines.append(_own_view(r.gateway_review, r.gateway_work))
            lines.extend(_phase_details(r, None if o.target or name == "direct" else o.gateway_cpu))
        if "direct" in point and "nginx" in point:
            lines.append(_ratio_row("nginx ratio", point["nginx"], point["direct"]))
        if "direct" in point and "gateway" in point:
            d, g = point["direct"], point["gateway"]
            ratio = g.throughput_rps / d.throughput_rps if d.throughput_rps else math.nan
            added = [
                _f(getattr(g.latency, f) - getattr(d.latency, f), "{:+.2f}")
                for f in ("p50_ms", "p90_ms", "p99_ms", "p999_ms")
            ]
            lines.append(_row(["ratio", "", _f(ratio, "{:.2f}x"), *added]))
            if "nginx" in point:
                lines.append(_versus_nginx(g, point["nginx"]))
            calls = len(result.scenario.endpoints)
            lines.append(
                "  (ratio: gateway reviews/s ÷ direct; latency columns: added ms, gateway − direct"
                + (
                    f"; per review both phases make {calls} requests: /mutate and /validate at the "
                    f"gateway, {calls} backend calls direct)"
                    if calls > 1
                    else ")"
                )
            )
        if "gateway" in point and "baseline" in point:
            lines.extend(_versus_baseline(point["gateway"], point["baseline"], result.baseline_revision))
    errors: dict[str, int] = {}
    for raw_point in result.points:
        for runs in raw_point.values():
            for r in runs:
                for kind, n in r.errors.items():
                    errors[f"{r.name}:{kind}"] = errors.get(f"{r.name}:{kind}", 0) + n
    lines.append("")
    lines.append("errors by kind: " + (", ".join(f"{k}={v:,}" for k, v in sorted(errors.items())) or "none"))
    injected = sum(r.injected for point in result.points for runs in point.values() for r in runs)
    if injected:
        lines.append(f"answers reflecting injected backend errors (counted correct): {injected:,}")
    if result.reloads is not None:
        rl = result.reloads
        lines.append(
            f"configuration reloads in gateway phases: {rl.requested:,} requested, {rl.applied:,} applied,"
            f" {rl.refused:,} refused, {rl.not_seen:,} not seen (refused and not seen count as errors)"
        )
    if result.rss is not None:
        lines += describe_rss(result.rss)
    lines.append(
        "CPU µs/rev: the measured server process (gateway; in the direct row, the backends' process);"
        " backend µs: the backends' process (the fleet, or the Go backend), per review"
    )
    if any(r.gateway_review is not None for point in medians(result) for r in point.values()):
        lines.append(
            "gateway's own /metrics: the measured phase in its review_duration and review_overhead"
            " histograms (the bound of the bucket holding each percentile); its clock starts when it"
            " has read a request's head and stops when the answer is written, and its own work is that"
            " minus the time spent waiting for backends (a reply waiting for the busy gateway to read it"
            " counts as waiting). What the generator sees beyond that was spent outside the review:"
            " waiting to be read, in the kernel, in the generator."
        )
    return "\n".join(lines)


def _ratio_row(label: str, g: PhaseResult, d: PhaseResult) -> str:
    ratio = g.throughput_rps / d.throughput_rps if d.throughput_rps else math.nan
    added = [
        _f(getattr(g.latency, f) - getattr(d.latency, f), "{:+.2f}")
        for f in ("p50_ms", "p90_ms", "p99_ms", "p999_ms")
    ]
    return _row([label, "", _f(ratio, "{:.2f}x"), *added])


def _versus_nginx(g: PhaseResult, n: PhaseResult) -> str:
    """The gateway against nginx's proxy hop to the same backend, same load and client."""
    cpu = (
        g.cpu_us_per_review / n.cpu_us_per_review
        if g.cpu_us_per_review is not None and n.cpu_us_per_review
        else math.nan
    )
    rps = g.throughput_rps / n.throughput_rps if n.throughput_rps else math.nan
    more = [
        _f(getattr(g.latency, f) - getattr(n.latency, f), "{:+.2f}")
        for f in ("p50_ms", "p90_ms", "p99_ms", "p999_ms")
    ]
    return _row(["÷ nginx", "", _f(rps, "{:.2f}x"), *more, "", "", "", "", _f(cpu, "{:.2f}x")]) + (
        "\n  (÷ nginx: gateway reviews/s and CPU µs/rev as ratios to nginx's; latency as ms gateway − nginx)"
    )


def _phase_details(r: PhaseResult, allowance: float | None) -> list[str]:
    """Under a phase's row: its schedule's segments, the generator's connections and its own load,
    the measured server's CPU (as a share of ``allowance``, its CFS quota in CPUs, when it has one),
    the gateway's garbage collections."""
    lines = []
    for seg in r.segments or []:
        lines.append(
            f"  {seg.name:<7} {seg.start_s:>5.1f}-{seg.start_s + seg.seconds:<5.1f}s offered "
            f"{seg.offered_rps:,.0f}/s, answered {seg.answered_rps:,.0f}/s, "
            f"p50 {_f(seg.p50_ms, '{:.2f}')} ms, p99 {_f(seg.p99_ms, '{:.2f}')} ms, "
            f"max {_f(seg.max_ms, '{:.1f}')} ms, not answered {seg.missing:,}, "
            f"new connections {seg.new_connections_per_s:,.1f}/s"
        )
    if r.segments:
        normal = _f(r.normal_p99_ms, "{:.1f}")
        lines.append(
            f"  normal again {r.recovery_s:g} s after the burst (every later second: p99 ≤ {normal} ms, "
            "none missing)"
            if r.recovery_s is not None
            else f"  NOT normal again before the phase ended (p99 ≤ {normal} ms, none missing)"
        )
    c = r.connections
    if c is not None:
        lines.append(
            f"  connections: {c['opened']:,.0f} new ({_f(c['new_per_s'], '{:,.1f}')}/s, "
            f"{_f(c['per_review'], '{:.4f}')} handshakes per review, mean dial "
            f"{_f(c['dial_ms_mean'], '{:.1f}')} ms), {c['dial_errors']:,.0f} failed, peak "
            f"{c['peak_open']:,.0f} open, closed: {_f(c['closed_surplus'], '{:,.0f}')} surplus idle, "
            f"{c['closed_abandoned']:,.0f} abandoned, {_f(c['closed_by_server'], '{:,.0f}')} by the server"
            + (
                f"; {c['unused_at_gateway']:,.0f} closed by the caller before any request"
                " (the gateway's count)"
                if "unused_at_gateway" in c
                else ""
            )
        )
    if r.generator_cpu_us_per_review is not None:
        lag = (
            f", its timers late p99 {_f(r.generator_lag_p99_ms, '{:.2f}')} ms, max "
            f"{_f(r.generator_lag_max_ms, '{:.1f}')} ms"
            if r.generator_lag_p99_ms is not None
            else ""
        )
        gc_note = (
            f", its own gc: longest {r.generator_gc_max_ms:.1f} ms (most CPU in one: "
            f"{_f(r.generator_gc_max_cpu_ms, '{:.1f}')} ms), {r.generator_gc_pct:.2f} % of the phase"
            if r.generator_gc_max_ms is not None and r.generator_gc_pct is not None
            else ""
        )
        lines.append(
            f"  generator: {r.generator_cpu_us_per_review:,.0f} µs CPU per review, "
            f"{_f(r.generator_cpu_pct, '{:.0f}')} % of a core{lag}{gc_note}"
        )
    if allowance is not None and r.cpu_s is not None and r.elapsed_s > 0:
        # Offered reviews/s × CPU per review against the quota: at 100 % the queue can only grow.
        used = r.cpu_s / r.elapsed_s
        lines.append(
            f"  CPU: the {r.name} process used {used:.2f} of a CPU, {100 * used / allowance:.0f} % of its "
            f"allowance ({allowance:g} of a CPU)"
        )
    if r.cpu_wait_pct is not None or r.generator_cpu_wait_pct is not None:
        lines.append(
            f"  waiting for a CPU (runnable, not running): the {r.name} process's event loop "
            f"{_f(r.cpu_wait_pct, '{:.0f}')} % of the phase, the generator's "
            f"{_f(r.generator_cpu_wait_pct, '{:.0f}')} %"
        )
    if r.gc:
        parts = [
            f"{gen} {v['count']:,.0f} ({v['per_s']:,.1f}/s, longest {_f(v['max_ms'], '{:.2f}')} ms, "
            f"CPU {_f(v.get('max_cpu_ms'), '{:.2f}')} ms)"
            for gen, v in r.gc.items()
        ]
        paused = sum(v["pct_of_phase"] for v in r.gc.values())
        cpu = sum(v.get("cpu_pct_of_phase") or 0.0 for v in r.gc.values())
        lines.append(
            f"  {r.name} gc: {', '.join(parts)}; paused {paused:.2f} % of the phase "
            f"({cpu:.2f} % of it collecting on a CPU)"
        )
    return lines


def _versus_baseline(g: PhaseResult, b: PhaseResult, revision: str | None) -> list[str]:
    """The ``÷ baseline`` row: this checkout's gateway against the baseline checkout's, same load."""
    rps = g.throughput_rps / b.throughput_rps if b.throughput_rps else math.nan
    cpu = (
        g.cpu_us_per_review / b.cpu_us_per_review
        if g.cpu_us_per_review is not None and b.cpu_us_per_review
        else math.nan
    )
    latency = [
        _f(getattr(g.latency, f) - getattr(b.latency, f), "{:+.2f}")
        for f in ("p50_ms", "p90_ms", "p99_ms", "p999_ms")
    ]
    row = _row(["÷ baseline", "", _f(rps, "{:.2f}x"), *latency, "", _f(cpu, "{:.2f}x")])
    note = (
        f"  (÷ baseline: this checkout's gateway against the baseline checkout's ({revision or '?'}), "
        "same fleet and load: reviews/s and CPU µs per review as ratios, latency as ms gateway − baseline)"
    )
    return [row, note]


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


def to_json(result: RunResult) -> dict[str, Any]:
    opts = asdict(result.options)
    opts.pop("target_ca", None)
    return {
        "scenario": {"name": result.scenario.name, "description": result.scenario.description},
        "options": opts,
        "machine": machine(),
        "points": [
            {
                "runs": {name: [r.to_json() for r in runs] for name, runs in point.items()},
                "median": {name: r.to_json() for name, r in med.items()},
            }
            for point, med in zip(result.points, medians(result), strict=True)
        ],
        "capacities": result.capacities,
        "baseline_revision": result.baseline_revision,
        "placement": result.placement,
        "reloads": asdict(result.reloads) if result.reloads is not None else None,
        "rss": {
            "every_s": result.rss.every,
            "series": [{"t_s": t, "mb": mb} for t, mb in result.rss.samples],
            "summary": summarize_rss(result.rss.samples),
        }
        if result.rss is not None
        else None,
    }


def write_json(result: RunResult, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(to_json(result)), indent=2) + b"\n")


def plot(result: RunResult, path: Path) -> None:
    """Latency percentiles vs achieved load (one point per offered rate) and a latency histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "legend.fontsize": 10})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 7))
    meds = medians(result)
    colours = {"gateway": "tab:blue", "direct": "tab:green"}
    for name in ("direct", "gateway"):
        pts: Sequence[PhaseResult] = [m[name] for m in meds if name in m]
        if not pts:
            continue
        x = [p.throughput_rps for p in pts]
        # one marker per percentile, so a single load point is still readable without its lines
        for attr, style, marker in (("p50_ms", "-", "o"), ("p90_ms", "--", "s"), ("p99_ms", ":", "^")):
            ax1.plot(
                x,
                [getattr(p.latency, attr) for p in pts],
                style,
                marker=marker,
                color=colours[name],
                label=f"{name} {attr.removesuffix('_ms')}",
            )
    ax1.set_xlabel("throughput (correct reviews/s)")
    ax1.set_ylabel("latency (ms)")
    ax1.set_yscale("log")
    ax1.set_title("latency percentiles vs load")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.xaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    plain = matplotlib.ticker.FuncFormatter(lambda v, _pos: f"{v:g}")  # 20, not 2×10¹
    ax1.yaxis.set_major_formatter(plain)
    ax1.yaxis.set_minor_formatter(plain)
    reached = [m[n].throughput_rps for m in meds for n in ("direct", "gateway") if n in m]
    ax1.set_xlim(0, max(reached, default=1.0) * 1.1 or 1.0)  # no point on the frame
    # Below the axes, so it never hides a measured point.
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, title="phase, percentile")
    for name, values in result.latencies.items():
        ms = [v * 1000 for v in values if v > 0]
        if not ms:
            continue
        lo, hi = max(min(ms), 1e-3), max(ms)
        bins = [lo * (hi / lo) ** (k / 60) for k in range(61)] if hi > lo else 10
        ax2.hist(ms, bins=bins, alpha=0.55, color=colours.get(name), label=f"{name} (n={len(ms):,})")
    ax2.set_xscale("log")
    ax2.set_xlabel("latency (ms)")
    ax2.set_ylabel("reviews")
    ax2.set_title("latency histogram (first load point)")
    ax2.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax2.xaxis.set_major_formatter(plain)
    ax2.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    fig.suptitle(describe(result), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
