"""What the gateway adds to API latency, measured through a real kube-apiserver (issue §6, §7).

``python -m loadtests.apiserver latency`` starts etcd + kube-apiserver from ``KUBEBUILDER_ASSETS``
(tests/support/controlplane.py: run it from a checkout), the sample backends over TLS and the
gateway, then creates ConfigMaps through the apiserver with the admin token — open loop, at a fixed
rate, over keep-alive HTTPS connections opened on demand (kubectl would be the bottleneck) — for N
validating webhooks (``--backends 1,5``) registered **directly** and then **behind the gateway**
(``webhook-gateway registration --url``). Per phase: API request p50/p99 (measured from each
request's scheduled start, so queueing counts) and the CPU of kube-apiserver and of the gateway per
request (``/proc/<pid>/stat`` before and after).

``python -m loadtests.apiserver reload`` measures how long a configuration change takes to be in
force, seen through the apiserver: a backend flipped between allow and deny, then dry-run creates
every few milliseconds until the answer flips. Modes: ``direct`` (the webhook configuration
replaced through the API, as ``kubectl apply`` does), ``file`` (a new file renamed into the
gateway's configuration directory) and ``configmap`` (the kubelet's ``..data`` symlink swap).
``--gateway-tree DIR`` runs another checkout's gateway (for before/after numbers).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio
import yaml

from loadtests.processes import proc_cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/support: the control plane and the process helpers

from tests.support.controlplane import ControlPlane, start_control_plane  # noqa: E402
from tests.support.processes import (  # noqa: E402
    Backends,
    GatewayProcess,
    TLSFiles,
    start_backends,
    start_gateway_process,
)
from tests.support.tools import KUBE_ASSETS_ENV  # noqa: E402

NAMESPACE = "load"


# --- a small open-loop HTTPS client for the apiserver ------------------------------------------------


class APIConnection:
    """One keep-alive HTTP/1.1 connection over TLS to the apiserver."""

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int, context: ssl.SSLContext) -> APIConnection:
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        tls = trio.SSLStream(tcp, context, server_hostname="127.0.0.1", https_compatible=True)
        await tls.do_handshake()
        return cls(tls)

    async def request(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, bytes]:
        events = [
            h11.Request(method=method, target=target, headers=headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ]
        await self.stream.send_all(b"".join(self.conn.send(e) or b"" for e in events))
        status, chunks = 0, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.conn.start_next_cycle()
                return status, b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise trio.BrokenResourceError("closed by the apiserver")


@dataclass
class APIClient:
    """Requests with the admin token over a pool of connections that grows on demand."""

    plane: ControlPlane
    idle: list[APIConnection] = field(default_factory=list)
    opened: int = 0

    def __post_init__(self) -> None:
        self.context = ssl.create_default_context(cafile=str(self.plane.ca_path))
        self.port = int(self.plane.url.rsplit(":", 1)[1])
        self.headers = [
            ("Host", f"127.0.0.1:{self.port}"),
            ("Authorization", f"Bearer {self.plane.token}"),
            ("Content-Type", "application/json"),
            ("Accept", "application/json"),
        ]

    async def call(self, method: str, target: str, body: Any) -> tuple[int, bytes]:
        data = json.dumps(body).encode()
        connection = self.idle.pop() if self.idle else None
        if connection is None:
            connection = await APIConnection.open(self.port, self.context)
            self.opened += 1
        headers = [*self.headers, ("Content-Length", str(len(data)))]
        status, reply = await connection.request(method, target, headers, data)
        self.idle.append(connection)
        return status, reply


# --- the cluster side ---------------------------------------------------------------------------------


def _hook(name: str, url: str, ca: bytes) -> dict[str, Any]:
    return {
        "name": name,
        "clientConfig": {"url": url, "caBundle": base64.b64encode(ca).decode()},
        "rules": [
            {"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"]}
        ],
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "failurePolicy": "Fail",
        "timeoutSeconds": 10,
    }


def backend_config(backends: Backends, count: int, path: str = "/allow") -> dict[str, Any]:
    ca = backends.tls.ca.cert_pem.bytes()
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": f"backends-{count}"},
        "webhooks": [_hook(f"b{i}.load.example.com", backends.url(path), ca) for i in range(count)],
    }


@dataclass
class Bed:
    """Control plane, backends and scratch space for one run."""

    workdir: Path
    plane: ControlPlane
    tls: TLSFiles
    backends: Backends
    gateway_tree: Path | None

    def stop(self) -> None:
        self.backends.stop()
        self.plane.stop()

    def apply(self, doc: dict[str, Any] | str) -> None:
        text = doc if isinstance(doc, str) else json.dumps(doc)
        self.plane.kubectl("apply", "-f", "-", input=text)

    def delete(self, doc: dict[str, Any] | str) -> None:
        text = doc if isinstance(doc, str) else json.dumps(doc)
        self.plane.kubectl("delete", "--ignore-not-found", "-f", "-", input=text)

    def start_gateway(self, config: Path) -> GatewayProcess:
        return start_gateway_process(
            self.workdir, config, self.tls,
            "--namespace-source", "cluster", "--kubeconfig", str(self.plane.kubeconfig),
            "--log-level", "warning", "--no-review-log",
            tree=self.gateway_tree,
        )  # fmt: skip

    def gateway_registration(self, config: Path, gateway: GatewayProcess) -> str:
        return subprocess.run(  # noqa: S603 - this interpreter, our own arguments
            [
                sys.executable, "-m", "gateway", "registration", "--config", str(config), "--name", "gateway",
                "--url", gateway.url, "--ca-bundle", str(self.tls.ca_path),
            ],
            capture_output=True, text=True, check=True, timeout=60, cwd=ROOT,
        ).stdout  # fmt: skip


def start_bed(gateway_tree: Path | None) -> Bed:
    assets = os.environ.get(KUBE_ASSETS_ENV)
    if not assets:
        sys.exit(f"set {KUBE_ASSETS_ENV} to the directory of etcd, kube-apiserver and kubectl")
    workdir = Path(tempfile.mkdtemp(prefix="webhook-gateway-apiserver-"))
    plane = start_control_plane(workdir / "plane", assets=Path(assets))
    try:
        tls = TLSFiles(workdir / "tls")
        backends = start_backends(workdir, tls)
    except BaseException:
        plane.stop()
        raise
    plane.create_namespace(NAMESPACE)
    return Bed(workdir, plane, tls, backends, gateway_tree)


# --- latency (§7) -------------------------------------------------------------------------------------


@dataclass
class Phase:
    mode: str
    backends: int
    rate: float
    latencies: list[float]
    errors: int
    apiserver_cpu: float
    gateway_cpu: float | None

    def row(self) -> str:
        ms = sorted(x * 1000 for x in self.latencies)
        p50, p99 = _percentile(ms, 50), _percentile(ms, 99)
        n = len(self.latencies) + self.errors
        gateway = "—" if self.gateway_cpu is None else f"{self.gateway_cpu / n * 1e3:.2f}"
        apiserver = f"{self.apiserver_cpu / n * 1e3:.2f}"
        cells = [self.mode, self.backends, f"{self.rate:g}/s", n, self.errors, f"{p50:.1f}", f"{p99:.1f}"]
        return "| " + " | ".join(str(c) for c in [*cells, apiserver, gateway]) + " |"


def _percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return math.nan
    rank = max(0, math.ceil(p / 100 * len(sorted_values)) - 1)
    return sorted_values[rank]


async def open_loop(client: APIClient, rate: float, seconds: float) -> tuple[list[float], int]:
    """Create ConfigMaps at ``rate`` per second; latency from each request's scheduled start."""
    latencies: list[float] = []
    errors = 0
    target = f"/api/v1/namespaces/{NAMESPACE}/configmaps"

    async def one(scheduled: float) -> None:
        nonlocal errors
        status, _ = await client.call(
            "POST", target, {"metadata": {"generateName": "load-"}, "data": {"k": "v"}}
        )
        if status == 201:
            latencies.append(trio.current_time() - scheduled)
        else:
            errors += 1

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(int(rate * seconds)):
            scheduled = start + i / rate
            await trio.sleep_until(scheduled)
            nursery.start_soon(one, scheduled)
    return latencies, errors


def measure(bed: Bed, mode: str, count: int, *, rate: float, seconds: float, warmup: float) -> Phase:
    config_doc = backend_config(bed.backends, count)
    gateway = None
    if mode == "direct":
        registration: dict[str, Any] | str = config_doc
    else:
        config = bed.workdir / f"config-{count}"
        config.mkdir(exist_ok=True)
        (config / "backends.yaml").write_text(yaml.safe_dump(config_doc))
        gateway = bed.start_gateway(config)
        registration = bed.gateway_registration(config, gateway)
    bed.apply(registration)
    time.sleep(1.0)  # the apiserver's webhook informer picks the registration up
    client = APIClient(bed.plane)
    try:
        trio.run(open_loop, client, rate, warmup)
        apiserver_pid = bed.plane.apiserver.pid  # type: ignore[union-attr]
        before = proc_cpu_seconds(apiserver_pid), gateway and proc_cpu_seconds(gateway.proc.pid)
        latencies, errors = trio.run(open_loop, client, rate, seconds)
        after = proc_cpu_seconds(apiserver_pid), gateway and proc_cpu_seconds(gateway.proc.pid)
    finally:
        bed.delete(registration)
        if gateway is not None:
            gateway.stop()
    gateway_cpu = None if gateway is None else float(after[1] or 0) - float(before[1] or 0)
    return Phase(mode, count, rate, latencies, errors, after[0] - before[0], gateway_cpu)


LATENCY_HEADER = (
    "| registered | webhooks | rate | requests | errors | p50 ms | p99 ms | apiserver CPU ms/request "
    "| gateway CPU ms/request |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def run_latency(args: argparse.Namespace) -> None:
    bed = start_bed(args.gateway_tree)
    print(_machine(), flush=True)
    print(LATENCY_HEADER, flush=True)
    try:
        for repeat in range(args.repeats):
            for count in args.backends:
                for mode in ("direct", "gateway"):
                    phase = measure(
                        bed, mode, count, rate=args.rate, seconds=args.duration, warmup=args.warmup
                    )
                    print(
                        phase.row() + (f" <!-- repeat {repeat + 1} -->" if args.repeats > 1 else ""),
                        flush=True,
                    )
    finally:
        bed.stop()


# --- reload (§6) --------------------------------------------------------------------------------------


async def _probe(client: APIClient) -> bool:
    """One dry-run create: True when allowed."""
    target = f"/api/v1/namespaces/{NAMESPACE}/configmaps?dryRun=All"
    status, _ = await client.call("POST", target, {"metadata": {"generateName": "probe-"}})
    return status == 201


def _until_flip(client: APIClient, allowed: bool, started: float, limit: float = 30.0) -> float:
    async def wait() -> float:
        while await _probe(client) != allowed:
            if time.monotonic() - started > limit:
                return math.inf
            await trio.sleep(0.002)
        return time.monotonic() - started

    return trio.run(wait)


def _swap_configmap_style(directory: Path, text: str, generation: int) -> None:
    """The kubelet's AtomicWriter: a new timestamped directory, ``..data_tmp`` -> rename to ``..data``."""
    stamped = directory / f"..2026_{generation:06d}"
    stamped.mkdir()
    (stamped / "backends.yaml").write_text(text)
    tmp = directory / "..data_tmp"
    tmp.symlink_to(stamped.name)
    old = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    os.rename(tmp, directory / "..data")
    if not (directory / "backends.yaml").is_symlink():
        (directory / "backends.yaml").symlink_to("..data/backends.yaml")
    if old:
        for f in (directory / old).iterdir():
            f.unlink()
        (directory / old).rmdir()


def run_reload(args: argparse.Namespace) -> None:
    bed = start_bed(args.gateway_tree)
    print(_machine(), flush=True)
    print("| mode | changes | median s | min s | max s |\n| --- | --- | --- | --- | --- |", flush=True)
    try:
        for mode in args.modes:
            delays = reload_delays(bed, mode, args.changes)
            finite = [d for d in delays if math.isfinite(d)]
            cells = [f"{statistics.median(delays):.3f}", f"{min(finite):.3f}", f"{max(delays):.3f}"]
            print(f"| {mode} | {len(delays)} | " + " | ".join(cells) + " |", flush=True)
    finally:
        bed.stop()


def reload_delays(bed: Bed, mode: str, changes: int) -> list[float]:
    docs = {
        allowed: backend_config(bed.backends, 1, "/allow" if allowed else "/deny")
        for allowed in (True, False)
    }
    client = APIClient(bed.plane)
    delays = []
    gateway = None
    config = bed.workdir / f"reload-{mode}"
    try:
        if mode == "direct":
            bed.apply(docs[True])
            write: Callable[[bool, int], None] = lambda allowed, _n: bed.apply(docs[allowed])  # noqa: E731
        else:
            config.mkdir()
            if mode == "file":
                (config / "backends.yaml").write_text(yaml.safe_dump(docs[True]))

                def write(allowed: bool, n: int) -> None:
                    tmp = config / f".backends.yaml.{n}"
                    tmp.write_text(yaml.safe_dump(docs[allowed]))
                    os.rename(tmp, config / "backends.yaml")
            else:
                _swap_configmap_style(config, yaml.safe_dump(docs[True]), 0)

                def write(allowed: bool, n: int) -> None:
                    _swap_configmap_style(config, yaml.safe_dump(docs[allowed]), n)

            gateway = bed.start_gateway(config)
            bed.apply(bed.gateway_registration(config, gateway))
        _until_flip(client, True, time.monotonic())  # in force before the first change
        for n in range(1, changes + 1):
            allowed = n % 2 == 0
            time.sleep(0.5 + (n % 3) * 0.37)  # changes at varying phases of any poll
            started = time.monotonic()
            write(allowed, n)
            delays.append(_until_flip(client, allowed, started))
    finally:
        bed.delete(docs[True])
        bed.plane.kubectl(
            "delete",
            "--ignore-not-found",
            "validatingwebhookconfiguration,mutatingwebhookconfiguration",
            "gateway",
        )
        if gateway is not None:
            gateway.stop()
    return delays


# --- command line -------------------------------------------------------------------------------------


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    when = time.strftime("%Y-%m-%d %H:%M")
    python = platform.python_version()
    return f"<!-- {platform.node()}: {cpu}, {os.cpu_count()} CPUs, Python {python}, {when} -->"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtests.apiserver", description=__doc__.split("\n")[0])
    p.add_argument("--gateway-tree", type=Path, help="run the gateway of this checkout instead of this one")
    sub = p.add_subparsers(dest="command", required=True)
    lat = sub.add_parser(
        "latency", help="API request latency and CPU per request, direct vs behind the gateway"
    )
    lat.add_argument("--backends", type=lambda s: [int(x) for x in s.split(",")], default=[1, 5])
    lat.add_argument("--rate", type=float, default=40.0, help="creates per second (open loop)")
    lat.add_argument("--duration", type=float, default=20.0, help="seconds measured per phase")
    lat.add_argument("--warmup", type=float, default=3.0, help="seconds of load before measuring")
    lat.add_argument("--repeats", type=int, default=1)
    rel = sub.add_parser("reload", help="how long a configuration change takes to be in force")
    rel.add_argument("--modes", type=lambda s: s.split(","), default=["direct", "file", "configmap"])
    rel.add_argument("--changes", type=int, default=10)
    args = p.parse_args(argv)
    run_latency(args) if args.command == "latency" else run_reload(args)


if __name__ == "__main__":
    main()
