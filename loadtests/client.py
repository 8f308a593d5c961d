"""The generator's HTTP clients: HTTP/1.1 keep-alive (h11) and HTTP/2 (h2), plaintext or TLS.

This is what kube-apiserver's webhook client does on the wire: POST JSON, keep connections alive,
TLS verified against a CA. One ``Http1Connection`` per worker (HTTP/1.1 has one request in flight);
one shared ``H2Connection`` multiplexes all workers' streams.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio

from gateway.errors import TransportError
from gateway.wire import tls
from gateway.wire.http11 import HTTP11Exchange
from gateway.wire.tls_stream import TLSSocketStream

RECEIVE_SIZE = 262144
_IO_TIMEOUT = 60.0
_MAX_BODY = 64 << 20


class ConnectionLostError(Exception):
    """The peer closed or broke the connection before a full answer arrived."""


@dataclass(frozen=True)
class Endpoint:
    """Where to connect: host, port, TLS settings and the ``Host``/``:authority`` value."""

    host: str
    port: int
    ssl_context: ssl.SSLContext | None
    authority: str

    @classmethod
    def parse(cls, url: str, ssl_context: ssl.SSLContext | None) -> tuple[Endpoint, str]:
        """Split ``url`` into an Endpoint and its path+query."""
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = parts.hostname or "127.0.0.1"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(host, port, ssl_context if tls else None, f"{host}:{port}"), path


class Connection(Protocol):
    async def request(self, path: bytes, body: bytes) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...


async def _open_stream(endpoint: Endpoint, alpn: str) -> trio.abc.Stream:
    tcp = await trio.open_tcp_stream(endpoint.host, endpoint.port)
    if endpoint.ssl_context is None:
        return tcp
    # The gateway's own TLS stream (a real SSL socket, no memory BIO): trio's SSLStream costs the
    # generator ~25 % of its CPU, and the generator shares the machine's CPUs with what it measures.
    tls = TLSSocketStream(tcp, endpoint.ssl_context, server_hostname=endpoint.host)
    try:
        await tls.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(tls)
        raise
    if alpn == "h2" and tls.selected_alpn_protocol() != "h2":
        await tls.aclose()
        raise ConnectionLostError(f"server did not negotiate h2 (ALPN {tls.selected_alpn_protocol()!r})")
    return tls


def client_context(ca_pem: bytes | None, protocol: str, insecure: bool = False) -> ssl.SSLContext:
    """A TLS client context trusting ``ca_pem`` (or system roots), offering one ALPN protocol."""
    return tls.client_context(
        ca_pem=ca_pem, alpn=["h2"] if protocol == "h2" else ["http/1.1"], insecure=insecure
    )


class Http1Connection:
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, stream: trio.abc.Stream, authority: str) -> None:
        self.stream = stream
        self.exchange = HTTP11Exchange(stream)  # the gateway's own HTTP/1.1 client loop
        self.base_headers = [
            (b"host", authority.encode()),
            (b"content-type", b"application/json"),
            (b"accept", b"application/json, */*"),
            (b"user-agent", b"webhook-gateway-loadtest"),
        ]

    @classmethod
    async def open(cls, endpoint: Endpoint) -> Http1Connection:
        return cls(await _open_stream(endpoint, "http/1.1"), endpoint.authority)

    async def request(self, path: bytes, body: bytes, method: bytes = b"POST") -> tuple[int, bytes]:
        headers = [*self.base_headers, (b"content-length", str(len(body)).encode())]
        try:
            with trio.fail_after(_IO_TIMEOUT):
                await self.exchange.send(method, path, headers, body)
                status, _headers = await self.exchange.receive_head()
                return status, await self.exchange.receive_body(_MAX_BODY)
        except TransportError as exc:
            raise ConnectionLostError(exc.cause) from exc

    @property
    def reusable(self) -> bool:
        return self.exchange.reusable

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Pending:
    __slots__ = ("chunks", "done", "error", "status")

    def __init__(self) -> None:
        self.status = 0
        self.chunks: list[bytes] = []
        self.done = trio.Event()
        self.error: str | None = None


@contextlib.contextmanager
def _reset_if_abandoned(conn: H2Connection, sid: int) -> Iterator[None]:
    """A request given up on (its deadline, a cancelled task) resets its stream, as Go's HTTP/2 client
    does; the RST_STREAM goes out with the connection's next write."""
    try:
        yield
    except BaseException:
        if conn.pending.pop(sid, None) is not None and not conn.broken:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                conn.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        raise


class H2Connection:
    """One HTTP/2 connection shared by all workers; a reader task in the caller's nursery."""

    def __init__(self, stream: trio.abc.Stream, authority: str, scheme: bytes) -> None:
        self.stream = stream
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.authority = authority.encode()
        self.scheme = scheme
        self.pending: dict[int, _Pending] = {}
        self.send_lock = trio.StrictFIFOLock()
        self.window = trio.Event()
        self.broken: str | None = None

    @classmethod
    async def open(cls, endpoint: Endpoint, nursery: trio.Nursery) -> H2Connection:
        stream = await _open_stream(endpoint, "h2")
        self = cls(stream, endpoint.authority, b"https" if endpoint.ssl_context else b"http")
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24})
        self.conn.increment_flow_control_window(1 << 30)
        await self._flush()
        nursery.start_soon(self._reader)
        return self

    async def _flush(self) -> None:
        async with self.send_lock:
            data = self.conn.data_to_send()
            if data:
                await self.stream.send_all(data)

    async def _reader(self) -> None:
        try:
            while True:
                data = await self.stream.receive_some(RECEIVE_SIZE)
                if not data:
                    self._fail("connection closed")
                    return
                for ev in self.conn.receive_data(data):
                    self._event(ev)
                await self._flush()
        except (
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            h2.exceptions.ProtocolError,
        ) as exc:
            self._fail(str(exc) or type(exc).__name__)

    def _event(self, ev: Any) -> None:
        if isinstance(ev, h2.events.ResponseReceived):
            p = self.pending.get(ev.stream_id)
            if p is not None:
                for k, v in ev.headers:
                    if k == b":status":
                        p.status = int(v)
        elif isinstance(ev, h2.events.DataReceived):
            self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            p = self.pending.get(ev.stream_id)
            if p is not None:
                p.chunks.append(ev.data)
        elif isinstance(ev, h2.events.StreamEnded):
            p = self.pending.pop(ev.stream_id, None)
            if p is not None:
                p.done.set()
        elif isinstance(ev, h2.events.StreamReset):
            p = self.pending.pop(ev.stream_id, None)
            if p is not None:
                p.error = f"stream reset (error code {ev.error_code})"
                p.done.set()
            self._wake()
        elif isinstance(ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._wake()
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self._fail(f"GOAWAY (error code {ev.error_code})")

    def _wake(self) -> None:
        self.window.set()
        self.window = trio.Event()

    def _fail(self, why: str) -> None:
        self.broken = why
        for p in self.pending.values():
            p.error = why
            p.done.set()
        self.pending.clear()
        self._wake()

    async def request(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        if self.broken:
            raise ConnectionLostError(self.broken)
        conn = self.conn
        try:
            sid = conn.get_next_available_stream_id()
            p = self.pending[sid] = _Pending()
            conn.send_headers(
                sid,
                [
                    (b":method", b"POST"),
                    (b":scheme", self.scheme),
                    (b":authority", self.authority),
                    (b":path", path),
                    (b"content-type", b"application/json"),
                    (b"accept", b"application/json, */*"),
                    (b"content-length", str(len(body)).encode()),
                ],
            )
            with _reset_if_abandoned(self, sid), trio.fail_after(_IO_TIMEOUT):
                view = memoryview(body)
                while view:
                    window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                    if window <= 0:
                        # Take the event before flushing: a WINDOW_UPDATE may arrive during the flush.
                        changed = self.window
                        await self._flush()
                        if self.broken:
                            raise ConnectionLostError(self.broken)
                        await changed.wait()
                        continue
                    chunk, view = view[:window], view[window:]
                    conn.send_data(sid, bytes(chunk), end_stream=not view)
                await self._flush()
                await p.done.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h2.exceptions.ProtocolError) as exc:
            self._fail(str(exc) or type(exc).__name__)
            raise ConnectionLostError(self.broken or "broken") from exc
        if p.error:
            raise ConnectionLostError(p.error)
        return p.status, b"".join(p.chunks)

    async def aclose(self) -> None:
        self._fail("closed")
        await self.stream.aclose()
