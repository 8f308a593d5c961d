"""Real HTTP/1.1 and HTTP/2 backends on 127.0.0.1 for transport tests (TLS optional, via trustme).

Like upstream's ``webhook_server.go`` the server switches on the request path:

- ``/hang``: read the request, never answer; ``/gate``: answer once ``server.gate`` is set
- ``/stall-body``: headers (Content-Length 100) and 10 body bytes, then nothing
- ``/close-mid``: headers and 10 of 100 body bytes, then close
- ``/close-after``: answer, then silently close the (keep-alive) connection
- ``/close-on-next``, ``/reset-on-next``: answer; when the next request starts arriving, close
  (or reset) the connection without processing it: a keep-alive race the client must absorb
- ``/close-now``: close without answering; ``/connection-close``: answer with ``Connection: close``
- ``/big/<n>``: an n-byte body; ``/chunked/<n>``: the same without Content-Length (HTTP/1.1 chunked)
- ``/status/<code>``: that status (3xx carry ``Location: /elsewhere``); anything else: 200 ``{}``
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import h11
import hyperframe.frame
import trio
import trustme


@dataclass
class SeenRequest:
    """One request as the server received it."""

    connection: int
    http_version: str
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    stream_id: int | None = None
    alpn: str | None = None
    client_cert: dict[str, object] | None = None

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


async def tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Both ends of one TCP connection on 127.0.0.1: (the connecting end, the accepted end)."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = await trio.open_tcp_stream("127.0.0.1", listener.getsockname()[1])
    accepted, _ = await listener.accept()
    listener.close()
    return client, trio.SocketStream(accepted)


def server_context(
    ca: trustme.CA,
    *identities: str,
    alpn: tuple[str, ...] = ("h2", "http/1.1"),
    client_ca: trustme.CA | None = None,
) -> ssl.SSLContext:
    """A server-side TLS context with a certificate for ``identities`` signed by ``ca``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*identities).configure_cert(context)
    context.set_alpn_protocols(list(alpn))
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        client_ca.configure_trust(context)
    return context


@dataclass
class BackendServer:
    """A backend that records what it sees; start it with ``await nursery.start(server.serve)``."""

    ssl_context: ssl.SSLContext | None = None
    h2c: bool = False  # plaintext connections speak HTTP/2 (prior knowledge)
    max_concurrent_streams: int = 100
    goaway_after_streams: int | None = None  # first connection: GOAWAY(last = first stream) after n
    hold_window: bool = False  # h2: received DATA is acknowledged (WINDOW_UPDATE) only once ``gate`` is set
    port: int = 0
    host: str = "127.0.0.1"  # any 127.0.0.x: several backends as the pods of one service
    connections: int = 0
    closed_connections: int = 0
    requests: list[SeenRequest] = field(default_factory=list)
    resets: list[tuple[int, int]] = field(default_factory=list)
    peak_streams: int = 0
    gate: trio.Event = field(default_factory=trio.Event)
    _changed: trio.Event = field(default_factory=trio.Event)

    def url(self, path: str = "/", host: str = "127.0.0.1") -> str:
        scheme = "https" if self.ssl_context else "http"
        return f"{scheme}://{host}:{self.port}{path}"

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait (no timing) until ``predicate`` holds; it is re-checked after every server event."""
        while not predicate():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[BackendServer] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._connection, listeners)
            task_status.started(self)

    async def _connection(self, tcp: trio.SocketStream) -> None:
        index = self.connections
        self.connections += 1
        self._notify()
        stream: trio.abc.Stream = tcp
        alpn = None
        cert = None
        try:
            if self.ssl_context is not None:
                tls = trio.SSLStream(tcp, self.ssl_context, server_side=True, https_compatible=True)
                stream = tls
                await tls.do_handshake()
                alpn = tls.selected_alpn_protocol()
                cert = tls.getpeercert() or None
            if alpn == "h2" or (self.ssl_context is None and self.h2c):
                await self._serve_h2(stream, index, alpn, cert)
            else:
                await self._serve_h11(stream, index, alpn, cert)
        except (
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            h11.ProtocolError,
            h2.exceptions.ProtocolError,
        ):
            pass
        finally:
            await trio.aclose_forcefully(stream)
            self.closed_connections += 1
            self._notify()

    def _record(self, request: SeenRequest) -> None:
        self.requests.append(request)
        self._notify()

    # --- HTTP/1.1 -----------------------------------------------------------------------------

    async def _serve_h11(self, stream: trio.abc.Stream, index: int, alpn: str | None, cert: object) -> None:
        connection = h11.Connection(h11.SERVER)
        while True:
            request: h11.Request | None = None
            body = bytearray()
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data and connection.their_state is h11.IDLE:
                        return
                    connection.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            assert request is not None
            seen = SeenRequest(
                connection=index,
                http_version="HTTP/1.1",
                method=request.method.decode(),
                target=request.target.decode(),
                headers={k.decode(): v.decode() for k, v in request.headers},
                body=bytes(body),
                alpn=alpn,
                client_cert=cert,  # type: ignore[arg-type]
            )
            self._record(seen)
            if not await self._answer_h11(stream, connection, seen.path):
                return
            if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
                return
            connection.start_next_cycle()

    async def _answer_h11(self, stream: trio.abc.Stream, connection: h11.Connection, path: str) -> bool:
        """Send the reply for ``path``; False when the connection must end."""

        async def send(*events: h11.Event) -> None:
            await stream.send_all(b"".join(connection.send(e) or b"" for e in events))

        if path == "/hang":
            await _until_closed(stream)
            return False
        if path == "/close-now":
            return False
        if path == "/gate":
            await self.gate.wait()
        if path in ("/stall-body", "/close-mid"):
            await send(
                h11.Response(status_code=200, headers=[("content-length", "100")]), h11.Data(data=b"x" * 10)
            )
            if path == "/stall-body":
                await _until_closed(stream)
            return False
        status, headers, body = _reply(path)
        if path.startswith("/chunked/"):
            headers = [("transfer-encoding", "chunked")]
        else:
            headers.append(("content-length", str(len(body))))
        if path == "/connection-close":
            headers.append(("connection", "close"))
        await send(h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage())
        if path in ("/close-on-next", "/reset-on-next"):
            await stream.receive_some(1)
            if path == "/reset-on-next":
                _linger_zero(stream)
            return False
        return path != "/close-after"

    # --- HTTP/2 -------------------------------------------------------------------------------

    async def _serve_h2(self, stream: trio.abc.Stream, index: int, alpn: str | None, cert: object) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        connection = h2.connection.H2Connection(config=config)
        connection.local_settings = h2.settings.Settings(
            client=False,
            initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_concurrent_streams},
        )
        connection.initiate_connection()
        lock = trio.Lock()
        window = [trio.Event()]
        active: set[int] = set()
        partial: dict[int, tuple[dict[str, str], bytearray]] = {}
        held: list[SeenRequest] = []
        unacked: list[tuple[int, int]] = []

        async def acknowledge_after_gate() -> None:
            await self.gate.wait()
            for size, stream_id in unacked:
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    connection.acknowledge_received_data(size, stream_id)
            unacked.clear()
            await flush()

        async def flush() -> None:
            async with lock:
                data = connection.data_to_send()
                if data:
                    await stream.send_all(data)

        async def respond(seen: SeenRequest) -> None:
            stream_id = seen.stream_id
            assert stream_id is not None
            if seen.path == "/hang":
                await trio.sleep_forever()
            if seen.path == "/gate":
                await self.gate.wait()
            if seen.path == "/close-now":
                await stream.aclose()  # the whole connection: every stream on it breaks
                return
            if seen.path == "/stall-body":
                connection.send_headers(stream_id, [(b":status", b"200"), (b"content-length", b"100")])
                connection.send_data(stream_id, b"x" * 10)
                await flush()
                await trio.sleep_forever()
            status, headers, body = _reply(seen.path)
            fields = [(b":status", str(status).encode())] + [(k.encode(), v.encode()) for k, v in headers]
            fields.append((b"content-length", str(len(body)).encode()))
            try:
                connection.send_headers(stream_id, fields, end_stream=not body)
                offset = 0
                while offset < len(body):
                    room = min(
                        connection.local_flow_control_window(stream_id), connection.max_outbound_frame_size
                    )
                    if room <= 0:
                        await window[0].wait()
                        continue
                    chunk = body[offset : offset + room]
                    offset += len(chunk)
                    connection.send_data(stream_id, chunk, end_stream=offset == len(body))
                    await flush()
            except h2.exceptions.StreamClosedError:
                return
            finally:
                active.discard(stream_id)
            await flush()

        await flush()
        async with trio.open_nursery() as nursery:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    break
                for event in connection.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        headers = {k.decode(): v.decode() for k, v in event.headers}
                        partial[event.stream_id] = (headers, bytearray())
                        active.add(event.stream_id)
                        self.peak_streams = max(self.peak_streams, len(active))
                    elif isinstance(event, h2.events.DataReceived):
                        if self.hold_window and not self.gate.is_set():
                            if not unacked:
                                nursery.start_soon(acknowledge_after_gate)
                            unacked.append((event.flow_controlled_length, event.stream_id))
                        else:
                            connection.acknowledge_received_data(
                                event.flow_controlled_length, event.stream_id
                            )
                        partial[event.stream_id][1].extend(event.data)
                    elif isinstance(event, h2.events.StreamEnded):
                        headers, body = partial.pop(event.stream_id)
                        seen = SeenRequest(
                            connection=index,
                            http_version="HTTP/2",
                            method=headers[":method"],
                            target=headers[":path"],
                            headers=headers,
                            body=bytes(body),
                            stream_id=event.stream_id,
                            alpn=alpn,
                            client_cert=cert,  # type: ignore[arg-type]
                        )
                        self._record(seen)
                        if self.goaway_after_streams and index == 0:
                            held.append(seen)
                            if len(held) == self.goaway_after_streams:
                                # h2 cannot keep serving after close_connection(): write the
                                # GOAWAY frame itself and go on answering the first stream.
                                goaway = hyperframe.frame.GoAwayFrame(0)
                                goaway.last_stream_id = held[0].stream_id or 0
                                await flush()
                                async with lock:
                                    await stream.send_all(goaway.serialize())
                                nursery.start_soon(respond, held[0])
                        else:
                            nursery.start_soon(respond, seen)
                    elif isinstance(event, h2.events.StreamReset):
                        active.discard(event.stream_id)
                        self.resets.append((event.stream_id, int(event.error_code)))
                        self._notify()
                    elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
                        window[0].set()
                        window[0] = trio.Event()
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        self._notify()
                await flush()
            nursery.cancel_scope.cancel()


async def _until_closed(stream: trio.abc.Stream) -> None:
    """Never answer, but notice when the client closes the connection."""
    while await stream.receive_some(65536):
        pass


def _linger_zero(stream: trio.abc.Stream) -> None:
    # SO_LINGER 0: close() sends RST instead of FIN, like a crashed or overloaded peer.
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    assert isinstance(inner, trio.SocketStream)
    inner.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _reply(path: str) -> tuple[int, list[tuple[str, str]], bytes]:
    headers = [("content-type", "application/json")]
    if path.startswith(("/big/", "/chunked/")):
        return 200, headers, b"x" * int(path.rsplit("/", 1)[1])
    if path.startswith("/status/"):
        status = int(path.rsplit("/", 1)[1])
        if 300 <= status < 400:
            headers.append(("location", "/elsewhere"))
        return status, headers, b'{"status":%d}' % status
    return 200, headers, b"{}"
