"""Helpers for driving the gateway's inbound side with raw bytes and scripted HTTP/2 frames."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import trio
import trio.testing

from gateway.cli import parse
from gateway.observability import Observability
from gateway.observability.metrics import Metrics
from gateway.server.extensions import disconnect_signal
from gateway.server.serve import Running, serve
from tests.support.gateway import hook, review, write_config

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
ENHANCE_YOUR_CALM = 0xB
REFUSED_STREAM = 0x7


def autojump_over_sockets() -> trio.testing.MockClock:
    """trio's autojump clock for tests whose point is time (deadlines, idle timers) while real
    loopback sockets carry the bytes: virtual time jumps to the next timer only after the run loop
    has been idle for 50 ms of real time, so that bytes already sent (delivered in microseconds,
    later on a loaded machine) are read before any deadline fires. (``autojump_threshold=0`` would
    jump while a socket is about to become readable, and time a connection out that is not idle.)"""
    return trio.testing.MockClock(autojump_threshold=0.05)


async def serve_asgi(nursery: trio.Nursery, app: Any, **settings: Any) -> tuple[int, trio.Event]:
    """``app`` served by the gateway's server (``gateway.server.hypercorn``) on 127.0.0.1, with a
    plain hypercorn ``Config`` set to ``settings``; its port, and the event that stops it."""
    from hypercorn.config import Config

    from gateway.server.hypercorn.listener import serve_inbound

    cfg = Config()
    cfg.bind = ["127.0.0.1:0"]
    cfg.accesslog = None
    for name, value in settings.items():
        setattr(cfg, name, value)
    stop = trio.Event()
    urls: list[str] = await nursery.start(
        lambda task_status: serve_inbound(
            app, cfg, tls_context=None, shutdown_trigger=stop.wait, task_status=task_status
        )
    )
    return int(urls[0].rsplit(":", 1)[1]), stop


class RecordingApp:
    """Echoes the request body; records each request's scope and the messages ``receive`` gave.

    The path picks how it answers: ``/whole`` one head and one body, ``/stream`` the body in two
    parts, ``/nobody`` a head only, ``/early`` nothing at all (hypercorn answers 500).
    """

    def __init__(self) -> None:
        self.scopes: list[Any] = []
        self.messages: list[list[Any]] = []
        # Per request, its disconnect signal's ``disconnected`` once its body was read (the signal
        # itself turns true when the stream closes after the reply).
        self.disconnected: list[bool] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.scopes.append(scope)
        got: list[Any] = []
        self.messages.append(got)
        body = b""
        while True:
            message = await receive()
            got.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        signal = disconnect_signal(scope)
        self.disconnected.append(bool(signal is not None and signal.disconnected))
        path = scope["path"]
        if path == "/early":
            return
        if path == "/nobody":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            return
        reply = b"echo:" + body
        headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(reply)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if path == "/stream":
            await send({"type": "http.response.body", "body": reply[:10], "more_body": True})
            await send({"type": "http.response.body", "body": reply[10:]})
        else:
            await send({"type": "http.response.body", "body": reply})


def frame(kind: int, flags: int = 0, stream: int = 0, payload: bytes = b"") -> bytes:
    """One raw HTTP/2 frame."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def settings(*entries: tuple[int, int]) -> bytes:
    return frame(SETTINGS, payload=b"".join(struct.pack(">HI", k, v) for k, v in entries))


@dataclass
class Gateway:
    running: Running
    metrics: Metrics
    port: int
    backend_hits: list[str] = field(default_factory=list)

    def counter(self, family: str, *labels: str) -> float:
        value: float = getattr(self.metrics, family).labels(*labels).value
        return value

    @property
    def in_flight(self) -> float:
        return self.counter("reviews_in_flight", "validating")

    @property
    def open_connections(self) -> int:
        source = self.metrics.inbound_source
        return source() if source is not None else -1


async def start(nursery: trio.Nursery, tmp_path: Path, backend_url: str, *args: str) -> Gateway:
    """The real gateway in-process, with metrics, one validating backend at ``backend_url``."""
    config = tmp_path / "config"
    write_config(config, validating={"v": [hook("v.example.com", backend_url, timeoutSeconds=30)]})
    options = parse(["--config", str(config), "--bind", "127.0.0.1:0", "--drain-seconds", "0", *args]).options
    observer = Observability(metrics=True, review_log=False)
    running: Running = await nursery.start(
        lambda task_status: serve(options, observer=observer, handle_signals=False, task_status=task_status)
    )
    assert observer.prometheus is not None
    return Gateway(running, observer.prometheus, int(running.urls[0].rsplit(":", 1)[1]))


def review_request(path: str = "/validate?timeout=20s", *, body: bytes | None = None) -> bytes:
    """A complete HTTP/1.1 review request."""
    body = json.dumps(review()).encode() if body is None else body
    return (
        f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def read_response(stream: trio.SocketStream) -> bytes:
    """Bytes until one complete HTTP/1.1 response with Content-Length has arrived (or EOF)."""
    data = b""
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) >= length:
                return data
        chunk = await stream.receive_some(65536)
        if not chunk:
            return data
        data += chunk


async def closed_by_peer(stream: trio.SocketStream, within: float) -> bool:
    """True if the server closes (EOF or reset) within ``within`` seconds; bytes are discarded."""
    with trio.move_on_after(within):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        return True
    return False


def held_sockets(port: int) -> int:
    """Server-side sockets on ``port`` still holding a descriptor: ESTABLISHED or CLOSE-WAIT."""
    return _sockets(port, ("01", "08"))


def close_wait_sockets(port: int) -> int:
    """Sockets of this machine in CLOSE-WAIT whose local port is ``port`` (from /proc/net/tcp*)."""
    return _sockets(port, ("08",))


def _sockets(port: int, states: tuple[str, ...]) -> int:
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state in states:
                count += 1
    return count


class H2Client:
    """A scripted HTTP/2 client over a raw socket (h2c prior knowledge)."""

    def __init__(self, stream: trio.SocketStream, conn: h2.connection.H2Connection) -> None:
        self.stream = stream
        self.conn = conn
        self.events: list[Any] = []

    @classmethod
    async def open(cls, port: int, **local_settings: int) -> H2Client:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        conn.initiate_connection()
        if local_settings:
            conn.update_settings({getattr(h2.settings.SettingCodes, k): v for k, v in local_settings.items()})
        await stream.send_all(conn.data_to_send())
        return cls(stream, conn)

    def headers(
        self, path: str = "/validate?timeout=20s", *, method: str = "POST"
    ) -> list[tuple[bytes, bytes]]:
        return [
            (b":method", method.encode()),
            (b":scheme", b"http"),
            (b":authority", b"gw"),
            (b":path", path.encode()),
            (b"content-type", b"application/json"),
        ]

    async def post(self, body: bytes | None = None, path: str = "/validate?timeout=20s") -> int:
        """Send one review on a new stream (without waiting for the answer); its stream id."""
        sid: int = self.conn.get_next_available_stream_id()
        body = json.dumps(review()).encode() if body is None else body
        self.conn.send_headers(sid, self.headers(path))
        self.conn.send_data(sid, body, end_stream=True)
        await self.flush()
        return sid

    async def flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            await self.stream.send_all(out)

    async def receive(self, *, ack: bool = True) -> bool:
        """Read once and record the events; False at EOF."""
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            data = b""
        if not data:
            return False
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            return False
        for event in events:
            self.events.append(event)
            if ack and isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        if ack:
            await self.flush()
        return True

    async def until(self, kind: type, *, stream_id: int | None = None, ack: bool = True) -> Any:
        """Read until an event of ``kind`` (for ``stream_id``) arrives; None at EOF."""
        while True:
            for event in self.events:
                if isinstance(event, kind) and (stream_id is None or event.stream_id == stream_id):
                    return event
            if not await self.receive(ack=ack):
                return None


async def raw_goaway(stream: trio.SocketStream, within: float = 5.0) -> int | None:
    """Read raw frames until GOAWAY; its error code (None at EOF or timeout)."""
    buffer = b""
    with trio.move_on_after(within):
        while True:
            while len(buffer) >= 9:
                length = int.from_bytes(buffer[:3], "big")
                if len(buffer) < 9 + length:
                    break
                kind, payload = buffer[3], buffer[9 : 9 + length]
                buffer = buffer[9 + length :]
                if kind == GOAWAY:
                    return int.from_bytes(payload[4:8], "big")
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return None
            if not chunk:
                return None
            buffer += chunk
    return None


class RawH2:
    """An HTTP/2 client that writes its frames itself, so that it can break rules h2 keeps for its users
    (more streams than SETTINGS_MAX_CONCURRENT_STREAMS, DATA after END_STREAM, floods of tiny frames).

    HPACK comes from the ``hpack`` package (h2's own), so header blocks stay valid. It announces the
    largest windows at once and so never has to send WINDOW_UPDATE for the server's replies. What the
    server sends is parsed into ``statuses`` (stream → :status), ``resets`` (stream → error code),
    ``ended`` (streams whose reply ended) and ``goaway`` (its error code); SETTINGS are acknowledged.
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        import hpack

        self.stream = stream
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buffer = b""
        self.statuses: dict[int, int] = {}
        self.resets: dict[int, int] = {}  # the first RST_STREAM's error code per stream
        self.reset_frames = 0
        self.ended: set[int] = set()
        self.goaway: int | None = None
        self.closed = False
        self.window = 65_535  # the server's connection window for our DATA (WINDOW_UPDATE raises it)
        self.stream_windows: dict[int, int] = {}
        self.initial_window = 65_535

    @classmethod
    async def open(cls, port: int) -> RawH2:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        biggest = 2**31 - 1
        await client.send(
            PREFACE
            + settings((4, biggest))
            + frame(WINDOW_UPDATE, payload=(biggest - 65_535).to_bytes(4, "big"))
        )
        return client

    def headers(
        self, sid: int, path: str = "/validate?timeout=20s", *, method: str = "POST", end_stream: bool = False
    ) -> bytes:
        block = self.encoder.encode(
            [
                (":method", method),
                (":scheme", "http"),
                (":authority", "gw"),
                (":path", path),
                ("content-type", "application/json"),
            ]
        )
        self.stream_windows[sid] = self.initial_window
        return frame(HEADERS, 0x4 | (0x1 if end_stream else 0), sid, block)

    def data(self, sid: int, payload: bytes, *, end_stream: bool = False) -> bytes:
        """A DATA frame; its bytes are taken from the windows the server gave."""
        self.window -= len(payload)
        self.stream_windows[sid] = self.stream_windows.get(sid, self.initial_window) - len(payload)
        return frame(DATA, 0x1 if end_stream else 0, sid, payload)

    async def post(self, sid: int, body: bytes, path: str = "/validate?timeout=20s") -> None:
        """HEADERS and the whole body on stream ``sid``, once the server's windows allow the body."""
        await self.until(lambda: self.window >= len(body))
        await self.send(self.headers(sid, path) + self.data(sid, body, end_stream=True))

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = True

    async def read(self) -> bool:
        """Read once and parse what came; False once the server closed the connection."""
        try:
            chunk = await self.stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            chunk = b""
        if not chunk:
            self.closed = True
            return False
        self.buffer += chunk
        replies = b""
        while len(self.buffer) >= 9:
            length = int.from_bytes(self.buffer[:3], "big")
            if len(self.buffer) < 9 + length:
                break
            kind, flags = self.buffer[3], self.buffer[4]
            sid = int.from_bytes(self.buffer[5:9], "big") & 0x7FFFFFFF
            payload, self.buffer = self.buffer[9 : 9 + length], self.buffer[9 + length :]
            if kind == HEADERS:
                block = payload
                if flags & 0x8:  # padded
                    block = block[1 : len(block) - block[0]]
                if flags & 0x20:  # priority
                    block = block[5:]
                for name, value in self.decoder.decode(block, raw=True):
                    if name == b":status":
                        self.statuses[sid] = int(value)
            elif kind == RST_STREAM:
                self.resets.setdefault(sid, int.from_bytes(payload[:4], "big"))
                self.reset_frames += 1
            elif kind == GOAWAY:
                self.goaway = int.from_bytes(payload[4:8], "big")
            elif kind == SETTINGS and not flags & 0x1:
                for i in range(0, len(payload), 6):
                    key, value = struct.unpack(">HI", payload[i : i + 6])
                    if key == 4:
                        for stream_id in self.stream_windows:
                            self.stream_windows[stream_id] += value - self.initial_window
                        self.initial_window = value
                replies += frame(SETTINGS, 0x1)
            elif kind == WINDOW_UPDATE:
                increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                if sid == 0:
                    self.window += increment
                else:
                    self.stream_windows[sid] = self.stream_windows.get(sid, self.initial_window) + increment
            if kind in (HEADERS, DATA) and flags & 0x1:
                self.ended.add(sid)
        if replies:
            await self.send(replies)
        return True

    async def until(self, done: Any, within: float = 10.0) -> bool:
        """Read until ``done()`` holds (True), the server closes, or ``within`` seconds pass (False)."""
        with trio.move_on_after(within):
            while not done():
                if not await self.read():
                    return bool(done())
            return True
        return False
