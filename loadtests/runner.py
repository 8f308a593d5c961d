"""One load-test run: start the fleet and the gateway, then for each offered load measure the
direct-to-backend baseline and the gateway side by side, verifying every answer."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import math
import os
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import trio

from loadtests import cpuquota, gcstats, gobackend, processes, soak
from loadtests.client import ConnectionLostError, Endpoint, H2Connection, client_context
from loadtests.drive import (
    Segment,
    arrival_offsets,
    drive_closed_loop,
    drive_open_loop,
    drive_open_loop_unbounded,
    schedule_offsets,
)
from loadtests.fixtures import ReviewTemplate, review_templates, with_labels
from loadtests.gocaller import ABANDONED, ANSWERED, FAILED_OPEN, PLACEHOLDER, GoCaller, GoSession
from loadtests.scenarios import (
    Expectation,
    Scenario,
    backend_path,
    expect_direct,
    expect_gateway,
    write_configs,
)
from loadtests.stats import (
    BucketPercentiles,
    PhaseResult,
    Recorder,
    bucket_percentiles,
    counter_total,
    histogram_buckets,
    normal_p99_ms,
    percentile,
    recovery_seconds,
    summarize,
    summarize_segment,
    windows,
)
from loadtests.transport import (
    MAX_IDLE_PER_HOST,
    AbandonedError,
    ConnectionStats,
    DialError,
    Policy,
    make_policy,
)
from loadtests.verify import INJECTED, OK, Verifier


@dataclass
class Options:
    """Everything the CLI decides (see ``python -m loadtests --help``)."""

    duration: float = 10.0
    requests: int | None = None
    concurrency: int = 8
    rates: list[float] = field(default_factory=list)  # empty: closed loop (unless capacity_shares)
    # Open loop at these shares of the capacity (0.5: half), measured right before each repeat.
    capacity_shares: list[float] = field(default_factory=list)
    poisson: bool = False
    protocol: str = "http1"
    backend_protocol: str = "h2"  # what TLS backends offer in ALPN: "h2" (and http/1.1) or "http1" only
    tls: bool = True
    target: str | None = None
    target_ca: bytes | None = None
    insecure: bool = False
    backends: int | None = None
    latency: str = ""  # a backend path step, e.g. "latency/lognormal/2/0.5"
    error_rate: float = 0.0
    size_kb: float = 8.0
    review_version: str = "v1"
    warmup: float = 1.0
    repeat: int = 1
    direct: bool = True
    gateway: bool = True  # False (--direct-only): measure only the backends, start no gateway
    seed: int = 0
    progress: bool = True
    gateway_args: list[str] = field(default_factory=list)
    slow_fraction: float = 0.05
    profile: str | None = None  # py-spy of the gateway's first measured phase: .svg flame graph, .txt stacks
    nginx: bool = False  # also measure an nginx proxy hop in front of the same backend
    baseline_tree: str | None = None  # also measure the gateway of this source checkout (its own row)
    reload_every: float | None = None  # soak: rewrite the gateway's configuration this often in its phases
    # How the generator holds connections (loadtests.transport): "client-go" (the apiserver's
    # policy), "fixed" (one per worker, opened first: not the apiserver's) or "per-review".
    connection_policy: str = "client-go"
    max_idle: int = MAX_IDLE_PER_HOST
    timeout: float = 10.0  # the caller's ?timeout= (s): a review is abandoned this long after its arrival
    # --burst PEAK:SECONDS: after the phase's --duration at the --rate, PEAK (same unit as --rate:
    # reviews/s, or a share of the capacity) for burst_seconds, then burst_after seconds at the rate.
    burst_peak: float | None = None
    burst_seconds: float = 2.0
    burst_after: float = 10.0
    key_type: str = "ecdsa"  # the throwaway serving certificates: "ecdsa" (P-256) or "rsa" (2048)
    gc_stats: bool = False  # record the gateway's garbage collections (gc.callbacks) per phase
    baseline_args: list[str] | None = None  # the baseline gateway's extra arguments (default: gateway_args)
    gateway_env: dict[str, str] = field(default_factory=dict)  # extra environment of the gateway
    baseline_env: dict[str, str] | None = None  # ... of the baseline gateway (default: gateway_env)
    rss_every: float | None = None  # soak: sample the gateway's VmRSS this often in its phases
    generator: str = "python"  # "go": the kube-apiserver's own client (loadtests.gocaller) drives the load
    backend: str = "python"  # "go": the compiled backend (loadtests.gobackend) instead of the Python fleet
    # The measured server (gateway, baseline, nginx) on the last CPU, everything else on the others.
    pin: bool = False
    # The measured server (gateway, baseline, nginx) on this share of a CPU each (``loadtests.cpuquota``).
    gateway_cpu: float | None = None


Step = tuple[bytes, ReviewTemplate, Expectation | None]


@dataclass
class Workload:
    """What one review is: its class and the calls it makes (mutate then validate at the gateway)."""

    endpoint: Endpoint
    mixes: list[tuple[str, list[Step]]]  # cycled per review: (class, steps)

    def pick(self, i: int, slow_fraction: float) -> tuple[str, list[Step]]:
        fast = [m for m in self.mixes if m[0] == "fast"]
        slow = [m for m in self.mixes if m[0] == "slow"]
        if slow and math.floor((i + 1) * slow_fraction) > math.floor(i * slow_fraction):
            return slow[i % len(slow)]
        return fast[i % len(fast)]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, unless forced)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()

    async def run(self, label: str, rec: Recorder, total_s: float, total_n: int | None) -> None:
        if not self.enabled:
            return
        start = trio.current_time()
        try:
            while True:
                await trio.sleep(0.25)
                elapsed = trio.current_time() - start
                done = rec.ok_count + rec.error_count
                frac = min(done / total_n, 1.0) if total_n else min(elapsed / total_s, 1.0)
                bar = "#" * int(frac * 30)
                sys.stderr.write(
                    f"\r  {label:<22} [{bar:<30}] {frac:4.0%} {rec.ok_count:>9,} ok"
                    f" {rec.error_count:>6,} err {rec.ok_count / max(elapsed, 1e-9):>8,.0f}/s"
                )
                sys.stderr.flush()
        finally:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()


class Generator:
    """Drives one workload and verifies every answer into a Recorder.

    Used as ``async with Generator(...) as gen``: its connections (the policy's pool, or the HTTP/2
    connection) live from the warm-up through the measured phase, as the apiserver's transport
    outlives any one request.
    """

    def __init__(self, workload: Workload, opts: Options, protocol: str, ssl_ctx: Any) -> None:
        self.workload = workload
        self.opts = opts
        self.protocol = protocol
        self.verifier = Verifier(opts.error_rate)
        self.counter = 0
        self.uid_prefix = f"{opts.seed & 0xFFFFFFFF:08x}-10ad-4e57-8000-"
        self.h2: H2Connection | None = None
        self.policy: Policy | None = None
        self._stack = contextlib.AsyncExitStack()
        self.nursery: trio.Nursery | None = None

    async def __aenter__(self) -> Generator:
        self.nursery = await self._stack.enter_async_context(trio.open_nursery())
        if self.protocol != "h2":
            self.policy = make_policy(
                self.opts.connection_policy, self.workload.endpoint, self.nursery, max_idle=self.opts.max_idle
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.policy is not None:
            self.policy.close_all()
        if self.h2 is not None:
            with contextlib.suppress(Exception):
                await self.h2.aclose()
            self.h2 = None
        assert self.nursery is not None
        self.nursery.cancel_scope.cancel()
        await self._stack.aclose()

    @property
    def stats(self) -> ConnectionStats | None:
        return self.policy.stats if self.policy is not None else None

    # CPU the generator spent outside this process in its last run (the Go caller's).
    other_cpu_s: float = 0.0

    async def warm_up(self, label: str, progress: Progress) -> None:
        """A closed loop for ``--warmup`` seconds, not recorded: the connections stay for ``run``."""
        await self.run(
            Recorder(), duration=self.opts.warmup, requests=None, rate=None, label=label, progress=progress
        )

    async def _h2(self) -> H2Connection:
        if self.h2 is None or self.h2.broken:
            assert self.nursery is not None
            self.h2 = await H2Connection.open(self.workload.endpoint, self.nursery)
        return self.h2

    async def _call(self, worker: int, path: bytes, body: bytes, deadline: float) -> tuple[int, bytes]:
        if self.policy is not None:
            return await self.policy.round_trip(worker, path, body, deadline)
        if trio.current_time() >= deadline:
            raise AbandonedError
        try:
            with trio.fail_at(deadline):
                return await (await self._h2()).request(path, body)
        except trio.TooSlowError:
            raise AbandonedError from None  # the stream was reset; the connection stays (as Go's h2)
        except (OSError, trio.BrokenResourceError) as exc:
            raise DialError(str(exc)) from exc

    async def one(self, rec: Recorder, worker: int, intended: float) -> None:
        """Send one review (its steps), verify each answer, record latency from ``intended``.

        Each step is one webhook call of the apiserver, with its own deadline: ``--timeout`` from
        the review's scheduled arrival for the first, from its own start for a later one.
        """
        i = self.counter
        self.counter += 1
        cls, steps = self.workload.pick(i, self.opts.slow_fraction)
        injected = False
        deadline = intended + self.opts.timeout
        for k, (path, template, expect) in enumerate(steps):
            uid = f"{self.uid_prefix}{i:08x}{k:04x}"
            if k:
                deadline = trio.current_time() + self.opts.timeout
            try:
                status, body = await self._call(worker, path, template.body(uid), deadline)
            except AbandonedError:
                rec.abandoned(intended)
                return
            except DialError:
                rec.error("connect", intended)
                return
            except (ConnectionLostError, trio.TooSlowError, OSError):
                rec.error("connection-lost", intended)
                return
            if expect is None:  # --target without a known configuration: protocol checks only
                verdict = self.verifier.check(status, body, uid, template, Expectation(allowed=True))
                if verdict in ("wrong-decision", "unexpected-patch", "patch-wrong-result"):
                    verdict = OK
            else:
                verdict = self.verifier.check(status, body, uid, template, expect)
            if verdict == INJECTED:
                injected = True
                break  # the apiserver would stop here too: a failed review goes no further
            if verdict != OK:
                rec.error(verdict, intended)
                return
        rec.ok(trio.current_time() - intended, cls, intended)
        if injected:
            rec.injected += 1

    async def run(
        self,
        rec: Recorder,
        *,
        duration: float,
        requests: int | None,
        rate: float | None,
        label: str,
        progress: Progress,
        segments: list[Segment] | None = None,
        on_started: Callable[[], None] = lambda: None,
        lag: array[float] | None = None,
    ) -> float | None:
        """Run the load; returns the offered rate (open loop) or None (closed loop).

        The ``fixed`` policy opens its connections first (their handshakes are not measured); the
        others start from the connections the warm-up left. Then ``on_started`` is called so the
        caller can take its CPU snapshots. ``segments`` (open loop): a schedule of rates instead of
        ``rate``. ``lag``: how late the generator's own 5 ms timer fires, appended during the load.
        """
        workers = self.opts.concurrency
        if self.policy is not None:
            await self.policy.prepare(workers if self.policy.name == "fixed" else 0)
        elif self.protocol == "h2":
            with contextlib.suppress(
                OSError, ConnectionLostError, trio.TooSlowError, trio.BrokenResourceError
            ):
                await self._h2()
        if self.policy is not None:
            self.policy.stats.reset()
        on_started()
        rec.started = trio.current_time()
        async with trio.open_nursery() as aside:
            aside.start_soon(progress.run, label, rec, duration, requests)
            if lag is not None:
                aside.start_soon(_lag_probe, lag)

            async def handle(worker: int, intended: float) -> None:
                await self.one(rec, worker, intended)

            if rate is None and not segments:
                await drive_closed_loop(workers, duration, requests, handle)
            else:
                offsets = _arrivals(self.opts, rate, duration, requests, segments)
                if self.opts.connection_policy == "fixed" or self.protocol == "h2":
                    await drive_open_loop(offsets, workers, handle)
                else:
                    await drive_open_loop_unbounded(offsets, handle)
            rec.finished = trio.current_time()
            aside.cancel_scope.cancel()
        return rate


def _arrivals(
    opts: Options, rate: float | None, duration: float, requests: int | None, segments: list[Segment] | None
) -> list[float]:
    """The open loop's arrival times (seconds from its start): ``segments``' schedule, or ``rate``'s."""
    if segments:
        return schedule_offsets(segments, poisson=opts.poisson, seed=opts.seed, limit=requests)
    assert rate is not None
    return arrival_offsets(rate, duration, poisson=opts.poisson, seed=opts.seed, limit=requests)


class GoGenerator:
    """``Generator``'s part with the Go caller (``--generator go``, ``loadtests.gocaller``): the
    kube-apiserver's own HTTP client drives the load. Each run is one Go process that warms its own
    connections up first (``--warmup``), so the runner's separate warm-up is skipped. The Go caller
    checks each answer's status, uid and ``allowed``: scenarios whose reviews are one call answered
    "allowed" with no patch to check (passthrough, fanout5, none, …)."""

    def __init__(
        self, workload: Workload, opts: Options, ca_file: Path, cpus: set[int] | None = None
    ) -> None:
        cls, steps = next(m for m in workload.mixes if m[0] == "fast")
        expect = steps[0][2]
        if len(steps) != 1 or (expect is not None and (not expect.allowed or expect.labels)):
            raise RuntimeError(
                "--generator go checks answers that allow one call per review with no patch: "
                "use a validating scenario such as passthrough or fanout5"
            )
        path, template, _ = steps[0]
        endpoint = workload.endpoint
        self.cls = cls
        self.opts = opts
        self.caller = GoCaller(
            f"https://{endpoint.host}:{endpoint.port}{path.decode()}",
            ca_file,
            template.body(PLACEHOLDER),
            opts.timeout,
            warmup=opts.warmup,
            cpus=cpus,
        )
        self.cpus_seen: set[int] = set()  # the CPUs the Go caller's threads were allowed, as it measured
        self._stats: ConnectionStats | None = None
        self.other_cpu_s = 0.0  # the Go process's CPU in its last measured phase
        self._stack = contextlib.AsyncExitStack()
        self._session: GoSession | None = None

    async def __aenter__(self) -> GoGenerator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def warm_up(self, label: str, progress: Progress) -> None:
        """Start the Go caller: it warms its own connections up (``--warmup``) and waits for ``run``."""
        del label, progress
        self._session = await self._stack.enter_async_context(self.caller.session())

    @property
    def stats(self) -> ConnectionStats | None:
        return self._stats

    async def run(
        self,
        rec: Recorder,
        *,
        duration: float,
        requests: int | None,
        rate: float | None,
        label: str,
        progress: Progress,
        segments: list[Segment] | None = None,
        on_started: Callable[[], None] = lambda: None,
        lag: array[float] | None = None,
    ) -> float | None:
        """As ``Generator.run``; ``lag`` stays empty (the Go caller reports its own start lag)."""

        if self._session is None:  # no warm-up asked for
            self.caller.warmup = 0.0
            self._session = await self._stack.enter_async_context(self.caller.session())
        session, self._session = self._session, None

        def started() -> None:
            on_started()
            rec.started = trio.current_time()
            self.cpus_seen = processes.cpus_of(session.proc.pid)

        async with trio.open_nursery() as aside:
            aside.start_soon(progress.run, label, rec, duration, requests)
            if rate is None and not segments:
                result = await session.closed_loop(self.opts.concurrency, duration, started)
            else:
                offsets = _arrivals(self.opts, rate, duration, requests, segments)
                result = await session.open_loop(offsets, started)
            aside.cancel_scope.cancel()
        rec.finished = rec.started + result.seconds
        for due, latency, code in zip(result.due, result.latency, result.code, strict=True):
            intended = rec.started + due
            if code in (ANSWERED, FAILED_OPEN):
                rec.ok(latency, self.cls, intended)
            elif code == ABANDONED:
                rec.abandoned(intended)
            else:
                rec.error("go-caller", intended)
        if rec.errors:
            rec.errors = Counter(result.errors)  # the kinds the Go caller named, one per review
        stats = ConnectionStats(
            dials=result.stats.get("dials", 0),
            opened=result.stats.get("opened", 0),
            dial_errors=result.stats.get("dial_errors", 0),
            reused=result.stats.get("reused", 0),
            closed_abandoned=result.stats.get("closed_abandoned", 0),
            peak_open=result.stats.get("peak_open", 0),  # TCP connections, handshakes under way included
            dial_seconds_total=result.stats.get("dial_us_total", 0) / 1e6,
            unmeasured=("closed_surplus", "closed_by_server"),
        )
        stats.opened_at = [rec.started + t for t in result.dials]
        self._stats = stats
        if result.dial_errors:  # why, which the report's counts do not say
            ranked = sorted(result.dial_errors.items(), key=lambda kv: -kv[1])
            why = ", ".join(f"{n:,} × {msg}" for msg, n in ranked)
            print(f"{label}: the Go caller's failed dials: {why}", file=sys.stderr, flush=True)
        self.other_cpu_s = result.cpu_s
        return rate


def make_generator(
    workload: Workload, opts: Options, ssl_ctx: Any, ca_file: Path | None, cpus: set[int] | None = None
) -> Generator | GoGenerator:
    """The generator ``opts.generator`` names for ``workload`` (``cpus``: the Go caller's, with --pin;
    the Python generator is this process, pinned by ``run``)."""
    if opts.generator == "go":
        if ca_file is None or opts.protocol != "http1":
            raise RuntimeError(
                "--generator go calls over HTTP/1.1 + TLS (not --no-tls, --target or --protocol h2)"
            )
        return GoGenerator(workload, opts, ca_file, cpus)
    return Generator(workload, opts, opts.protocol, ssl_ctx)


LAG_PERIOD: Final = 0.005


def _lag_summary(lag: array[float]) -> dict[str, float]:
    values = sorted(lag)
    if not values:
        return {}
    return {"generator_lag_p99_ms": percentile(values, 99) * 1000, "generator_lag_max_ms": values[-1] * 1000}


def _segments(opts: Options, rate: float | None, capacity: float | None) -> list[Segment] | None:
    """``--burst``: the phase's schedule: --duration at the rate, the burst, then --burst-after."""
    if opts.burst_peak is None or rate is None:
        return None
    peak = opts.burst_peak * capacity if capacity is not None else opts.burst_peak
    d, b = opts.duration, opts.burst_seconds
    return [
        Segment("before", 0.0, d, rate),
        Segment("burst", d, b, peak),
        Segment("after", d + b, opts.burst_after, rate),
    ]


class _GcPauses:
    """The generator's own garbage collections during a phase (``gc.callbacks``): a long one stops
    its event loop like any other stall, and is charged to the latency it measures.

    While a phase runs the generator makes no full (generation 2) collection: everything alive
    before it is frozen (``gc.freeze``) and the generation-2 threshold is out of reach, so only the
    young generations are collected. A full collection scans every live object, and with thousands
    of reviews and connections in flight (a gateway that stalls) one took over a second
    (docs/performance.md). The garbage that reaches generation 2 meanwhile is collected when the
    phase ends.
    """

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []  # generation, wall seconds, CPU seconds
        self._started = (0.0, 0.0)
        self._threshold = gc.get_threshold()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = (time.perf_counter(), time.thread_time())
        else:
            wall, cpu = self._started
            self.pauses.append((info["generation"], time.perf_counter() - wall, time.thread_time() - cpu))

    def __enter__(self) -> _GcPauses:
        gc.collect()
        gc.freeze()
        self._threshold = gc.get_threshold()
        if os.environ.get("LOADTEST_GENERATOR_GC") != "default":  # (an A/B knob for this choice)
            gc.set_threshold(self._threshold[0], self._threshold[1], 2**31 - 1)
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)
        gc.set_threshold(*self._threshold)
        gc.unfreeze()
        gc.collect()

    def summary(self, seconds: float) -> dict[str, float]:
        if not self.pauses:
            return {"generator_gc_max_ms": 0.0, "generator_gc_pct": 0.0, "generator_gc_max_cpu_ms": 0.0}
        return {
            "generator_gc_max_ms": 1000 * max(p for _, p, _c in self.pauses),
            "generator_gc_max_cpu_ms": 1000 * max(c for _, _p, c in self.pauses),
            "generator_gc_pct": 100 * sum(p for _, p, _c in self.pauses) / max(seconds, 1e-9),
        }


async def _lag_probe(out: array[float]) -> None:
    """How late a 5 ms sleep of the generator wakes (seconds): its event loop's own delay."""
    while True:
        target = trio.current_time() + LAG_PERIOD
        await trio.sleep_until(target)
        out.append(trio.current_time() - target)


def _query(path: str, timeout: float) -> str:
    return path + ("&" if "?" in path else "?") + f"timeout={timeout:g}s"


def gateway_workload(
    scenario: Scenario,
    endpoint: Endpoint,
    templates: dict[str, list[ReviewTemplate]],
    known: bool,
    timeout: float = 10.0,
) -> Workload:
    """Calls per review at the gateway: ``/mutate`` then ``/validate`` (on the mutated object)."""
    mixes: list[tuple[str, list[Step]]] = []
    for cls, tmpls in templates.items():
        for tmpl in tmpls:
            steps: list[Step] = []
            current = tmpl
            for ep in scenario.endpoints:
                expect = expect_gateway(scenario, ep, cls) if known else None
                steps.append((_query(f"/{ep}", timeout).encode(), current, expect))
                if ep == "mutate" and expect is not None and expect.labels:
                    current = with_labels(current, dict.fromkeys(expect.labels, "true"))
            mixes.append((cls, steps))
    return Workload(endpoint, mixes)


def direct_workload(
    scenario: Scenario,
    endpoint: Endpoint,
    path: str,
    templates: dict[str, list[ReviewTemplate]],
    timeout: float = 10.0,
) -> Workload:
    """Calls per review straight to the scenario's representative backend (the baseline): as many as
    the gateway phase makes per review (mutate and validate: two), so the ratio compares like with like."""
    spec = scenario.direct_backend
    expect = expect_direct(spec)
    calls = len(scenario.endpoints)
    mixes: list[tuple[str, list[Step]]] = [
        ("fast", [(_query(path, timeout).encode(), tmpl, expect)] * calls) for tmpl in templates["fast"]
    ]
    return Workload(endpoint, mixes)


@dataclass
class RunResult:
    """All phases of a run: per offered load (None = closed loop), per repeat."""

    scenario: Scenario
    options: Options
    points: list[dict[str, list[PhaseResult]]] = field(default_factory=list)
    # With capacity_shares: per load point, the capacity (reviews/s) probed before each repeat.
    capacities: list[list[float]] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=dict)  # last run's, for the histogram
    reloads: soak.Reloads | None = None  # --reload-every: rewrites asked for, applied, refused
    rss: soak.RssSeries | None = None  # --rss-every: the gateway's resident set over the run
    baseline_revision: str | None = None  # --baseline-tree: that checkout's ``git describe``
    # The CPUs each part's processes (all their threads) were allowed, read during the measured
    # phases: generator, go caller, backend, gateway, baseline, nginx (what --pin did, as it was).
    placement: dict[str, list[int]] = field(default_factory=dict)

    def seen_on(self, role: str, cpus: set[int]) -> None:
        self.placement[role] = sorted(set(self.placement.get(role, ())) | cpus)


async def _scrape(probe: Endpoint | None) -> str | None:
    """The gateway's /metrics text, or None (no probe, or no answer within 10 s)."""
    if probe is None:
        return None
    with (
        trio.move_on_after(10),
        contextlib.suppress(OSError, RuntimeError, ConnectionLostError, trio.TooSlowError),
    ):
        return await processes.scrape_metrics(probe)
    return None


# Connections their client closed before any request (the gateway's count): client-go closes a
# completed dial at once when its idle pool is full, so these are the dials a stall left behind.
UNUSED_CONNECTIONS: Final = "webhook_gateway_inbound_connections_unused"


def gateway_view(before: str, after: str) -> tuple[BucketPercentiles | None, BucketPercentiles | None]:
    """From two /metrics texts: percentiles of whole reviews as the gateway timed them (from the
    request's start to its answer), and of the gateway's own work in them (minus backend time)."""

    def percentiles(name: str) -> BucketPercentiles | None:
        return bucket_percentiles(histogram_buckets(before, name), histogram_buckets(after, name))

    return (
        percentiles("webhook_gateway_review_duration_seconds"),
        percentiles("webhook_gateway_review_overhead_seconds"),
    )


def _pid_of(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


async def _start_nginx(
    stack: contextlib.ExitStack,
    tmp: Path,
    certs: processes.Certs | None,
    ctx: Any,
    backend: Endpoint,
    *,
    say: Callable[[str], None],
    cpus: set[int] | None = None,
) -> Endpoint:
    """nginx as a plain proxy hop in front of the direct baseline's backend: the floor of a proxy."""
    exe = processes.nginx()
    assert exe is not None  # checked before the run
    port = processes.free_port()
    conf = processes.write_nginx_conf(tmp / "nginx", port, (backend.host, backend.port), certs)
    say(f"starting nginx on 127.0.0.1:{port} in front of {backend.host}:{backend.port} …")
    proc = stack.enter_context(processes.managed(processes.spawn_nginx(exe, conf, cpus)))
    endpoint = Endpoint("127.0.0.1", port, ctx if certs else None, f"127.0.0.1:{port}")
    probe_ctx = client_context(certs.ca_pem, "http1", False) if certs else None
    probe = Endpoint("127.0.0.1", port, probe_ctx, f"127.0.0.1:{port}")
    try:
        await processes.wait_answering(probe, proc)
    except (RuntimeError, OSError) as exc:
        log = (tmp / "nginx" / "error.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"nginx: {exc}\n{log}") from exc
    return endpoint


class _Profiling:
    """``--profile``: py-spy records the gateway during its first measured phase, once."""

    def __init__(self, out: str | None, duration: float) -> None:
        self.out = Path(out) if out else None
        self.duration = duration
        self.proc: subprocess.Popen[bytes] | None = None
        self.done = out is None

    def start(self, pid: int) -> None:
        if self.done or self.proc is not None or self.out is None:
            return
        exe = processes.py_spy()
        assert exe is not None  # checked before the run
        self.proc = processes.spawn_profiler(exe, pid, self.out, self.duration)

    async def finish(self, say: Callable[[str], None]) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self.done = True
        with trio.move_on_after(30):
            await trio.to_thread.run_sync(proc.wait)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        output = proc.stdout.read().decode(errors="replace").strip() if proc.stdout else ""
        if proc.returncode == 0:
            say(f"wrote the {'collapsed stacks' if self.out.suffix == '.txt' else 'flame graph'} {self.out}")
        else:
            raise RuntimeError(f"py-spy failed ({proc.returncode}): {output[-500:]}")


def go_backend_refusal(scenario: Scenario, opts: Options) -> str | None:
    """Why ``--backend go`` cannot serve this run (one line), or None: it is an HTTPS backend this
    run starts that answers ``POST /allow`` only."""
    if opts.target:
        return "--backend go is a backend this run starts (not --target)"
    if not opts.tls:
        return "--backend go serves HTTPS only (not --no-tls)"
    paths = {backend_path(b, opts.latency, opts.error_rate) for b in scenario.backends if not b.dead}
    other = sorted(paths - {gobackend.PATH})
    if other:
        return (
            f"--backend go answers POST {gobackend.PATH} only, and scenario {scenario.name} calls "
            f"{', '.join(other)}: use passthrough, fanout5, fanout20 or none, "
            "without --latency or --error-rate"
        )
    return None


@contextlib.contextmanager
def _tempdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="webhook-gateway-loadtest-") as d:
        yield Path(d)


async def run(scenario: Scenario, opts: Options, say: Callable[[str], None]) -> RunResult:
    """Start what the scenario needs, then measure direct and gateway phases for every load point."""
    result = RunResult(scenario, opts)
    progress = Progress(opts.progress)
    refused = go_backend_refusal(scenario, opts) if opts.backend == "go" else None
    if refused:
        raise RuntimeError(refused)
    try:
        split = processes.placement(opts.pin)
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    server_cpus, other_cpus = split or (None, None)
    with contextlib.ExitStack() as stack:
        if other_cpus is not None:
            # This process (the runner, the Python generator) with everything but the measured server.
            stack.callback(processes.pin, os.getpid(), os.sched_getaffinity(0))
            processes.pin(os.getpid(), other_cpus)
        tmp = stack.enter_context(_tempdir())
        # Each measured server's CPU share: made before them, removed after them.
        quotas = (
            {
                n: stack.enter_context(cpuquota.cpu_quota(n, opts.gateway_cpu))
                for n in ("gateway", "baseline", "nginx")
            }
            if opts.gateway_cpu is not None and not opts.target
            else {}
        )
        certs = processes.Certs.create(tmp, opts.key_type) if opts.tls and not opts.target else None
        ca_pem = opts.target_ca if opts.target else (certs.ca_pem if certs else None)
        ctx = client_context(ca_pem, opts.protocol, opts.insecure) if (opts.tls or opts.target) else None
        ca_file = tmp / "ca.pem" if certs else None
        if ca_file is not None and certs is not None:
            ca_file.write_bytes(certs.ca_pem)
        slow = any(b.slow_only for b in scenario.backends)
        templates = {"fast": review_templates(opts.size_kb, opts.review_version)}
        if slow:
            templates["slow"] = review_templates(opts.size_kb, opts.review_version, slow=True)

        fleet = gateway = baseline = None
        probe: Endpoint | None = None
        base_endpoint: Endpoint | None = None
        gateway_args = list(opts.gateway_args)
        reload_wait = 0.0  # how long, after a phase, the gateway may take to act on the last rewrite
        if opts.reload_every and opts.gateway and not opts.target:
            poll = soak.poll_seconds(opts.reload_every, gateway_args)
            if poll is not None:
                gateway_args.append(f"--config-poll-seconds={poll:g}")
            reload_wait = 2 * (poll or 2.0) + 5
        direct_endpoint: Endpoint | None = None
        nginx_endpoint: Endpoint | None = None
        direct_path = "/allow"
        gw_endpoint: Endpoint | None
        if opts.target:
            gw_endpoint, _ = Endpoint.parse(opts.target, ctx)
            known = False
        else:
            live = [b for b in scenario.backends if not b.dead]
            http1_only = opts.backend_protocol == "http1"
            if opts.backend == "go":
                assert certs is not None  # go_backend_refusal: TLS only
                say(f"starting {len(live)} Go backend(s) in a separate process …")
                backends = gobackend.spawn(len(live) or 1, certs, http1_only=http1_only, cpus=other_cpus)
            else:
                say(f"starting {len(live)} backend(s) in a separate process …")
                backends = processes.spawn_fleet(
                    len(live) or 1, certs, http1_only=http1_only, cpus=other_cpus
                )
            fleet = stack.enter_context(processes.managed(backends))
            ports = await processes.fleet_ports(fleet)
            scheme = "https" if certs else "http"
            urls: dict[str, str] = {}
            live_ports = iter(ports)
            for b in scenario.backends:
                port = processes.free_port() if b.dead else next(live_ports)
                urls[b.name] = f"{scheme}://127.0.0.1:{port}{backend_path(b, opts.latency, opts.error_rate)}"
            write_configs(scenario, urls, ca_pem, tmp / "config")
            spec = scenario.direct_backend
            direct_url = urls.get(spec.name, f"{scheme}://127.0.0.1:{ports[0]}/allow")
            direct_endpoint, direct_path = Endpoint.parse(direct_url, ctx)
            gw_endpoint = None
            # A new connection per review measures what a connection costs, not how fast the gateway
            # admits them (--handshake-rate); a variable, which a baseline tree without it ignores.
            admit_all = {"WEBHOOK_GATEWAY_HANDSHAKE_RATE": "0"}
            if opts.connection_policy != "per-review":
                admit_all = {}
            if opts.gateway:
                gateway, gw_endpoint, probe = await _start_gateway(
                    stack,
                    tmp,
                    certs,
                    ctx,
                    ca_pem,
                    insecure=opts.insecure,
                    args=gateway_args,
                    say=say,
                    tree=None,
                    env=admit_all | opts.gateway_env,
                    gc_stats=opts.gc_stats,
                    cpus=server_cpus,
                )
            if opts.gateway and (
                opts.baseline_tree or opts.baseline_args is not None or opts.baseline_env is not None
            ):
                # Another checkout's gateway, or this one's with other arguments or environment.
                tree = Path(opts.baseline_tree) if opts.baseline_tree else None
                result.baseline_revision = processes.tree_revision(tree or Path(__file__).parent.parent)
                baseline, base_endpoint, _ = await _start_gateway(
                    stack,
                    tmp,
                    certs,
                    ctx,
                    ca_pem,
                    insecure=opts.insecure,
                    args=opts.gateway_args if opts.baseline_args is None else opts.baseline_args,
                    say=say,
                    tree=tree,
                    name="baseline",
                    env=admit_all | (opts.gateway_env if opts.baseline_env is None else opts.baseline_env),
                    gc_stats=opts.gc_stats,
                    cpus=server_cpus,
                )
            if opts.nginx:
                nginx_endpoint = await _start_nginx(
                    stack, tmp, certs, ctx, direct_endpoint, say=say, cpus=server_cpus
                )
            known = True
            for ep in (gw_endpoint, base_endpoint, direct_endpoint, nginx_endpoint):
                assert ep is None or _loopback(ep.host), "without --target, traffic stays on loopback"

        gw_work = gateway_workload(scenario, gw_endpoint, templates, known) if gw_endpoint else None
        base_work = gateway_workload(scenario, base_endpoint, templates, known) if base_endpoint else None
        direct_work = (
            direct_workload(scenario, direct_endpoint, direct_path, templates)
            if direct_endpoint is not None and opts.direct
            else None
        )
        nginx_work = (
            direct_workload(scenario, nginx_endpoint, direct_path, templates) if nginx_endpoint else None
        )
        nginx_pid = _pid_of(tmp / "nginx" / "nginx.pid") if nginx_endpoint else None
        for name, pid in (
            ("gateway", gateway.pid if gateway else None),
            ("baseline", baseline.pid if baseline else None),
            ("nginx", nginx_pid),
        ):
            if name in quotas and pid is not None:
                cpuquota.join(quotas[name], pid)
        profiling = _Profiling(opts.profile, opts.duration)
        churn = None
        if opts.reload_every and gateway is not None:
            churn = soak.ConfigChurn(tmp / "config")
            result.reloads = soak.Reloads()
        if opts.rss_every and gateway is not None:
            result.rss = soak.RssSeries(opts.rss_every)
        # Per load point: a fixed rate (None: closed loop), or a share of the probed capacity.
        loads: list[tuple[float | None, float | None]] = (
            [(None, share) for share in opts.capacity_shares]
            if opts.capacity_shares
            else [(rate, None) for rate in opts.rates] or [(None, None)]
        )
        for fixed_rate, share in loads:
            point: dict[str, list[PhaseResult]] = {"direct": []}
            if nginx_work is not None:
                point["nginx"] = []  # between the two: the floor line of a proxy
            point["gateway"] = []
            if base_work is not None:
                point["baseline"] = []  # the same load through the other checkout's gateway
            probed: list[float] = []
            for rep in range(opts.repeat):
                rate = fixed_rate
                capacity = 0.0
                if share is not None:
                    # The capacity of what the load is for (the gateway; the backend without one),
                    # now: a share of an earlier figure would load a slower machine more.
                    probe_work = gw_work or direct_work
                    assert probe_work is not None
                    capacity = await probe_capacity(probe_work, opts, ctx, progress, ca_file, cpus=other_cpus)
                    probed.append(capacity)
                    rate = share * capacity
                segments = _segments(opts, rate, capacity if share is not None else None)
                for name, work, pid in (
                    ("direct", direct_work, fleet.pid if fleet else None),
                    ("nginx", nginx_work, nginx_pid),
                    ("gateway", gw_work, gateway.pid if gateway else None),
                    ("baseline", base_work, baseline.pid if baseline else None),
                ):
                    if work is None:
                        continue
                    rec = Recorder()
                    snap: dict[str, float] = {}
                    gc_file = (
                        tmp / f"{name}.gc.json" if opts.gc_stats and name in ("gateway", "baseline") else None
                    )

                    def snapshot(
                        pid: int | None = pid,
                        snap: dict[str, float] = snap,
                        name: str = name,
                        gc_file: Path | None = gc_file,
                    ) -> None:
                        if fleet:
                            snap["fleet"] = processes.proc_cpu_seconds(fleet.pid)
                        if pid:
                            snap["server"] = processes.proc_cpu_seconds(pid)
                            snap["server_wait"] = processes.proc_wait_seconds(pid)
                        snap["self"] = processes.self_cpu_seconds()
                        snap["self_wait"] = processes.proc_wait_seconds(os.getpid(), children=False)
                        if gc_file is not None:
                            snap["gc_from"] = gcstats.now()
                        if pid and name == "gateway":
                            profiling.start(pid)
                        result.seen_on("generator", processes.cpus_of(os.getpid()))
                        if fleet:
                            result.seen_on("backend", processes.cpus_of(fleet.pid))
                        if pid and name != "direct":
                            result.seen_on(name, processes.cpus_of(pid))

                    shape = "closed" if rate is None else f"{rate:g}/s" + (" +burst" if segments else "")
                    label = f"{name} {shape} #{rep + 1}"
                    # Soak (--reload-every, --rss-every): only during the measured gateway phases.
                    soak_gw = gateway if name == "gateway" else None
                    churning = churn if soak_gw is not None and probe is not None else None
                    lag: array[float] = array("d")
                    async with make_generator(work, opts, ctx, ca_file, other_cpus) as gen:
                        if opts.warmup > 0:
                            await gen.warm_up(f"{name} warm-up", progress)
                        # The gateway's /metrics before and after its measured phase: its own view.
                        own_before = await _scrape(probe) if soak_gw is not None else None
                        if churning is not None and own_before is None:
                            raise RuntimeError("the gateway's /metrics did not answer before a soak phase")
                        before = soak.reload_counts(own_before or "")
                        written = churn.written if churn is not None else 0
                        async with trio.open_nursery() as soak_tasks:
                            if churning is not None and opts.reload_every:
                                soak_tasks.start_soon(soak.churn_during_phase, churning, opts.reload_every)
                            if soak_gw is not None and result.rss is not None:
                                soak_tasks.start_soon(result.rss.during_phase, soak_gw.pid)
                            with _GcPauses() as generator_gc:
                                offered = await gen.run(
                                    rec,
                                    duration=sum(s.seconds for s in segments) if segments else opts.duration,
                                    requests=opts.requests,
                                    rate=rate,
                                    segments=segments,
                                    label=label,
                                    progress=progress,
                                    on_started=snapshot,
                                    lag=lag,
                                )
                            soak_tasks.cancel_scope.cancel()
                        conn_stats = gen.stats
                        go_cpu = gen.other_cpu_s
                        if isinstance(gen, GoGenerator):
                            result.seen_on("go caller", gen.cpus_seen)
                    if soak_gw is not None and result.rss is not None:
                        result.rss.sample(soak_gw.pid)  # the phase's end
                    if churning is not None and probe is not None and result.reloads is not None:
                        asked = churning.written - written
                        applied, refused = await soak.settle(probe, before, asked, reload_wait)
                        result.reloads.requested += asked
                        result.reloads.applied += applied
                        result.reloads.refused += refused
                        # A refused or unseen reload is an error of the phase (and the exit status).
                        for _ in range(refused):
                            rec.error("reload-refused")
                        for _ in range(max(asked - applied - refused, 0)):
                            rec.error("reload-not-applied")
                    if name == "gateway":
                        await profiling.finish(say)
                    n = max(rec.ok_count + rec.error_count + rec.late, 1)
                    generator_cpu = processes.self_cpu_seconds() - snap["self"] + go_cpu
                    elapsed = max(rec.finished - rec.started, 1e-9)
                    extra: dict[str, Any] = {
                        "generator_cpu_us_per_review": generator_cpu / n * 1e6,
                        "generator_cpu_pct": 100 * generator_cpu / elapsed,
                        **_lag_summary(lag),
                        **generator_gc.summary(elapsed),
                    }
                    self_waited = processes.proc_wait_seconds(os.getpid(), children=False) - snap["self_wait"]
                    extra["generator_cpu_wait_pct"] = 100 * self_waited / elapsed
                    if pid and "server" in snap:
                        waited = processes.proc_wait_seconds(pid) - snap["server_wait"]
                        extra["cpu_wait_pct"] = 100 * waited / elapsed
                        cpu = processes.proc_cpu_seconds(pid) - snap["server"]
                        extra["cpu_s"] = cpu
                        extra["cpu_us_per_review"] = cpu / n * 1e6
                        extra["peak_rss_mb"] = processes.proc_peak_rss_mb(pid)
                    if fleet and "fleet" in snap:
                        fleet_cpu = processes.proc_cpu_seconds(fleet.pid) - snap["fleet"]
                        extra["backend_cpu_us_per_review"] = fleet_cpu / n * 1e6
                    if gc_file is not None:
                        extra["gc"] = gcstats.summarize(gc_file, snap["gc_from"], gcstats.now())
                    dials = conn_stats.dial_offsets(rec.started) if conn_stats is not None else []
                    if conn_stats is not None:
                        extra["connections"] = conn_stats.summary(elapsed, n)
                    # One window per second of the schedule (open loop), or of the phase (closed).
                    span = sum(s.seconds for s in segments) if segments else opts.duration
                    extra["windows"] = windows(
                        rec.due, rec.outcome, elapsed if rate is None else min(span, elapsed), dials
                    )
                    if segments:
                        extra["segments"] = [
                            summarize_segment(s.name, s.start, s.seconds, rec, dials) for s in segments
                        ]
                        normal = normal_p99_ms(extra["segments"][0].p99_ms)
                        extra["normal_p99_ms"] = normal
                        burst_end = segments[1].start + segments[1].seconds
                        extra["recovery_s"] = recovery_seconds(extra["windows"], burst_end, normal)
                    # After the CPU readings: rendering /metrics is not the phase's work.
                    own_after = await _scrape(probe) if own_before is not None else None
                    if own_before is not None and own_after is not None:
                        extra["gateway_review"], extra["gateway_work"] = gateway_view(own_before, own_after)
                        if "connections" in extra:  # what no caller sees: dials it did not need
                            extra["connections"]["unused_at_gateway"] = counter_total(
                                own_after, UNUSED_CONNECTIONS
                            ) - counter_total(own_before, UNUSED_CONNECTIONS)
                    point[name].append(summarize(name, rec, offered, **extra))
                    # The histogram shows the first (lowest) load point: saturation is in the left plot.
                    result.latencies.setdefault(name, rec.all_latencies())
                    for proc, log_name in ((gateway, "gateway.log"), (baseline, "baseline.log")):
                        if proc is not None and proc.poll() is not None:
                            tail = (tmp / log_name).read_text(errors="replace")[-4000:]
                            raise RuntimeError(
                                f"the {log_name[:-4]} exited with {proc.returncode} during the run\n{tail}"
                            )
            result.points.append(point)
            if share is not None:
                result.capacities.append(probed)
    return result


async def _start_gateway(
    stack: contextlib.ExitStack,
    tmp: Path,
    certs: processes.Certs | None,
    ctx: Any,
    ca_pem: bytes | None,
    *,
    insecure: bool,
    args: list[str],
    say: Callable[[str], None],
    tree: Path | None,
    name: str = "gateway",
    env: dict[str, str] | None = None,
    gc_stats: bool = False,
    cpus: set[int] | None = None,
) -> tuple[subprocess.Popen[bytes], Endpoint, Endpoint]:
    """Start a gateway on the run's configuration and wait until it is ready: this checkout's, or
    (``tree``) another checkout's; ``name`` "baseline" for the one measured beside it. Its process,
    its endpoint for the load, and a readiness and ``/metrics`` probe (HTTP/1.1, whatever protocol
    the load uses)."""
    port = processes.free_port()
    log = tmp / f"{name}.log"
    which = ("the gateway" if name == "gateway" else f"the {name} gateway") + (
        f" from {tree}" if tree is not None else ""
    )
    say(f"starting {which} on 127.0.0.1:{port} (config in {tmp / 'config'}) …")
    proc = stack.enter_context(
        processes.managed(
            processes.spawn_gateway(
                tmp / "config",
                port,
                certs,
                log,
                args,
                tree=tree,
                env=env,
                gc_stats=tmp / f"{name}.gc.json" if gc_stats else None,
                cpus=cpus,
            )
        )
    )
    endpoint = Endpoint("127.0.0.1", port, ctx if certs else None, f"127.0.0.1:{port}")
    probe_ctx = client_context(ca_pem, "http1", insecure) if certs else None
    probe = Endpoint("127.0.0.1", port, probe_ctx, f"127.0.0.1:{port}")
    try:
        await processes.wait_ready(probe, proc)
    except (RuntimeError, OSError) as exc:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{exc}\n--- {name} log (tail) ---\n{tail}") from exc
    return proc, endpoint, probe


# The closed loop capacity figures are measured with (--concurrency's default).
CAPACITY_CLIENTS: Final = 8
CAPACITY_PROBE_SECONDS: Final = 5.0


async def probe_capacity(
    work: Workload,
    opts: Options,
    ctx: Any,
    progress: Progress,
    ca_file: Path | None = None,
    *,
    cpus: set[int] | None = None,
) -> float:
    """Reviews/s of ``work`` in a closed loop of ``CAPACITY_CLIENTS``: what ``N%`` of capacity means.

    Up to ``CAPACITY_PROBE_SECONDS`` (at most the phase's duration) after the usual warm-up. A wrong
    answer ends the run: a load derived from a broken probe would measure nothing.
    """
    closed = replace(opts, concurrency=CAPACITY_CLIENTS, rates=[], capacity_shares=[], burst_peak=None)
    rec = Recorder()
    async with make_generator(work, closed, ctx, ca_file, cpus) as gen:
        if opts.warmup > 0:
            await gen.warm_up("capacity warm-up", progress)
        await gen.run(
            rec,
            duration=min(opts.duration, CAPACITY_PROBE_SECONDS),
            requests=None,
            rate=None,
            label="capacity probe",
            progress=progress,
        )
    if rec.late:
        rec.errors["late"] += rec.late
    if rec.errors:
        raise RuntimeError(f"the capacity probe got wrong answers: {dict(rec.errors)}")
    if not rec.ok_count:
        raise RuntimeError("the capacity probe got no answers")
    return rec.ok_count / max(rec.finished - rec.started, 1e-9)
