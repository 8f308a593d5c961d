"""``GatewayH11Protocol`` replaces hypercorn's ``H11Protocol`` (HTTP/1.1 on one connection).

Reasons, all **measured speed** except the last two (docs/performance.md has the numbers; each is per
inbound request):

- **The fast path.** A plain request (``gateway.server.http11_fast``: the shape kube-apiserver
  sends) that starts a read on an idle connection is parsed without h11, and its reply, when the
  app sends it whole with its length, is framed without h11 too: one request/response cycle h11
  50 µs → 7 µs; ``passthrough`` A/B 566 → 452 µs (the "HTTP/1.1 fast path" row).
- **The app inline.** On an otherwise idle gateway, the app of a plain request whose body came with
  its head runs at once in the task that read it (``GatewayTCPServer.hand_over_reading``): no task
  is started for it. A busy gateway starts a task per request, so that the replies of the requests
  read in one pass of the run loop go out together.
- **One write per reply.** A response head is written together with its body (one TLS record, one
  ``send``), and the empty write at the end of a Content-Length message is skipped (−32 µs).
- **A shed review's body gathered.** While the overload gate sheds, a plain request whose body
  comes in several reads (Go's client, the apiserver's, writes through a 4 KiB buffer: an 8 KB
  review is three TLS records; the TLS stream reads the records already on the socket together,
  so it takes several reads only when they arrive apart) is gathered here, at most
  ``_GATHER_MAX`` bytes, and answered at once
  like one whose body came with its head (``InboundRuntime.answer_at_once``), instead of being
  handed to a task and the ASGI path piece by piece. Until it is whole the connection is idle for
  the server: its head's deadline (``--header-read-timeout``) covers the body.
- **Draining (a limit).** While the listener drains, every response carries ``Connection: close``
  so that callers move to another replica.
- **Strict framing (a limit).** A request head h11 accepts is still refused, and the connection
  closed, when its framing is faulty or its method or version is not one the gateway serves
  (``http11_fast.framing_error``: ``Transfer-Encoding`` with ``Content-Length``, a lower-case
  method, ``HTTP/2.0`` in the request line); ``Upgrade`` is ignored (no h2c upgrade, over TLS or
  not); ``100 Continue`` waits until the app reads the body (a 413 comes without one).

The speed-ups change nothing on the wire beyond how the same bytes are split into writes.

Byte-level tests: tests/test_server_http11.py (every reply shape, pipelining, keep-alive limits,
compared with plain hypercorn over real sockets), tests/test_server_http11_fast.py (the fast
path's parsing and framing against h11 itself) and tests/test_server_framing.py (the smuggling
probes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import h11
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed
from hypercorn.protocol.h11 import STREAM_ID, H2ProtocolAssumedError, H11Protocol

from gateway.server.http11_fast import PlainRequest, closes, frame_reply, framing_error, parse_plain_request
from gateway.server.hypercorn.config import runtime_of
from gateway.server.hypercorn.http_stream import GatewayHTTPStream
from gateway.server.limits import FrameBudget
from gateway.wire.h11_private import Headers as H11Headers

__all__ = ["GatewayH11Protocol"]

# Requests read closer together than this mean a busy gateway: their apps get tasks of their own.
# One review at a time arrives every ~0.75 ms here; a saturated gateway reads one every ~0.15 ms.
_BUSY_GAP: Final = 0.0005

# The most a request may hold to be gathered whole before it is answered (head and body): the
# memory each connection is allowed beyond its buffers (docs/inbound.md, "Memory").
_GATHER_MAX: Final = 64 * 1024

# h11 events are immutable: one end-of-message event serves every response.
_END_OF_MESSAGE: Final = h11.EndOfMessage()


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
      twice, for an upgrade and for a WebSocket): a head with faulty framing is refused and the
      connection closed (``http11_fast.framing_error``), any other goes straight to a
      ``GatewayHTTPStream`` (``Upgrade`` is ignored), and the HTTP/2 preface switches to HTTP/2.
      The 100 Continue of ``Expect: 100-continue`` goes out when the app first reads the body, so
      that a request refused on its head alone (413) never gets one. A body that arrives whole
      reaches the app as one message instead of a chunk and an empty end. A response the app
      sends whole leaves as one write (``finish_response``); the head goes out with the first
      body bytes in every other case too.

    While the server drains, every response carries ``Connection: close`` so that callers move to
    another replica.
    """

    _held = b""
    _exchange: _FastExchange | None = None
    _gathered: list[bytes] | None = None  # a request being gathered whole (``_gather``)
    _gather_left = 0  # its bytes still to come
    _gone = False  # a fast exchange closed the connection
    _budget: FrameBudget | None = None  # for the chunks of chunked bodies, made at the first one
    _chunk = 0  # bytes of the chunk being read

    def _chunk_within_budget(self) -> bool:
        """The frame budget for HTTP/1.1: a whole chunk is charged like a DATA frame of its size.

        A chunk costs h11, this protocol and the app's queue the same work whether it carries one
        byte or 16 KiB; a body in tiny chunks is a flood of them (docs/inbound.md, "Frame budget").
        Its size is the chunk's as the client framed it, however TCP split it into reads.
        """
        now = trio.current_time()
        budget = self._budget
        if budget is None:
            address = self.client[0] if self.client else ""
            budget = self._budget = runtime_of(self.config).budget_for(address, now).for_chunks()
        return budget.small(self._chunk, now)

    def release(self) -> None:
        """The connection has closed: drop what refers back to it (``GatewayTCPServer._release``)."""
        self.send = self.task_group = self.stream = self._exchange = None  # type: ignore[assignment]

    async def handle(self, event: Any) -> None:
        if type(event) is RawData:
            if self._gone:  # the connection is closing: what the client still sends is not read
                return
            if self._gathered is not None:
                await self._gather(event.data)
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
            and not connection._receive_buffer  # private to h11: its release is checked (wire.releases)
        )

    async def _fast_request(self, request: PlainRequest, data: bytes) -> None:
        body = request.body
        runtime = runtime_of(self.config)
        at_once = runtime.answer_at_once
        if (
            at_once is not None
            and request.body_left
            and len(data) + request.body_left <= _GATHER_MAX
            and runtime.sheds_now is not None
            and runtime.sheds_now()
        ):
            self._gathered = [data]  # answered once whole (``_gather``); no stream, no task till then
            self._gather_left = request.body_left
            return
        if (
            at_once is not None
            and request.body_left == 0
            and not runtime.draining
            and self.keep_alive_requests + 1 < self.config.keep_alive_max_requests
        ):
            answer = at_once(request.method, request.target, request.headers, body)
            if answer is not None:  # a review shed where it was read: no stream, no task
                self.keep_alive_requests += 1
                await self.context.mark_request()
                status, headers, reply = answer
                framed = frame_reply(status, [*headers, *self.config.response_headers("h11")], reply)
                assert framed is not None  # the app's whole reply with its length
                await self.send(RawData(data=framed))
                await self.send(Updated(idle=True))
                return
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
        now = trio.current_time()
        inline = whole and runtime.requests_in_flight == 0 and now - runtime.last_request_at > _BUSY_GAP
        runtime.last_request_at = now
        await stream.start(request.method, request.target, b"1.1", headers, scope_headers, inline=inline)
        self.keep_alive_requests += 1
        await self.context.mark_request()
        await stream.body(body, end=whole)
        if inline:
            await self.task_group.run_inline()  # type: ignore[attr-defined]

    async def _gather(self, data: bytes) -> None:
        """More of a request being gathered; once whole, it is taken as if it had come in one read."""
        gathered = self._gathered
        assert gathered is not None
        gathered.append(data)
        self._gather_left -= len(data)
        if self._gather_left > 0:
            return
        self._gathered = None
        whole = b"".join(gathered)
        request = parse_plain_request(whole)
        if request is not None and request.body_left == 0:
            await self._fast_request(request, whole)
        else:  # bytes after the body (a pipelined request): h11 takes it all, as it would have
            await super().handle(RawData(data=whole))

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
                data: h11.Data = event  # type: ignore[assignment]
                if data.chunk_start:
                    self._chunk = 0
                self._chunk += len(data.data)
                if data.chunk_end and not self._chunk_within_budget():
                    runtime = runtime_of(self.config)
                    assert self._budget is not None
                    runtime.flooded(self.client[0] if self.client else "", self._budget, trio.current_time())
                    runtime.events.connection_closed("h1_flood")
                    await self.send(Closed())
                    break
                if pending is not None:
                    await self._pass_body(pending, end=False)
                pending = bytes(data.data)
                continue
            if pending is not None:
                ended, body, pending = kind is h11.EndOfMessage, pending, None
                await self._pass_body(body, end=ended)
                if ended:
                    continue
            if isinstance(event, h11.Request):
                refused = framing_error(event.method, event.target, event.http_version, event.headers)
                if refused:  # faulty framing: the bytes after it cannot be trusted to start a request
                    await self._send_error_response(refused)
                    await self.send(Closed())
                    break
                await self.send(Updated(idle=False))
                self.stream = stream = self._stream_for(event)
                headers = event.headers
                raw = self.config.h11_pass_raw_headers
                await stream.start(
                    event.method,
                    event.target,
                    event.http_version,
                    headers,
                    headers.raw_items() if raw else list(headers),
                    on_first_receive=self._continue if connection.they_are_waiting_for_100_continue else None,
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

    async def _pass_body(self, data: bytes, *, end: bool) -> None:
        stream = self.stream
        if isinstance(stream, GatewayHTTPStream):
            await stream.body(data, end=end)
        elif stream is not None:
            await stream.handle(Body(stream_id=STREAM_ID, data=data))
            if end:
                await stream.handle(EndBody(stream_id=STREAM_ID))

    async def _continue(self) -> None:
        """The app reads the body of a request that expects 100-continue: now the client may send it.

        Only then, so that a request the app refuses on its head alone (a declared Content-Length
        over the limit: 413) never gets a 100 Continue first.
        """
        if self.connection.they_are_waiting_for_100_continue:
            await self._send_h11_event(
                h11.InformationalResponse(status_code=100, headers=self.config.response_headers("h11"))
            )

    def _stream_for(self, request: h11.Request) -> GatewayHTTPStream:
        """The stream of a request; the HTTP/2 preface switches the connection to HTTP/2 instead.

        ``Upgrade`` is ignored: the gateway speaks no protocol one would upgrade to, so the request
        is answered in HTTP/1.1. HTTP/2 comes by ALPN or by the prior-knowledge preface; an ``h2c``
        upgrade over TLS is forbidden (RFC 9113 §3.2) and deprecated altogether, and hypercorn would
        answer it with 101 Switching Protocols (and a WebSocket upgrade with a WebSocket scope).
        """
        if (request.method, request.target, request.http_version) == (b"PRI", b"*", b"2.0"):
            raise H2ProtocolAssumedError(b"PRI * HTTP/2.0\r\n\r\n" + self.connection.trailing_data[0])
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
