"""Cost of observing one review: ``Observability.review_started`` + ``review_finished``.

A realistic review: a validating fan-out over 5 backends, and the common case of one backend (all
allowed, v1, backend uids, a traceparent), as the server reports it after answering. Measured with
metrics on/off and the canonical log line on/off, JSON and console, plus the cost when the info level
is filtered out.

    cd <worktree> && /work/venv/bin/python benchmarks/bench_observability.py \
        [--output PATH] [-n N] [--backends 1,5]

Log lines go to ``--output`` (default /dev/null: the write syscall is still made). This is a
script, not a test: it configures structlog globally, as ``__main__`` does.

``--pipe``: instead, lines go to a real pipe drained by another process (as a container runtime
reads stdout), written at once per line (the other commands) or through the background sink (the
serving processes, ``configure_logging(background=True)``). Reported per review: the time the
logging thread spends (what the event loop pays), and the CPU time of the whole process (the sink's
writer thread included: each run ends with a flush).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec
import structlog

from gateway.admission import AdmissionAttributes, GroupVersionKind, GroupVersionResource, Status
from gateway.dispatch.report import DispatchReport, InvocationRecord
from gateway.observability import logs
from gateway.observability.logs import configure_logging, flush_logs
from gateway.observability.metrics import Metrics
from gateway.observability.observer import Observability
from gateway.tracing import current_trace

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclass
class Inbound:
    uid: str
    api_version: str
    attributes: AdmissionAttributes


@dataclass
class Verdict:
    allowed: bool
    status: Status | None = None
    patch: bytes | None = None
    warnings: list[str] = field(default_factory=list)
    report: DispatchReport | None = None


def make_review(backends: int = 5) -> tuple[Inbound, Verdict]:
    attrs = AdmissionAttributes(
        uid="705ab4f5-6393-11e8-b7cc-42010a800002",
        operation="CREATE",
        kind=GroupVersionKind("apps", "v1", "Deployment"),
        resource=GroupVersionResource("apps", "v1", "deployments"),
        namespace="team-a",
        name="web",
        object=msgspec.Raw(b'{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"web"}}'),
    )
    report = DispatchReport(kind="validating", operation="CREATE", matched=backends)
    for i in range(backends):
        report.invocations.append(
            InvocationRecord(
                name=f"check-{i}.policy.example.com",
                configuration="policies",
                round=0,
                index=i,
                outcome="allowed",
                code=200,
                duration_seconds=0.0012 + i * 0.0003,
                version="v1",
                backend_uid=attrs.uid,
            )
        )
    return Inbound(attrs.uid, "admission.k8s.io/v1", attrs), Verdict(True, report=report)


def measure(obs: Observability, inbound: Inbound, verdict: Verdict, n: int) -> float:
    """Best of 5 runs, microseconds per review."""
    best = float("inf")
    started_fn = obs.review_started
    finished_fn = obs.review_finished
    for _ in range(5):
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(n):
            started_fn("validating")
            finished_fn(
                "validating",
                code=200,
                seconds=0.0045,
                inbound=inbound,
                verdict=verdict,
                trace=TRACEPARENT,
            )
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.devnull, help="where log lines go")
    parser.add_argument("-n", type=int, default=20000, help="reviews per run")
    parser.add_argument("--backends", default="1,5", help="backends per review, comma-separated")
    parser.add_argument("--pipe", action="store_true", help="log to a pipe another process drains")
    parser.add_argument("--runs", type=int, default=5, help="--pipe: runs per row (best of)")
    args = parser.parse_args()
    if args.pipe:
        for backends in (int(b) for b in args.backends.split(",")):
            run_pipe(args, backends)
        return
    out: Any = open(args.output, "w", encoding="utf-8")  # noqa: SIM115 - open for the whole run
    for backends in (int(b) for b in args.backends.split(",")):
        run(args, out, backends)


def run(args: argparse.Namespace, out: Any, backends: int) -> None:
    inbound, verdict = make_review(backends)
    rows: list[tuple[str, float]] = []

    def row(label: str, obs: Observability, n: int = args.n) -> None:
        rows.append((label, measure(obs, inbound, verdict, n)))

    configure_logging("info", "json", stream=out)
    row("nothing (metrics off, review log off)", Observability(None, review_log=False))
    row("metrics only", Observability(Metrics(), review_log=False))
    row("review log only (json)", Observability(None))
    row("metrics + review log (json)", Observability(Metrics()))
    # As in the server: the review's trace is bound to the context by tracing.start_review_trace.
    token = current_trace.set(("0af7651916cd43dd8448eb211c80319c", "01"))
    row("metrics + review log (json), trace bound in context", Observability(Metrics()))
    current_trace.reset(token)
    configure_logging("info", "console", stream=out)
    row("review log only (console)", Observability(None))
    row("metrics + review log (console)", Observability(Metrics()))
    configure_logging("warning", "json", stream=out)
    row("metrics + review log, level=warning (line filtered)", Observability(Metrics()))

    # Reference: structlog's stock JSON chain (json.dumps, ISO TimeStamper, stack/exception helpers).
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.dev.set_exc_info,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    row("reference: review log with structlog's stock JSON chain", Observability(None), args.n // 4)

    width = max(len(r[0]) for r in rows)
    plural = "" if backends == 1 else "s"
    print(f"µs per review ({backends} backend{plural}), best of 5 x {args.n}; output={args.output}")
    for label, micros in rows:
        print(f"  {label:<{width}}  {micros:7.2f}")


def run_pipe(args: argparse.Namespace, backends: int) -> None:
    """Log lines to a pipe drained by another process: written at once per line, or through the sink.

    Two workloads: the logger call alone with an already rendered line (the output's own cost), and
    the canonical line of a review (``review_finished``, review log only). Columns: wall time and CPU
    time of the logging thread per line, CPU time of the whole process per line (the writer thread
    included: each run ends with a flush), lines dropped (must be 0: runs stay under the bound).
    """
    inbound, verdict = make_review(backends)
    read_end, write_end = os.pipe()
    reader = subprocess.Popen(
        [sys.executable, "-c", "import os\nwhile os.read(0, 1 << 20): pass"], stdin=read_end
    )
    os.close(read_end)
    out = open(write_end, "w", encoding="utf-8")  # noqa: SIM115 - open for the whole run
    observer: list[Observability] = []  # made anew for every configuration: it keeps its logger
    rendered = msgspec.json.encode({"timestamp": "2026-11-24T13:44:52.123456Z", "level": "info",
                                    "event": "review", "pad": "x" * 600})  # fmt: skip

    def review() -> None:
        obs = observer[0]
        obs.review_started("validating")
        obs.review_finished(
            "validating", code=200, seconds=0.0045, inbound=inbound, verdict=verdict, trace=TRACEPARENT
        )

    try:
        print(
            f"per line, {backends} backend(s), to a pipe another process drains; best of {args.runs} x "
            f"{args.n} lines (µs)"
        )
        print(f"  {'':<58}{'wall':>7}{'thread CPU':>12}{'process CPU':>13}{'dropped':>9}")
        for workload in ("logger call, rendered line", "canonical line of a review"):
            for label, background in (("written at once (before)", False), ("background sink (after)", True)):
                configure_logging("info", "json", stream=out, background=background)
                raw: Any = structlog.get_config()["logger_factory"]()
                observer[:] = [Observability(None)]
                call = review if workload.startswith("canonical") else partial(raw.info, rendered)
                best = [float("inf")] * 3
                for _ in range(args.runs):
                    gc.collect()
                    flush_logs(30.0)
                    t0, th0, cpu0 = time.perf_counter(), time.thread_time(), time.process_time()
                    for _ in range(args.n):
                        call()
                    wall, thread = time.perf_counter() - t0, time.thread_time() - th0
                    flush_logs(30.0)
                    cpu = time.process_time() - cpu0
                    for i, value in enumerate((wall, thread, cpu)):
                        best[i] = min(best[i], value / args.n * 1e6)
                dropped = getattr(logs._sink, "dropped", 0)
                name = f"{workload}, {label}"
                print(f"  {name:<58}{best[0]:7.2f}{best[1]:12.2f}{best[2]:13.2f}{dropped:9d}")
        configure_logging("info", "json")  # closes the sink
    finally:
        out.close()
        reader.wait()


if __name__ == "__main__":
    main()
