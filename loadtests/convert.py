"""``python -m loadtests convert``: CRD conversion through the gateway vs the conversion backend directly.

Starts the sample backend fleet (one process; its ``/convert`` path is the sample conversion webhook)
and the gateway (another process) with two CRDs pointing at it: one plain, one with the conversion
cache on. For each review size (1, 10 and 500 CronTab objects per ConversionReview: 500 is a LIST)
it drives, in the same run and with the same load, three phases: **direct** (the backend alone),
**gateway** (every object converted by the backend through the gateway) and **gateway+cache** (the
same reviews again, so after the first one every object is a cache hit: the cache's best case).
The report gives throughput, latency and the gateway's CPU per review (``/proc/<pid>/stat`` of the
one gateway process) per phase, and the gateway/direct ratios. ``--baseline-tree DIR`` also starts
the gateway of another source checkout beside this one (same backend, same load, its phases
interleaved with this one's) and adds a ``÷ baseline`` row per review size: CPU per review and p50
of this gateway against that one's. ``--repeat N`` runs everything N times and reports the median of
each figure. Every answer is verified (HTTP 200, uid echoed, ``Success``, the right number of
objects in the desired version).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio
import yaml

from loadtests.client import ConnectionLostError, Endpoint, Http1Connection, client_context
from loadtests.drive import drive_closed_loop
from loadtests.processes import (
    Certs,
    fleet_ports,
    free_port,
    managed,
    proc_cpu_seconds,
    spawn_fleet,
    spawn_gateway,
    tree_revision,
    wait_ready,
)
from loadtests.stats import Recorder, percentile

PLAIN = "crontabs.stable.example.com"
CACHED = "cachedtabs.stable.example.com"
DESIRED = "stable.example.com/v2"


def _crd(name: str, url: str, ca_pem: bytes | None, cache: bool) -> dict[str, Any]:
    plural, _, group = name.partition(".")
    client_config: dict[str, Any] = {"url": url}
    if ca_pem:
        import base64

        client_config["caBundle"] = base64.b64encode(ca_pem).decode()
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": name,
            "annotations": {"webhook-gateway.io/conversion-cache": "true" if cache else "false"},
        },
        "spec": {
            "group": group,
            "names": {"plural": plural, "kind": "CronTab"},
            "scope": "Namespaced",
            "versions": [{"name": "v1", "served": True, "storage": True}, {"name": "v2", "served": True}],
            "conversion": {
                "strategy": "Webhook",
                "webhook": {"clientConfig": client_config, "conversionReviewVersions": ["v1"]},
            },
        },
    }


def review(objects: int) -> bytes:
    """A ConversionReview of ``objects`` CronTabs (about 400 bytes each), v1 to v2."""
    items = [
        {
            "apiVersion": "stable.example.com/v1",
            "kind": "CronTab",
            "metadata": {
                "name": f"job-{i:04d}",
                "namespace": "loadtest",
                "uid": str(uuid.UUID(int=i)),
                "resourceVersion": str(1000 + i),
                "labels": {"app": "loadtest", "shard": str(i % 7)},
            },
            "spec": {"cronSpec": f"{i % 60} * * * *", "image": "registry.example.com/jobs/cron:1.2.3"},
        }
        for i in range(objects)
    ]
    doc = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "request": {"uid": str(uuid.uuid4()), "desiredAPIVersion": DESIRED, "objects": items},
    }
    return msgspec.json.encode(doc)


class _Answer(msgspec.Struct):
    class _Response(msgspec.Struct, rename="camel"):
        uid: str = ""
        result: dict[str, Any] = msgspec.field(default_factory=dict)
        converted_objects: list[msgspec.Raw] = msgspec.field(default_factory=list)

    response: _Response | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


def check(status: int, body: bytes, uid: str, objects: int) -> str | None:
    """None when the answer is right, else the error kind."""
    if status != 200:
        return f"http-{status}"
    try:
        answer = _decode_answer(body)
    except msgspec.DecodeError:
        return "undecodable"
    r = answer.response
    if r is None or r.uid != uid:
        return "wrong-uid"
    if r.result.get("status") != "Success":
        return "failure"
    if len(r.converted_objects) != objects:
        return "wrong-count"
    if objects and DESIRED.encode() not in bytes(r.converted_objects[0]):
        return "not-converted"
    return None


@dataclass
class Phase:
    name: str
    objects: int
    rps: float
    p50_ms: float
    p99_ms: float
    ok: int
    errors: dict[str, int] = field(default_factory=dict)
    cpu_us: float | None = None  # the gateway's CPU per review (None: no gateway in the phase)


async def measure(
    name: str,
    endpoint: Endpoint,
    path: str,
    objects: int,
    *,
    workers: int,
    duration: float,
    warmup: float,
    pid: int | None = None,
) -> Phase:
    """A closed loop of ``workers`` keep-alive HTTP/1.1 clients posting the same review; ``pid``:
    the gateway process whose CPU per review is measured over the phase."""
    body = review(objects)
    uid = json.loads(body)["request"]["uid"]
    conns = [await Http1Connection.open(endpoint) for _ in range(workers)]
    rec = Recorder()
    measuring = [False]

    async def handle(worker: int, _intended: float) -> None:
        started = trio.current_time()
        try:
            status, answer = await conns[worker].request(path.encode(), body)
        except ConnectionLostError:
            rec.error("connection-lost")
            conns[worker] = await Http1Connection.open(endpoint)
            return
        if not measuring[0]:
            return
        problem = check(status, answer, uid, objects)
        if problem is None:
            rec.ok(trio.current_time() - started)
        else:
            rec.error(problem)

    if warmup > 0:
        await drive_closed_loop(workers, warmup, None, handle)
    measuring[0] = True
    cpu_before = proc_cpu_seconds(pid) if pid is not None else 0.0
    rec.started = trio.current_time()
    await drive_closed_loop(workers, duration, None, handle)
    rec.finished = trio.current_time()
    cpu = proc_cpu_seconds(pid) - cpu_before if pid is not None else None
    for conn in conns:
        await conn.aclose()
    latencies = sorted(rec.all_latencies())
    elapsed = max(rec.finished - rec.started, 1e-9)
    return Phase(
        name,
        objects,
        rec.ok_count / elapsed,
        percentile(latencies, 50) * 1000,
        percentile(latencies, 99) * 1000,
        rec.ok_count,
        dict(rec.errors),
        cpu / rec.ok_count * 1e6 if cpu is not None and rec.ok_count else None,
    )


async def run(args: argparse.Namespace, say: Any) -> list[Phase]:
    with tempfile.TemporaryDirectory(prefix="convert-loadtest-") as tmp:
        work = Path(tmp)
        certs = Certs.create(work) if args.tls else None
        with managed(spawn_fleet(1, certs, http1_only=True)) as fleet:
            (backend_port,) = await fleet_ports(fleet)
            scheme = "https" if certs else "http"
            backend_url = f"{scheme}://127.0.0.1:{backend_port}/convert"
            config = work / "config"
            config.mkdir()
            ca = certs.ca_pem if certs else None
            docs = [_crd(PLAIN, backend_url, ca, cache=False), _crd(CACHED, backend_url, ca, cache=True)]
            (config / "crds.yaml").write_text(yaml.safe_dump_all(docs))
            extra = ["--no-review-log", "--log-level", "warning", *args.gateway_arg]
            ctx = client_context(certs.ca_pem, "http1") if certs else None
            direct, _ = Endpoint.parse(backend_url, ctx)
            with ExitStack() as stack:
                gateways: dict[str, tuple[Endpoint, int]] = {}
                trees = {"gateway": None, "baseline": args.baseline_tree}
                for name, tree in trees.items():
                    if name == "baseline" and tree is None:
                        continue
                    port = free_port()
                    log = work / f"{name}.log"
                    proc = stack.enter_context(
                        managed(spawn_gateway(config, port, certs, log, extra, tree=tree))
                    )
                    endpoint, _ = Endpoint.parse(f"{scheme}://127.0.0.1:{port}/", ctx)
                    await wait_ready(endpoint, proc)
                    gateways[name] = (endpoint, proc.pid)
                phases = []
                for n in args.objects:
                    plan: list[tuple[str, Endpoint, str, int | None]] = [
                        ("direct", direct, "/convert?timeout=30s", None)
                    ]
                    for name, (endpoint, pid) in gateways.items():
                        plan.append((name, endpoint, f"/convert/{PLAIN}?timeout=30s", pid))
                    gw, gw_pid = gateways["gateway"]
                    plan.append(("gateway+cache", gw, f"/convert/{CACHED}?timeout=30s", gw_pid))
                    for name, endpoint, path, pid in plan:
                        say(f"convert: {n} object(s) per review, {name} ...")
                        phases.append(
                            await measure(
                                name,
                                endpoint,
                                path,
                                n,
                                workers=args.concurrency,
                                duration=args.duration,
                                warmup=args.warmup,
                                pid=pid,
                            )
                        )
                return phases


def median_phases(runs: list[list[Phase]]) -> list[Phase]:
    """Per phase (same place in every run), the median of each figure over the runs."""
    if len(runs) == 1:
        return runs[0]
    out = []
    for same in zip(*runs, strict=True):
        cpus = [p.cpu_us for p in same if p.cpu_us is not None]
        errors: dict[str, int] = {}
        for p in same:
            for kind, count in p.errors.items():
                errors[kind] = errors.get(kind, 0) + count
        out.append(
            Phase(
                same[0].name,
                same[0].objects,
                statistics.median(p.rps for p in same),
                statistics.median(p.p50_ms for p in same),
                statistics.median(p.p99_ms for p in same),
                sum(p.ok for p in same),
                errors,
                statistics.median(cpus) if cpus else None,
            )
        )
    return out


def table(phases: list[Phase]) -> str:
    by = {(p.objects, p.name): p for p in phases}
    lines = [
        "objects  phase           reviews/s   objects/s   p50 ms   p99 ms"
        "   p50 vs direct   rps vs direct   CPU µs/review  errors",
    ]
    for p in phases:
        d = by.get((p.objects, "direct"))
        ratio = f"{p.p50_ms / d.p50_ms:13.2f}x" if d and d.p50_ms > 0 else " " * 14
        rps = f"{p.rps / d.rps:13.2f}x" if d and d.rps > 0 else " " * 14
        cpu = f"{p.cpu_us:14.0f}" if p.cpu_us is not None else " " * 14
        errors = sum(p.errors.values())
        lines.append(
            f"{p.objects:7d}  {p.name:<14} {p.rps:10.1f}  {p.rps * p.objects:10.0f}  {p.p50_ms:7.2f}  "
            f"{p.p99_ms:7.2f}  {ratio}  {rps}  {cpu}  {errors}"
        )
        b = by.get((p.objects, "baseline"))
        if p.name == "gateway" and b is not None:
            lines.append(_versus_baseline(p, b))
    return "\n".join(lines)


def _versus_baseline(g: Phase, b: Phase) -> str:
    """This checkout's gateway ÷ the baseline checkout's, same size and load: p50, rps and CPU."""
    p50 = f"{g.p50_ms / b.p50_ms:13.2f}x" if b.p50_ms > 0 else " " * 14
    rps = f"{g.rps / b.rps:13.2f}x" if b.rps > 0 else " " * 14
    cpu = f"{g.cpu_us / b.cpu_us:13.2f}x" if g.cpu_us and b.cpu_us else " " * 14
    return f"{g.objects:7d}  {'÷ baseline':<14} {'':10}  {'':10}  {'':7}  {'':7}  {p50}  {rps}  {cpu}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests convert", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measured phase (default 5)")
    p.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each phase")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default 8)")
    p.add_argument(
        "--objects",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 10, 500],
        help="objects per review, comma-separated (default 1,10,500)",
    )
    p.add_argument("--tls", action=argparse.BooleanOptionalAction, default=True, help="TLS on both sides")
    p.add_argument("--quick", action="store_true", help="1 s phases: a correctness smoke")
    p.add_argument("--json", type=Path, help="write the phases as JSON")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra argument for python -m gateway")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        help="also run the gateway of this source checkout beside this one; a '÷ baseline' row compares them",
    )
    p.add_argument("--repeat", type=int, default=1, help="run everything N times, report medians (default 1)")
    args = p.parse_args(argv)
    if args.baseline_tree is not None:
        args.baseline_tree = args.baseline_tree.resolve()
        if not (args.baseline_tree / "gateway" / "__main__.py").is_file():
            p.error(f"--baseline-tree {args.baseline_tree}: no gateway/__main__.py there (a source checkout)")
    if args.quick:
        args.duration, args.warmup = min(args.duration, 1.0), min(args.warmup, 0.2)
        args.concurrency = min(args.concurrency, 4)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        runs = []
        for i in range(max(1, args.repeat)):
            if args.repeat > 1:
                say(f"convert: repeat {i + 1} of {args.repeat}")
            runs.append(trio.run(run, args, say))
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 2
    phases = median_phases(runs)
    if args.repeat > 1:
        print(f"medians of {args.repeat} repeats")
    if args.baseline_tree is not None:
        revision = tree_revision(args.baseline_tree)
        print(f"baseline: the gateway of {args.baseline_tree} ({revision}), run beside it")
    print(table(phases))
    if args.json:
        args.json.write_text(json.dumps([p.__dict__ for p in phases], indent=2))
    return 1 if any(p.errors or not p.ok for p in phases) else 0
