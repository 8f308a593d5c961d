"""``python -m loadtests endpoints``: a service backend balanced over its pods vs pinned to one pod.

Three backend "pods" run as separate processes on 127.0.0.2, 127.0.0.3 and 127.0.0.4, each serving
TLS with a certificate for the service name ``hook.loadtest.svc``. A fake kube-apiserver (the one
the tests use, ``tests/support/kubeapi.py``, run in this process: it serves only the list/watch the
gateway asks for) announces them as the EndpointSlices of that service. Two phases, same load:

- **balanced**: the webhook is a ``clientConfig.service`` reference and the gateway has cluster
  access (``--namespace-source cluster --kubeconfig …``): each call goes to one of the ready pods
  (power of two choices), TLS verified against the service name;
- **pinned** (the feature off): what a keep-alive connection to one DNS name gives without it,
  every call to the same pod (``clientConfig.url`` of the first pod).

The report gives throughput, latency and each pod's share of the backend CPU (each pod is its own
process, so its CPU time is its share of the calls). Every answer is verified (HTTP 200, uid
echoed, allowed).
"""

from __future__ import annotations

import argparse
import base64
import json
import ssl
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import yaml

from loadtests.client import ConnectionLostError, Endpoint, Http1Connection, client_context
from loadtests.drive import drive_closed_loop
from loadtests.fixtures import review_templates
from loadtests.processes import (
    Certs,
    _env,
    fleet_ports,
    free_port,
    managed,
    proc_cpu_seconds,
    spawn_gateway,
    wait_ready,
)
from loadtests.stats import Recorder, percentile

PODS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
NAMESPACE, SERVICE = "loadtest", "hook"
SERVICE_DNS = f"{SERVICE}.{NAMESPACE}.svc"
WEBHOOK = "balanced.loadtest.webhook-gateway.dev"


@dataclass
class Phase:
    name: str
    rps: float
    p50_ms: float
    p99_ms: float
    ok: int
    shares: list[float]  # each pod's share of the backend CPU
    errors: dict[str, int] = field(default_factory=dict)


def _spawn_pod(host: str, certfile: Path, keyfile: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "gateway.devtools.backends", "--host", host, "--http1-only"]
    cmd += ["--certfile", str(certfile), "--keyfile", str(keyfile)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, env=_env())  # noqa: S603  # our interpreter, list argv


def _config(directory: Path, client_config: dict[str, Any]) -> None:
    doc = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "loadtest-endpoints"},
        "webhooks": [
            {
                "name": WEBHOOK,
                "clientConfig": client_config,
                "rules": [
                    {
                        "operations": ["CREATE", "UPDATE"],
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods"],
                    }
                ],
                "failurePolicy": "Fail",
                "matchPolicy": "Exact",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 10,
            }
        ],
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "webhooks.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def _check(status: int, body: bytes, uid: str) -> str | None:
    if status != 200:
        return f"http-{status}"
    try:
        response = json.loads(body)["response"]
    except (ValueError, KeyError, TypeError):
        return "undecodable"
    if response.get("uid") != uid:
        return "wrong-uid"
    return None if response.get("allowed") is True else "denied"


async def _measure(
    name: str, gateway: Endpoint, pods: list[subprocess.Popen[bytes]], args: argparse.Namespace
) -> Phase:
    template = review_templates(8, "v1")[0]
    conns = [await Http1Connection.open(gateway) for _ in range(args.concurrency)]
    rec = Recorder()
    measuring = [False]

    async def handle(worker: int, _intended: float) -> None:
        uid = str(uuid.uuid4())
        started = trio.current_time()
        try:
            status, answer = await conns[worker].request(b"/validate?timeout=10s", template.body(uid))
        except ConnectionLostError:
            rec.error("connection-lost")
            conns[worker] = await Http1Connection.open(gateway)
            return
        if not measuring[0]:
            return
        problem = _check(status, answer, uid)
        if problem is None:
            rec.ok(trio.current_time() - started)
        else:
            rec.error(problem)

    if args.warmup > 0:
        await drive_closed_loop(args.concurrency, args.warmup, None, handle)
    cpu_before = [proc_cpu_seconds(p.pid) for p in pods]
    measuring[0] = True
    rec.started = trio.current_time()
    await drive_closed_loop(args.concurrency, args.duration, None, handle)
    rec.finished = trio.current_time()
    cpu = [proc_cpu_seconds(p.pid) - before for p, before in zip(pods, cpu_before, strict=True)]
    for conn in conns:
        await conn.aclose()
    latencies = sorted(rec.all_latencies())
    elapsed = max(rec.finished - rec.started, 1e-9)
    total = sum(cpu) or 1e-9
    return Phase(
        name,
        rec.ok_count / elapsed,
        percentile(latencies, 50) * 1000,
        percentile(latencies, 99) * 1000,
        rec.ok_count,
        [c / total for c in cpu],
        dict(rec.errors),
    )


async def run(args: argparse.Namespace, say: Any) -> list[Phase]:
    import trustme

    try:  # the fake kube-apiserver of the tests: real wire format, only what the gateway asks
        from tests.support.kubeapi import FakeKubeAPI, write_kubeconfig
    except ImportError as exc:  # pragma: no cover - run from a checkout with the [test] extra
        raise RuntimeError(f"the endpoints scenario needs tests/support (a source checkout): {exc}") from exc

    with tempfile.TemporaryDirectory(prefix="endpoints-loadtest-") as tmp:
        work = Path(tmp)
        ca = trustme.CA()
        leaf = ca.issue_cert(SERVICE_DNS, *PODS)
        pod_cert, pod_key = work / "pod.pem", work / "pod-key.pem"
        leaf.private_key_pem.write_to_path(str(pod_key))
        pod_cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        bundle = base64.b64encode(ca.cert_pem.bytes()).decode()
        gw_certs = Certs.create(work)
        async with trio.open_nursery() as nursery:
            api = FakeKubeAPI()
            api.put(NAMESPACE, {})
            api_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            api.ca.issue_cert("127.0.0.1").configure_cert(api_ctx)
            listeners = await trio.open_ssl_over_tcp_listeners(0, api_ctx, host="127.0.0.1")
            await nursery.start(trio.serve_listeners, api.handle, listeners)
            api.port = listeners[0].transport_listener.socket.getsockname()[1]
            kubeconfig = write_kubeconfig(api, work / "kubeconfig")
            say(f"starting {len(PODS)} backend pods on {', '.join(PODS)} …")
            with (
                managed(_spawn_pod(PODS[0], pod_cert, pod_key)) as p0,
                managed(_spawn_pod(PODS[1], pod_cert, pod_key)) as p1,
                managed(_spawn_pod(PODS[2], pod_cert, pod_key)) as p2,
            ):
                pods = [p0, p1, p2]
                ports = [(await fleet_ports(p))[0] for p in pods]
                for i, (host, port) in enumerate(zip(PODS, ports, strict=True)):
                    api.put_slice(NAMESPACE, f"{SERVICE}-{i}", SERVICE, port, [(host, True, False)])
                phases = []
                service = {"namespace": NAMESPACE, "name": SERVICE, "path": args.path}
                for name, client_config, extra in (
                    (
                        "balanced",
                        {"service": service, "caBundle": bundle},
                        ["--namespace-source", "cluster", "--kubeconfig", str(kubeconfig)],
                    ),
                    ("pinned", {"url": f"https://{PODS[0]}:{ports[0]}{args.path}", "caBundle": bundle}, []),
                ):
                    config = work / f"config-{name}"
                    _config(config, client_config)
                    port = free_port()
                    flags = ["--no-review-log", "--log-level", "warning", *extra, *args.gateway_arg]
                    log = work / f"gateway-{name}.log"
                    with managed(spawn_gateway(config, port, gw_certs, log, flags)) as gateway:
                        ctx = client_context(gw_certs.ca_pem, "http1")
                        endpoint, _ = Endpoint.parse(f"https://127.0.0.1:{port}/", ctx)
                        await wait_ready(endpoint, gateway)
                        say(f"endpoints: {name} …")
                        phases.append(await _measure(name, endpoint, pods, args))
            nursery.cancel_scope.cancel()
        return phases


def table(phases: list[Phase]) -> str:
    lines = ["phase       reviews/s   p50 ms   p99 ms  backend CPU share per pod (127.0.0.2/.3/.4)  errors"]
    for p in phases:
        shares = " / ".join(f"{s * 100:4.0f} %" for s in p.shares)
        errors = sum(p.errors.values())
        lines.append(f"{p.name:<10} {p.rps:10.1f}  {p.p50_ms:7.2f}  {p.p99_ms:7.2f}  {shares:<44} {errors}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests endpoints", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measured phase (default 5)")
    p.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each phase")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default 8)")
    p.add_argument("--path", default="/allow", help="the backend path (default /allow)")
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
