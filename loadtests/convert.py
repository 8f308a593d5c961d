"""``python -m loadtests convert``: CRD conversion through the gateway vs the conversion backend directly.

Starts the sample backend fleet (one process; its ``/convert`` path is the sample conversion webhook)
and the gateway (another process) with two CRDs pointing at it: one plain, one with the conversion
cache on. For each review size (1, 10 and 500 CronTab objects per ConversionReview: 500 is a LIST)
it drives, in the same run and with the same load, three phases: **direct** (the backend alone),
**gateway** (every object converted by the backend through the gateway) and **gateway+cache** (the
same reviews again, so after the first one every object is a cache hit: the cache's best case).
The report gives throughput and latency per phase and the gateway/direct ratios. Every answer is
verified (HTTP 200, uid echoed, ``Success``, the right number of objects in the desired version).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio
import yaml

from loadtests.client import ConnectionLostError, Endpoint, Http1Connection, client_context
from loadtests.drive import drive_closed_loop
from loadtests.processes import Certs, fleet_ports, free_port, managed, spawn_fleet, spawn_gateway, wait_ready
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


async def measure(
    name: str, endpoint: Endpoint, path: str, objects: int, *, workers: int, duration: float, warmup: float
) -> Phase:
    """A closed loop of ``workers`` keep-alive HTTP/1.1 clients posting the same review."""
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
    rec.started = trio.current_time()
    await drive_closed_loop(workers, duration, None, handle)
    rec.finished = trio.current_time()
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
            port = free_port()
            extra = ["--no-review-log", "--log-level", "warning", *args.gateway_arg]
            with managed(spawn_gateway(config, port, certs, work / "gateway.log", extra)) as gateway:
                ctx = client_context(certs.ca_pem, "http1") if certs else None
                gw, _ = Endpoint.parse(f"{scheme}://127.0.0.1:{port}/", ctx)
                direct, _ = Endpoint.parse(backend_url, ctx)
                await wait_ready(gw, gateway)
                phases = []
                for n in args.objects:
                    for name, endpoint, path in (
                        ("direct", direct, "/convert?timeout=30s"),
                        ("gateway", gw, f"/convert/{PLAIN}?timeout=30s"),
                        ("gateway+cache", gw, f"/convert/{CACHED}?timeout=30s"),
                    ):
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
                            )
                        )
                return phases


def table(phases: list[Phase]) -> str:
    by = {(p.objects, p.name): p for p in phases}
    lines = [
        "objects  phase           reviews/s   objects/s   p50 ms   p99 ms"
        "   p50 vs direct   rps vs direct  errors",
    ]
    for p in phases:
        d = by.get((p.objects, "direct"))
        ratio = f"{p.p50_ms / d.p50_ms:13.2f}x" if d and d.p50_ms > 0 else " " * 14
        rps = f"{p.rps / d.rps:13.2f}x" if d and d.rps > 0 else " " * 14
        errors = sum(p.errors.values())
        lines.append(
            f"{p.objects:7d}  {p.name:<14} {p.rps:10.1f}  {p.rps * p.objects:10.0f}  {p.p50_ms:7.2f}  "
            f"{p.p99_ms:7.2f}  {ratio}  {rps}  {errors}"
        )
    return "\n".join(lines)


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
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.warmup = min(args.duration, 1.0), min(args.warmup, 0.2)
        args.concurrency = min(args.concurrency, 4)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        phases = trio.run(run, args, say)
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 2
    print(table(phases))
    if args.json:
        args.json.write_text(json.dumps([p.__dict__ for p in phases], indent=2))
    return 1 if any(p.errors or not p.ok for p in phases) else 0
