"""Cost of observing one review: ``Observability.review_started`` + ``review_finished``.

A realistic review: a validating fan-out over 5 backends, and the common case of one backend (all
allowed, v1, backend uids, a traceparent), as the server reports it after answering. Measured with
metrics on/off and the canonical log line on/off, JSON and console, plus the cost when the info level
is filtered out.

    cd <worktree> && /work/venv/bin/python benchmarks/bench_observability.py \
        [--output PATH] [-n N] [--backends 1,5]

Log lines go to ``--output`` (default /dev/null: the write syscall is still made). This is a
script, not a test: it configures structlog globally, as ``__main__`` does.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec
import structlog

from gateway.admission import AdmissionAttributes, GroupVersionKind, GroupVersionResource, Status
from gateway.dispatch.report import DispatchReport, InvocationRecord
from gateway.observability.logs import configure_logging
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
