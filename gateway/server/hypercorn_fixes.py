"""The gateway's adjustments to hypercorn's trio worker: crash fixes, inbound protection, speed.

These subclass and replace hypercorn internals, so they are applied only to the hypercorn versions
whose internals they were written against (``VERIFIED_HYPERCORN``; ``check_version``), and
tests/test_server_hypercorn.py and tests/test_server_inbound.py drive every one of them with
scripted bytes and frames over real sockets.

**Crash fixes.** kube-apiserver cancels its calls when its own timeout passes, so clients going away
with requests in flight is normal traffic for an admission webhook; three hypercorn 0.18 defects
turn that into a crash of the connection or the process, or a truncated reply:

- ``H2Protocol._handle_events`` looks streams up with ``self.streams[stream_id]`` for DATA frames.
  When an earlier event of the same batch closed the stream (RST_STREAM, then DATA for it),
  the lookup raises ``KeyError``, which escapes the connection's task group.
  ``GuardedH2Protocol`` drops data for streams that are gone (keeping the connection window).
- ``TCPServer.protocol_send`` catches ``BrokenResourceError``/``ClosedResourceError`` from
  ``send_all`` but not ``BusyResourceError``, which trio raises when another task is closing the
  stream at the same moment. ``GatewayTCPServer`` treats it like the other two: the peer is gone.
- Early GOAWAY (pgjones/hypercorn#226): when the server is terminating, the last stream to close
  makes ``H2Protocol`` send GOAWAY, which can happen before the END_STREAM of that stream's reply
  is written (the reply then ends with a protocol error for the caller). ``GuardedH2Protocol``
  lets a stream report itself closed only once its reply has left the send buffer.

**Inbound protection** (docs/inbound.md; limits in ``gateway/server/limits.py``):
``GatewayTCPServer`` replaces hypercorn's per-connection server: a connection the client closed is
released at once (its requests are cancelled) instead of waiting for the keep-alive timer; request
heads, bodies and idle keep-alive connections have deadlines; every write has a deadline (a client
that does not read, or keeps an HTTP/2 window at zero, cannot pin a reply); open connections are
registered with the listener's ``InboundRuntime`` for the connection bound and for shutdown
(``Connection: close`` / GOAWAY while draining). ``GuardedH2Protocol`` also enforces the HTTP/2
control-frame budget (GOAWAY ENHANCE_YOUR_CALM).

**Speed** (docs/performance.md has the numbers; each is per inbound request):

- ``RequestQueue`` replaces the per-request trio memory channel that feeds the ASGI ``receive``;
  it lets the app notice ``http.disconnect`` through a callback, so a review no longer needs a
  nursery and a watcher task to be cancelled when its caller goes away (about 50 µs).
- ``_Watchdog`` moves the deadline of one timer task per connection instead of cancelling a task
  and starting a new one (under a lock, with ``nursery.start``) twice per request.
- On an otherwise idle gateway, the app of a plain HTTP/1.1 request whose body came with its head
  runs at once in the task that read it, and another task of the connection reads meanwhile
  (``hand_over_reading``): no task is started for it, and the reader's way back to sleep no longer
  comes before the review. A busy gateway starts a task per request, so that the replies of the
  requests read in one pass of the run loop go out together.
- ``GatewayH11Protocol`` writes an HTTP/1.1 response head together with its body (one TLS record,
  one ``send``) and skips the empty write of a Content-Length message's end (about 30 µs); a plain
  request and its whole reply bypass h11's state machine (``http11_fast``, checked against h11).

None of them changes what goes over the wire beyond how the same bytes are split into writes,
except where a limit closes a connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from functools import partial
from time import time
from typing import Any, Final
from urllib.parse import unquote

import h2.errors
import h2.events
import h2.exceptions
import h2.utilities
import h11
import hypercorn.protocol
import structlog
import trio
from h11._headers import Headers as H11Headers  # h11 0.16's header list (hypercorn_version pins it)
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Body, Data, EndBody, Response, StreamClosed
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import STREAM_ID, H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import tcp_server
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.typing import ConnectionState
from hypercorn.utils import build_and_validate_headers, parse_socket_addr, suppress_body, valid_server_name

from gateway.server.http11_fast import PlainRequest, closes, frame_reply, parse_plain_request
from gateway.server.hypercorn_version import check_version
from gateway.server.limits import ControlFrameBudget, InboundLimits, InboundRuntime
from gateway.server.timeouts import caller_timeout
from gateway.wire import H2_CLOSED_STREAMS_REMEMBERED
from gateway.wire.tls_stream import TLSSocketStream

Message = MutableMapping[str, Any]

log = structlog.get_logger("gateway.server")

# How long the requests of a connection the client closed get to notice (http.disconnect) and end
# by themselves before they are cancelled.
_RELEASE_GRACE: Final = 0.25

_installed = False

# Requests read closer together than this mean a busy gateway: their apps get tasks of their own.
# One review at a time arrives every ~0.75 ms here; a saturated gateway reads one every ~0.15 ms.
_BUSY_GAP: Final = 0.0005

# h11 events are immutable: one end-of-message event serves every response.
_END_OF_MESSAGE: Final = h11.EndOfMessage()


def runtime_of(config: Any) -> InboundRuntime:
    """The listener's shared state; a plain hypercorn Config gets a default one (tests)."""
    runtime: InboundRuntime | None = getattr(config, "inbound", None)
    if runtime is None:
        runtime = InboundRuntime()
        config.inbound = runtime
    return runtime


# --- speed: the request queue ---------------------------------------------------------------------


class RequestQueue:
    """The ASGI ``receive`` side of one request, fed by hypercorn (body chunks, then disconnect).

    Bounded like the memory channel it replaces (``max_app_queue_size``). ``disconnected`` turns
    true and ``on_disconnect`` is called as soon as hypercorn reports the caller gone, whether or not
    the app is reading: that is how a review in dispatch gets cancelled without a watcher task.

    ``body_deadline``: when the body has not fully arrived by then, ``on_body_timeout`` is called
    and the app reads ``http.disconnect`` (the server closes the connection or resets the stream).
    """

    __slots__ = (
        "_items",
        "_readers",
        "_size",
        "_writers",
        "body_deadline",
        "disconnected",
        "on_body_timeout",
        "on_disconnect",
    )

    def __init__(self, size: int) -> None:
        self._items: deque[Message] = deque()
        self._size = max(size, 1)
        self._readers = trio.lowlevel.ParkingLot()
        self._writers = trio.lowlevel.ParkingLot()
        self.disconnected = False
        self.on_disconnect: Callable[[], object] | None = None
        self.body_deadline = math.inf
        self.on_body_timeout: Callable[[], object] | None = None

    async def put(self, message: Message) -> None:
        """hypercorn's ``app_put``: waits while the queue is full (never for the disconnect)."""
        kind = message["type"]
        if kind == "http.disconnect":
            self._items.append(message)
            self._readers.unpark()
            self.disconnected = True
            self.body_deadline = math.inf
            if self.on_disconnect is not None:
                self.on_disconnect()
            return
        while len(self._items) >= self._size:
            await self._writers.park()
        self._items.append(message)
        self._readers.unpark()
        if not message.get("more_body", False):
            self.body_deadline = math.inf  # the whole body is here

    async def receive(self) -> Message:
        """The app's ``receive``: the next message, waiting for one if needed."""
        while not self._items:
            if self.body_deadline == math.inf:
                await self._readers.park()
                continue
            with trio.move_on_at(self.body_deadline):
                await self._readers.park()
            if not self._items and trio.current_time() >= self.body_deadline:
                self.body_deadline = math.inf
                self.disconnected = True
                if self.on_body_timeout is not None:
                    self.on_body_timeout()
                return {"type": "http.disconnect"}
        message = self._items.popleft()
        self._writers.unpark()
        return message


class GatewayTaskGroup(TaskGroup):
    """hypercorn's per-connection task group: a ``RequestQueue`` per request, deadlines on sends."""

    def __init__(self, server: GatewayTCPServer | None = None) -> None:
        super().__init__()
        self._server = server
        self._inline: Callable[[], Awaitable[None]] | None = None

    def cancel(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def cancel_after(self, seconds: float) -> None:
        if self._nursery is not None:
            scope = self._nursery.cancel_scope
            scope.deadline = min(scope.deadline, trio.current_time() + seconds)

    async def spawn_app(
        self, app: Any, config: Any, scope: Any, send: Callable[[Any], Awaitable[None]]
    ) -> Callable[[Any], Awaitable[None]]:
        stream = getattr(send, "__self__", None)
        protocol = getattr(getattr(stream, "send", None), "__self__", None)
        return self.start_request(
            app,
            config,
            scope,
            send,
            stream_id=getattr(stream, "stream_id", 1),
            http11=isinstance(protocol, GatewayH11Protocol),
        )

    def start_request(
        self,
        app: Any,
        config: Any,
        scope: Any,
        send: Callable[[Any], Awaitable[None]],
        *,
        stream_id: int,
        http11: bool,
        inline: bool = False,
    ) -> Callable[[Any], Awaitable[None]]:
        """Start the app's task for one request; returns where the request's messages go.

        ``inline``: the app is not started here but kept for ``run_inline``, which the reading task
        calls once the request's body is queued (see ``GatewayTCPServer.hand_over_reading``).
        """
        queue = RequestQueue(config.max_app_queue_size)
        server = self._server
        if server is not None:
            queue.body_deadline = trio.current_time() + server.body_budget(scope)
            queue.on_body_timeout = partial(server.body_timed_out, stream_id)
            # HTTP/2: a send can wait for the caller's flow-control window, so it gets the write
            # deadline here. HTTP/1.1: the only wait is the socket write, which protocol_send bounds
            # already; a second deadline would cost a timer per send for nothing.
            if not http11:
                send = server.bounded_send(send)
        assert self._nursery is not None
        handle: Any = _handle  # hypercorn types receive as its own event union
        call = partial(
            handle, app, config, scope, queue.receive, send, trio.to_thread.run_sync, trio.from_thread.run
        )
        if server is None:
            self._nursery.start_soon(call)
        elif inline:
            self._inline = call
        else:
            server.runtime.requests_in_flight += 1  # counted now: a request read next sees it at once
            self._nursery.start_soon(_counted, server.runtime, call)
        return queue.put

    async def run_inline(self) -> None:
        """Run the app kept by ``start_request(inline=True)`` in this task, which stops reading."""
        call, self._inline = self._inline, None
        if call is not None:
            assert self._server is not None
            runtime = self._server.runtime
            runtime.requests_in_flight += 1
            self._server.hand_over_reading()
            try:
                await call()
            finally:
                runtime.requests_in_flight -= 1


async def _counted(runtime: InboundRuntime, call: Callable[[], Awaitable[None]]) -> None:
    """An app's task; the listener counts it in flight from its start (``start_request``) to here."""
    try:
        await call()
    finally:
        runtime.requests_in_flight -= 1


# --- speed + protection: HTTP/1.1 -----------------------------------------------------------------


class _FastExchange:
    """A request/response exchange on the fast path (``http11_fast``): what h11 has not seen."""

    __slots__ = ("body_left", "closing", "head", "length", "replied")

    def __init__(self, head: bytes, length: int, body_left: int) -> None:
        self.head = head  # the request head's bytes, for handing the exchange to h11
        self.length = length  # the body's Content-Length
        self.body_left = body_left
        self.replied = False  # the whole reply went out on the fast path
        self.closing = False  # ... with Connection: close, or before the request body was in


class GatewayH11Protocol(H11Protocol):
    """HTTP/1.1 with the per-request work cut.

    - **The fast path.** A plain request (``http11_fast``: the shape kube-apiserver sends) that
      starts a read on an idle connection is parsed without h11, and its reply, when the app sends
      it whole with its length, is framed without h11 too; h11 stays idle throughout. Whatever
      else happens in such an exchange (a streamed reply, an error reply, a pipelined request)
      first hands it to h11 (``_to_h11``: h11 is given the head and the body's length, as if it
      had read them) and continues on the ordinary path below.
    - **The ordinary path.** The request head is looked at once (hypercorn walks the headers
      twice, for an upgrade and for a WebSocket), and an ordinary request goes straight to a
      ``GatewayHTTPStream``; upgrades (h2c, WebSocket) and the HTTP/2 preface take hypercorn's own
      path. A body that arrives whole reaches the app as one message instead of a chunk and an
      empty end. A response the app sends whole leaves as one write (``finish_response``); the head
      goes out with the first body bytes in every other case too.

    While the server drains, every response carries ``Connection: close`` so that callers move to
    another replica.
    """

    _held = b""
    _exchange: _FastExchange | None = None
    _gone = False  # a fast exchange closed the connection

    async def handle(self, event: Any) -> None:
        if type(event) is RawData:
            if self._gone:  # the connection is closing: what the client still sends is not read
                return
            exchange = self._exchange
            if exchange is not None:
                await self._fast_data(exchange, event.data)
                return
            if self._fast_ready():
                request = parse_plain_request(event.data)
                if request is not None:
                    await self._fast_request(request, event.data)
                    return
        await super().handle(event)

    def _fast_ready(self) -> bool:
        """True when h11 is idle with nothing buffered: the next bytes start a new request."""
        connection = self.connection
        return (
            self.stream is None
            and type(connection) is h11.Connection
            and connection.our_state is h11.IDLE
            and connection.their_state is h11.IDLE
            and not connection._receive_buffer  # h11 0.16 (pinned); a pipelined rest is h11's
        )

    async def _fast_request(self, request: PlainRequest, data: bytes) -> None:
        body = request.body
        self._exchange = _FastExchange(
            data[: len(data) - len(body)], len(body) + request.body_left, request.body_left
        )
        await self.send(Updated(idle=False))
        stream = GatewayHTTPStream(self)
        self.stream = stream
        headers = request.headers
        scope_headers = request.raw_headers if self.config.h11_pass_raw_headers else headers
        whole = request.body_left == 0
        # The app runs in this task when the gateway is otherwise idle (no request in flight, none
        # read in the last _BUSY_GAP): a task of its own would then cost a pass of the run loop
        # before the review starts, for nothing. A busy gateway starts a task per request as before:
        # this task reads on, and the replies of the requests read together go out together (one
        # wake-up of each caller for several instead of one per reply).
        runtime = runtime_of(self.config)
        now = trio.current_time()
        inline = whole and runtime.requests_in_flight == 0 and now - runtime.last_request_at > _BUSY_GAP
        runtime.last_request_at = now
        await stream.start(request.method, request.target, b"1.1", headers, scope_headers, inline=inline)
        self.keep_alive_requests += 1
        await self.context.mark_request()
        await stream.body(body, end=whole)
        if inline:
            await self.task_group.run_inline()  # type: ignore[attr-defined]

    async def _fast_data(self, exchange: _FastExchange, data: bytes) -> None:
        """More bytes during a fast exchange: the rest of its body, then perhaps a next request."""
        take = min(len(data), exchange.body_left)
        if take:
            exchange.body_left -= take
            await self._pass_body(data if take == len(data) else data[:take], end=exchange.body_left == 0)
        if take == len(data):
            return
        # A next request before this exchange ended (pipelining): like h11 (PAUSED), read nothing
        # more until the reply is out, then take the request as if it had just arrived.
        await self.can_read.clear()
        await self.can_read.wait()
        if not self._gone:
            await self.handle(RawData(data=data[take:]))

    def _to_h11(self, exchange: _FastExchange) -> None:
        """Hand a fast exchange to h11 (before its reply): h11 reads the head and the body so far.

        The body's bytes are stood in for by zeros: for a Content-Length body h11 only counts them,
        and the app has the real ones already.
        """
        self._exchange = None
        connection = self.connection
        connection.receive_data(exchange.head + bytes(exchange.length - exchange.body_left))
        while connection.next_event() not in (h11.NEED_DATA, h11.PAUSED):
            pass

    async def _fast_recycle(self, exchange: _FastExchange) -> None:
        """The fast exchange's reply is out and its stream closed: keep the connection or end it."""
        self._exchange = None
        await self._close_stream()
        if exchange.closing or self.context.terminated.is_set():
            self._gone = True
            await self.can_read.set()
            await self.send(Closed())
        else:
            self.response = None
            self.scope = None
            await self.can_read.set()
            await self.send(Updated(idle=True))

    async def _handle_events(self) -> None:
        connection = self.connection
        pending: bytes | None = None  # a body chunk held back: is the end of the body next?
        while True:
            if connection.they_are_waiting_for_100_continue:
                await self._send_h11_event(
                    h11.InformationalResponse(status_code=100, headers=self.config.response_headers("h11"))
                )
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError as error:
                if pending is not None:
                    await self._pass_body(pending, end=False)
                if connection.our_state in {h11.IDLE, h11.SEND_RESPONSE}:
                    await self._send_error_response(error.error_status_hint)
                await self.send(Closed())
                break
            kind = type(event)
            if kind is h11.Data:
                if pending is not None:
                    await self._pass_body(pending, end=False)
                pending = bytes(event.data)  # type: ignore[union-attr]
                continue
            if pending is not None:
                ended, body, pending = kind is h11.EndOfMessage, pending, None
                await self._pass_body(body, end=ended)
                if ended:
                    continue
            if isinstance(event, h11.Request):
                await self.send(Updated(idle=False))
                stream = self._ordinary_stream(event)
                if stream is None:  # an upgrade or the HTTP/2 preface: hypercorn's own path
                    await self._check_protocol(event)
                    await self._create_stream(event)
                else:
                    self.stream = stream
                    headers = event.headers
                    raw = self.config.h11_pass_raw_headers
                    await stream.start(
                        event.method,
                        event.target,
                        event.http_version,
                        headers,
                        headers.raw_items() if raw else list(headers),
                    )
                    self.keep_alive_requests += 1
                    await self.context.mark_request()
            elif event is h11.PAUSED:
                await self.can_read.clear()
                await self.can_read.wait()
            elif kind is h11.ConnectionClosed or event is h11.NEED_DATA or self.stream is None:
                break
            elif kind is h11.EndOfMessage:
                await self.stream.handle(EndBody(stream_id=STREAM_ID))
            elif isinstance(event, Data):  # WebSocket pass-through
                await self.stream.handle(event)

    async def _pass_body(self, data: bytes, *, end: bool) -> None:
        stream = self.stream
        if isinstance(stream, GatewayHTTPStream):
            await stream.body(data, end=end)
        elif stream is not None:
            await stream.handle(Body(stream_id=STREAM_ID, data=data))
            if end:
                await stream.handle(EndBody(stream_id=STREAM_ID))

    def _ordinary_stream(self, request: h11.Request) -> GatewayHTTPStream | None:
        """A stream for a plain request; None when hypercorn must look at it (upgrade, preface)."""
        if request.method == b"PRI":
            return None
        for name, _value in request.headers:  # h11 lower-cases names
            if name == b"upgrade":
                return None
        return GatewayHTTPStream(self)

    async def finish_response(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Head, body and end of one whole response in one write (h11 frames and checks them).

        The app's headers are used as given (hypercorn would strip and re-validate them): the
        gateway's app sends only constant, well-formed ones.
        """
        config = self.config
        if runtime_of(config).draining:
            headers = [*headers, (b"connection", b"close")]
        headers = [*headers, *config.response_headers("h11")]
        if self.keep_alive_requests >= config.keep_alive_max_requests:
            headers.append((b"connection", b"close"))
        exchange = self._exchange
        if exchange is not None:
            data = frame_reply(status, headers, body)
            if data is not None:
                exchange.replied = True
                exchange.closing = exchange.body_left > 0 or closes(headers)
                await self.send(RawData(data=data))
                return
            self._to_h11(exchange)
        connection = self.connection
        # h11's own header list, built directly: the app's names are lower-case already and its
        # Content-Length is its body's length, so h11's normalising pass would only repeat work.
        fields = H11Headers([(name, name.lower(), value) for name, value in headers])
        try:
            data = connection.send(h11.Response(headers=fields, status_code=status, _parsed=True))
            if body:
                data += connection.send(h11.Data(data=body))
            data += connection.send(_END_OF_MESSAGE)
        except h11.LocalProtocolError:
            if connection.their_state != h11.ERROR:
                raise
            return
        await self.send(RawData(data=data))

    async def _send_h11_event(self, event: Any) -> None:
        if self._exchange is not None:  # an error reply (hypercorn's own) during a fast exchange
            self._to_h11(self._exchange)
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if type(event) is h11.Response:  # a final response head (1xx are InformationalResponse)
            self._held = data
            return
        if self._held:
            data = self._held + data
            self._held = b""
        if data:  # the end of a Content-Length message is no bytes at all
            await self.send(RawData(data=data))

    async def stream_send(self, event: Any) -> None:
        exchange = self._exchange
        if exchange is not None:
            if exchange.replied:  # nothing follows a whole reply but the stream's end
                if isinstance(event, StreamClosed):
                    await self._fast_recycle(exchange)
                return
            self._to_h11(exchange)  # a reply the app streams, hypercorn's 500, or none at all
        if self._held and isinstance(event, StreamClosed):  # an app that never sent its body
            data, self._held = self._held, b""
            await self.send(RawData(data=data))
        elif type(event) is Response and event.status_code >= 200 and runtime_of(self.config).draining:
            event = dataclasses.replace(event, headers=[*event.headers, (b"connection", b"close")])
        await super().stream_send(event)


class _Head:
    """What hypercorn's ``valid_server_name`` reads of a request: its headers."""

    __slots__ = ("headers",)

    def __init__(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.headers = headers


class GatewayHTTPStream(HTTPStream):
    """hypercorn's ASGI bridge for one HTTP/1.1 request, with the per-request work cut.

    The scope is built as hypercorn builds it (the same keys and values) without the intermediate
    ``Request`` event, and a response the app sends as one head and one final body goes out
    through ``GatewayH11Protocol.finish_response``. Anything else (a streamed body, trailers, an
    app that ends early) takes hypercorn's own path.
    """

    app_put: Any = None  # hypercorn reads it on close, also when no app was started

    def __init__(self, protocol: GatewayH11Protocol) -> None:
        super().__init__(
            protocol.app,
            protocol.config,
            protocol.context,
            protocol.task_group,
            protocol.ssl,
            protocol.client,
            protocol.server,
            protocol.stream_send,
            STREAM_ID,
        )
        self.protocol = protocol
        self._head_pending = False

    async def start(
        self,
        method: bytes,
        target: bytes,
        http_version: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        scope_headers: list[tuple[bytes, bytes]],
        *,
        inline: bool = False,
    ) -> None:
        """The request head arrived: build the ASGI scope and start the app.

        ``headers`` with lower-case names; ``scope_headers`` the list the app is given (names as
        sent with ``h11_pass_raw_headers``); ``inline``: the caller runs the app itself
        (``GatewayTaskGroup.run_inline``) once it has queued the body.
        """
        self.start_time = time()
        config = self.config
        path, _, query_string = target.partition(b"?")
        self.scope = {
            "type": "http",
            "http_version": http_version.decode(),
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": method.decode("ascii").upper(),
            "scheme": self.scheme,
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query_string,
            "root_path": config.root_path,
            "headers": scope_headers,
            "client": self.client,
            "server": self.server,
            "state": self.protocol.connection_state.copy(),  # type: ignore[typeddict-item]
            "extensions": {},
        }
        if config.server_names and not valid_server_name(config, _Head(headers)):  # type: ignore[arg-type]
            await self._send_error_response(404)
            self.closed = True
            return
        task_group: Any = self.task_group
        self.app_put = task_group.start_request(
            self.app, config, self.scope, self.app_send, stream_id=self.stream_id, http11=True, inline=inline
        )

    async def body(self, data: bytes, *, end: bool) -> None:
        """A body chunk for the app; ``end``: it is the last."""
        if not self.closed:
            await self.app_put({"type": "http.request", "body": data, "more_body": not end})

    async def app_send(self, message: Any) -> None:
        if message is not None and not self.closed:
            kind = message["type"]
            if kind == "http.response.start" and self.state is ASGIHTTPState.REQUEST:
                if int(message["status"]) >= 200:
                    self.response = message  # goes out with the body (finish_response) or below
                    self.state = ASGIHTTPState.RESPONSE
                    self._head_pending = True
                    return
            elif (
                kind == "http.response.body"
                and self._head_pending
                and not message.get("more_body", False)
                and not self.response.get("trailers", False)
            ):
                self._head_pending = False
                status = int(self.response["status"])
                body = b"" if suppress_body(self.scope["method"], status) else bytes(message.get("body", b""))
                await self.protocol.finish_response(status, list(self.response.get("headers", ())), body)
                self.state = ASGIHTTPState.CLOSED
                if self.config.accesslog is not None:  # hypercorn's own access log (off in the gateway)
                    await self.config.log.access(self.scope, self.response, time() - self.start_time)
                await self.send(StreamClosed(stream_id=self.stream_id))
                return
        if self._head_pending:  # anything else: the head goes out the ordinary way first
            self._head_pending = False
            await self.send(
                Response(
                    stream_id=self.stream_id,
                    headers=build_and_validate_headers(self.response.get("headers", [])),
                    status_code=int(self.response["status"]),
                )
            )
        await super().app_send(message)


# --- crash fixes + protection: HTTP/2 -------------------------------------------------------------


class GuardedH2Protocol(H2Protocol):
    """HTTP/2 with the crash fixes (data for closed streams, early GOAWAY) and the frame budget."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Protection: a caller cycling streams would make h2 remember 2**16 closed ones (~11.5 MB)
        # on every connection; the new connection has closed none yet (see gateway.wire).
        self.connection._closed_streams = h2.utilities.SizeLimitDict(size_limit=H2_CLOSED_STREAMS_REMEMBERED)
        limits = runtime_of(self.config).limits
        self.budget = ControlFrameBudget(
            limits.h2_control_burst, limits.h2_control_rate, limits.h2_max_settings, now=trio.current_time()
        )
        self._sent = trio.lowlevel.ParkingLot()
        self.flooded = False

    async def handle(self, event: Any) -> None:
        if (
            isinstance(event, RawData)
            and not self.closed
            and not self.budget.feed(event.data, trio.current_time())
        ):
            await self._calm_down()
            return
        await super().handle(event)
        if isinstance(event, Closed):
            self._sent.unpark_all()

    async def _calm_down(self) -> None:
        """Over the control-frame budget: GOAWAY ENHANCE_YOUR_CALM, then close (counted)."""
        self.flooded = True
        events = runtime_of(self.config).events
        events.h2_goaway("flood")
        events.connection_closed("h2_flood")
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        await self._flush()
        await self.send(Closed())

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                # Crash fix: the stream was closed by an earlier event of this batch.
                with contextlib.suppress(h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
                    self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                continue
            await super()._handle_events([event])

    async def _send_data(self, stream_id: int) -> None:
        await super()._send_data(stream_id)
        if stream_id not in self.stream_buffers:
            self._sent.unpark_all()

    async def stream_send(self, event: Any) -> None:
        if isinstance(event, StreamClosed):
            # Crash fix (early GOAWAY): the last stream closing on a terminating (or draining)
            # server makes a GOAWAY go out; the stream counts as closed, and the connection as
            # idle, only once this stream's reply (and END_STREAM) has been written.
            while event.stream_id in self.stream_buffers and not self.closed:
                await self._sent.park()
        await super().stream_send(event)


# --- protection: the connection -------------------------------------------------------------------


class _Watchdog:
    """One timer task per connection whose deadline moves: header, idle, or none while busy.

    Also woken (``poke``) when the listener starts draining or terminating.
    """

    __slots__ = ("_poked", "_scope", "_server", "_stopped", "deadline", "reason")

    def __init__(self, server: GatewayTCPServer) -> None:
        self._server = server
        self.deadline = math.inf
        self.reason = ""
        self._scope: trio.CancelScope | None = None
        self._poked = False
        self._stopped = False

    def set(self, deadline: float, reason: str) -> None:
        self.deadline, self.reason = deadline, reason
        # Speed: a later deadline is not pushed to trio's timer heap (two to three times per request
        # on a keep-alive connection); the timer wakes at the earlier one, finds this one later and
        # sleeps again (``run``): one wake-up per keep-alive period instead of a heap update per set.
        if self._scope is not None and deadline < self._scope.deadline:
            self._scope.deadline = deadline

    def poke(self) -> None:
        self._poked = True
        if self._scope is not None:
            self._scope.cancel()

    def stop(self) -> None:
        """The client went away: nothing is left to time out."""
        self.deadline, self.reason = math.inf, ""
        self._stopped = True
        self.poke()

    async def run(self) -> None:
        server = self._server
        terminated = server.context.terminated
        while not (server.aborted or self._stopped):
            with trio.CancelScope(deadline=self.deadline) as scope:
                self._scope = scope
                if not self._poked:
                    if terminated.is_set():
                        await trio.sleep_forever()
                    await terminated.wait()
                    self._poked = True
            self._scope = None
            if trio.current_time() >= self.deadline:
                server.abort(self.reason)
                return
            if self._poked:
                self._poked = False
                await server.lifecycle()


class GatewayTCPServer(TCPServer):
    """hypercorn's per-connection server with the inbound limits and the crash fix for sends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runtime = runtime_of(self.config)
        self.limits: InboundLimits = self.runtime.limits
        self.watchdog = _Watchdog(self)
        self.idle = True
        self.aborted = False
        self._goaway_sent = False
        self._task_group: GatewayTaskGroup | None = None  # type: ignore[assignment]
        # The task reading from the client right now (None: one is being started); see
        # ``hand_over_reading``. A task that ran a request's app waits in ``_spare`` to read again.
        self._reader: trio.lowlevel.Task | None = None
        self._spare = trio.lowlevel.ParkingLot()
        self._read_over = False

    # --- the listener's side ------------------------------------------------------------------

    def poke(self) -> None:
        self.watchdog.poke()

    def abort(self, reason: str) -> None:
        """Close now (a limit was hit): count it, cancel every request of this connection."""
        if self.aborted:
            return
        self.aborted = True
        if reason:
            self.runtime.events.connection_closed(reason)
        if self._task_group is not None:
            self._task_group.cancel()

    async def lifecycle(self) -> None:
        """The listener started draining or terminating."""
        if (self.runtime.terminating or self.context.terminated.is_set()) and self.idle:
            self.abort("")
            return
        if self.runtime.draining and self.idle and not self._goaway_sent and self._is_h2():
            # GOAWAY only once no stream is in flight: clients built on python-h2 cannot receive
            # the rest of a reply after a GOAWAY, whatever its last-stream-id says.
            self._goaway_sent = True
            self.runtime.events.h2_goaway("drain")
            protocol: Any = self.protocol.protocol
            with contextlib.suppress(h2.exceptions.ProtocolError):
                protocol.connection.close_connection()
            await protocol._flush()

    def _is_h2(self) -> bool:
        protocol = getattr(self, "protocol", None)
        return isinstance(getattr(protocol, "protocol", None), H2Protocol)

    # --- requests -----------------------------------------------------------------------------

    def body_budget(self, scope: Any) -> float:
        """The body must arrive within --body-read-timeout and within the caller's ``?timeout=``."""
        seconds = caller_timeout(scope.get("query_string", b""))
        return self.limits.body_timeout if seconds is None else min(self.limits.body_timeout, seconds)

    def body_timed_out(self, stream_id: int) -> None:
        """A request body did not arrive in time: reset its HTTP/2 stream, or close the connection."""
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)
        if isinstance(protocol, H2Protocol) and self._task_group is not None:
            self.runtime.events.connection_closed("body_timeout")
            self._task_group.spawn(self._reset_stream, protocol, stream_id)
        else:
            self.abort("body_timeout")

    async def _reset_stream(self, protocol: H2Protocol, stream_id: int) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
            protocol.connection.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        await protocol._close_stream(stream_id)
        await protocol._flush()

    def bounded_send(self, send: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        """The app's ``send`` with the write deadline: a reply the client does not take ends it."""
        timeout = self.limits.write_timeout

        async def bounded(message: Any) -> None:
            with trio.move_on_after(timeout) as scope:
                await send(message)
            if scope.cancelled_caught:
                self.abort("write_timeout")
                await trio.lowlevel.checkpoint()  # the connection's cancellation ends the app here

        return bounded

    # --- hypercorn's TCPServer, with the limits -----------------------------------------------

    async def run(self) -> None:
        runtime = self.runtime
        runtime.connections.add(self)
        try:
            await self._serve()
        except Exception:
            # A defect in handling one connection must not end the listener (and with it every
            # other caller's connection): log it with its traceback, drop this connection only.
            log.exception("inbound connection failed; closed")
            await trio.aclose_forcefully(self.stream)
        finally:
            runtime.connections.discard(self)

    async def _serve(self) -> None:
        started = trio.current_time()
        try:
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await self.stream.do_handshake()
            except trio.TooSlowError:  # a TLS handshake is part of the first request's head
                self.runtime.events.connection_closed("header_timeout")
                await trio.aclose_forcefully(self.stream)
                return
            except trio.BrokenResourceError:
                await trio.aclose_forcefully(self.stream)
                return
            alpn_protocol = self.stream.selected_alpn_protocol()
            socket = self.stream.socket
            ssl = True
        except AttributeError:  # not TLS
            alpn_protocol = "http/1.1"
            socket = self.stream.socket
            ssl = False
        try:
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())
            task_group = GatewayTaskGroup(self)
            # A plain nursery rather than ``async with task_group``: hypercorn's ``__aexit__`` drops
            # the nursery's answer, so cancelling the group (a limit closed the connection) would
            # escape as if it came from outside and cancel the whole listener.
            async with trio.open_nursery() as nursery:
                task_group._nursery = nursery
                self._task_group = task_group
                self.protocol = ProtocolWrapper(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    ConnectionState(self.state),
                    ssl,
                    client,
                    server,
                    self.protocol_send,
                    alpn_protocol,
                )
                await self.protocol.initiate()
                self.watchdog.set(started + self.limits.header_timeout, "header_timeout")
                task_group.spawn(self.watchdog.run)
                if self.runtime.terminating:
                    self.watchdog.poke()
                await self._read_data()
        except OSError:
            pass
        finally:
            if self.aborted:
                await trio.aclose_forcefully(self.stream)
            else:
                await self._close()

    def hand_over_reading(self) -> None:
        """The reading task is about to run a request's app itself: another task reads meanwhile.

        Speed, one review at a time (``GatewayH11Protocol._fast_request`` decides when): the app runs
        at once in the task that read its request, instead of in a task started for it that runs
        only after the reader has gone back to wait for the socket (the reader's way to sleep, a
        task start and a pass of the run loop sat between the request and its backend call). What
        the client does meanwhile is read as before, by the other task: a client that closes still
        cancels its review (``http.disconnect``). The two tasks swap roles: the one that ran the app
        waits in ``_spare`` to read again, so a connection has at most one spare task and starts
        none per request.
        """
        woken = self._spare.unpark()
        if woken:
            self._reader = woken[0]
        else:
            self._reader = None
            assert self._task_group is not None
            self._task_group.spawn(self._read_data)

    async def _read_data(self) -> None:
        me = trio.lowlevel.current_task()
        if self._reader is None:
            self._reader = me
        watchdog = self.watchdog
        while True:
            if self._reader is not me:  # reading moved on while this task ran an app
                if self._read_over or len(self._spare):
                    return
                await self._spare.park()  # until hand_over_reading names it the reader, or the end
                continue
            try:
                data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            if not data:
                break
            if self.idle and watchdog.reason == "idle_timeout" and not self._is_h2():
                # The first bytes of the next HTTP/1.1 request: its head has a deadline now.
                watchdog.set(
                    min(watchdog.deadline, trio.current_time() + self.limits.header_timeout),
                    "header_timeout",
                )
            await self.protocol.handle(RawData(bytes(data)))
            if watchdog.reason == "header_timeout" and self.idle and self._is_h2():
                protocol: Any = self.protocol.protocol
                if protocol.budget._preface == 0:  # the connection preface is in: idle from now
                    watchdog.set(trio.current_time() + self.config.keep_alive_timeout, "idle_timeout")
        self._read_over = True
        self._spare.unpark_all()
        with trio.CancelScope(shield=True):
            await self.protocol.handle(Closed())
        # The client is gone: its requests were told (http.disconnect) and end now; those that
        # cannot (a reply stuck in a send) are cancelled shortly after. Nothing waits for the
        # keep-alive timer.
        watchdog.stop()
        if self._task_group is not None:
            self._task_group.cancel_after(_RELEASE_GRACE)

    async def protocol_send(self, event: Any) -> None:
        if isinstance(event, RawData):
            if self.aborted:
                return
            lock = self.send_lock
            # Speed: an uncontended trio.Lock still yields to the scheduler on acquire (one pass of
            # the run loop per write); take it without waiting when it is free. The write itself
            # is a schedule point when it has to wait.
            if lock.locked():
                await lock.acquire()
            else:
                lock.acquire_nowait()
            timed_out = failed = False
            try:
                data = event.data
                stream: Any = self.stream  # hypercorn types it as trio's SSLStream; ours is TLS too
                sent = 0
                if type(stream) is TLSSocketStream:
                    # Speed: a reply the socket takes at once needs no deadline, cancel scope or
                    # schedule point (one of each per review saved); only a write that has to wait
                    # gets them below.
                    try:
                        sent = stream.send_now(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                        failed = True
                if not failed and sent < len(data):
                    deadline = trio.current_time() + self.limits.write_timeout
                    with trio.CancelScope(shield=True, deadline=deadline) as scope:
                        try:
                            await stream.send_all(memoryview(data)[sent:] if sent else data)
                        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                            failed = True  # crash fix: Busy too (another task is closing the stream)
                    timed_out = scope.cancelled_caught
            finally:
                lock.release()
            if timed_out:
                self.abort("write_timeout")
            elif failed:
                with trio.CancelScope(shield=True):
                    await self.protocol.handle(Closed())
        elif isinstance(event, Closed):
            await self._close()
            await self.protocol.handle(Closed())
        elif isinstance(event, Updated):
            self.idle = event.idle
            if not event.idle:
                self.watchdog.set(math.inf, "")
            elif self.runtime.terminating or self.context.terminated.is_set():
                self.abort("")
            else:
                if self.runtime.draining:
                    self.watchdog.poke()  # HTTP/2: GOAWAY now that no stream is in flight
                self.watchdog.set(trio.current_time() + self.config.keep_alive_timeout, "idle_timeout")

    async def _close(self) -> None:
        with trio.move_on_after(1.0) as scope:
            with contextlib.suppress(
                trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError
            ):
                await super()._close()
        if scope.cancelled_caught:
            await trio.aclose_forcefully(self.stream)


def install() -> None:
    """Make hypercorn's trio worker use the classes above (idempotent, process-wide).

    Refuses (``UnsupportedHypercornError``) on a hypercorn whose internals were not verified.
    """
    global _installed  # noqa: PLW0603 - a one-time process-wide patch, by design
    check_version()
    if not _installed:
        # Crash fixes and inbound protection.
        hypercorn_run.TCPServer = GatewayTCPServer  # type: ignore[attr-defined]
        hypercorn.protocol.H2Protocol = GuardedH2Protocol  # type: ignore[attr-defined]
        # Speed (and the body deadline, which lives in the request queue).
        tcp_server.TaskGroup = GatewayTaskGroup  # type: ignore[attr-defined]
        hypercorn.protocol.H11Protocol = GatewayH11Protocol  # type: ignore[attr-defined]
        _installed = True
