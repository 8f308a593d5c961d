"""The one HTTP/1.1 client exchange loop: h11 driven over a trio stream.

Used by backend calls (``gateway.transport.http11``: pooled, keep-alive POSTs), the Kubernetes API
client (``gateway.sources.kube``: GETs and streamed watches) and the load generator. It sends a
request, reads the reply head, then the body whole (bounded) or piece by piece; every failure is a
``TransportError`` mapped once (``gateway.wire.errors``). Deadlines belong to the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import h11
import trio

from gateway.errors import ResponseTooLarge, TransportError
from gateway.wire.errors import socket_peer, stream_error
from gateway.wire.http11_plain import (
    END_OF_HEAD,
    MAX_HEAD_BYTES,
    PlainResponse,
    frame_request,
    parse_plain_response,
)

Header = tuple[bytes, bytes]
RECEIVE_BYTES = 65536


class HTTP11Exchange:
    """One HTTP/1.1 client connection; one request at a time (the caller guarantees it).

    Speed: a plain exchange (``http11_plain``: a GET or POST with its length, answered with a
    ``Content-Length`` body) is framed and read without h11, which then stays idle. A reply that is
    not plain is handed to h11 as if h11 had sent the request (``_to_h11``), and read by h11.
    """

    __slots__ = ("_buffer", "_eof", "_h11", "_plain", "_received_any", "_request", "peer", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._h11 = h11.Connection(h11.CLIENT)
        self.peer = socket_peer(stream)
        self._received_any = False
        self._eof = False
        # The plain exchange in progress: the request (for handing it to h11), what was read past
        # it, and then the reply's body length left to read (-1: not yet known; None: h11's turn).
        self._request: tuple[bytes, bytes, Sequence[Header], bytes] | None = None
        self._buffer = b""
        self._plain: int | None = None

    @property
    def reusable(self) -> bool:
        """True after a complete exchange on a connection both sides keep open."""
        if self._plain is not None:
            return self._plain == 0 and not self._buffer  # read to its end, nothing after it
        return self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE

    async def send(self, method: bytes, target: bytes, headers: Sequence[Header], body: bytes = b"") -> None:
        """Write one whole request (head and body)."""
        connection = self._h11
        if connection.our_state is h11.DONE and connection.their_state is h11.DONE:
            connection.start_next_cycle()
        if self._plain or self._buffer:
            # A plain reply not read to its end (or followed by stray bytes): the next reply could
            # not be told apart from its rest. h11 refuses a new request in that state too.
            raise TransportError("net/http: invalid request: the previous reply was not read to its end")
        self._received_any = False
        self._plain = None
        data = None
        if connection.our_state is h11.IDLE and connection.their_state is h11.IDLE:
            data = frame_request(method, target, headers, body)
        if data is not None:
            self._request = (method, target, headers, body)
            self._plain = -1
        else:
            try:
                data = (
                    connection.send(h11.Request(method=method, target=target, headers=list(headers))) or b""
                )
                if body:
                    data += connection.send(h11.Data(data=body)) or b""
                data += connection.send(h11.EndOfMessage()) or b""
            except h11.LocalProtocolError as exc:
                raise TransportError(f"net/http: invalid request: {exc}") from exc
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise stream_error(exc, "write", self.peer) from exc

    async def receive_head(self, max_body_bytes: int | None = None) -> tuple[int, list[Header]]:
        """The final reply's status and headers (1xx replies are skipped).

        ``ResponseTooLarge`` at once when the declared Content-Length exceeds ``max_body_bytes``.
        """
        if self._plain is not None:
            head = await self._plain_head()
            if head is not None:
                if max_body_bytes is not None and head.length > max_body_bytes:
                    raise ResponseTooLarge(max_body_bytes)
                return head.status, head.headers
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Response):
                headers = list(event.headers)
                if max_body_bytes is not None:
                    length = _content_length(headers)
                    if length is not None and length > max_body_bytes:
                        raise ResponseTooLarge(max_body_bytes)
                return event.status_code, headers
            if not isinstance(event, h11.InformationalResponse):
                raise TransportError(f"net/http: unexpected {type(event).__name__} before the response")

    async def receive_data(self) -> bytes | None:
        """The next piece of the body, ``None`` at its end; a truncated body is an error."""
        if self._plain is not None:
            return await self._plain_data()
        event = await self._next_event()
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            return None
        raise TransportError("unexpected EOF")

    async def receive_body(self, limit: int) -> bytes:
        """The whole body; ``ResponseTooLarge`` past ``limit`` bytes."""
        if self._plain is not None:
            if self._plain > limit:
                raise ResponseTooLarge(limit)
            parts: list[bytes] = []
            while (chunk := await self._plain_data()) is not None:
                parts.append(chunk)
            return b"".join(parts)  # a single part is returned as it is, not copied
        body = bytearray()
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > limit:
                    raise ResponseTooLarge(limit)
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                raise TransportError("unexpected EOF")

    async def _plain_head(self) -> PlainResponse | None:
        """Read the reply head of a plain exchange; None when it is not plain (h11 has it now)."""
        buffer = self._buffer
        while END_OF_HEAD not in buffer:
            if len(buffer) > MAX_HEAD_BYTES:
                break
            chunk = await self._receive()
            if not chunk:
                break  # h11 reports the EOF as it always did
            buffer = chunk if not buffer else buffer + chunk
        self._buffer = buffer
        head = parse_plain_response(buffer) if END_OF_HEAD in buffer else None
        if head is None:
            self._to_h11()
            return None
        self._request = None
        self._buffer = buffer[head.head_size :]
        self._plain = head.length
        return head

    async def _plain_data(self) -> bytes | None:
        """The next piece of a plain reply's body, None at its end."""
        left = self._plain
        assert left is not None
        if not left:
            return None
        data = self._buffer
        if data:
            self._buffer = b""
        else:
            data = await self._receive()
            if not data:
                self._plain = None  # truncated: the connection is not reused
                raise TransportError("unexpected EOF")
        if len(data) > left:  # bytes past the reply: the connection is not reused
            self._buffer, data = data[left:], data[:left]
        self._plain = left - len(data)
        return data

    def _to_h11(self) -> None:
        """Give h11 the exchange so far: the request as if h11 had sent it, and the reply's bytes."""
        assert self._request is not None
        method, target, headers, body = self._request
        connection = self._h11
        connection.send(h11.Request(method=method, target=target, headers=list(headers)))
        if body:
            connection.send(h11.Data(data=body))
        connection.send(h11.EndOfMessage())
        connection.receive_data(self._buffer)
        if self._eof:
            connection.receive_data(b"")
        self._request = None
        self._buffer = b""
        self._plain = None

    async def _receive(self) -> bytes:
        try:
            chunk = await self.stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise stream_error(exc, "read", self.peer) from exc
        if not chunk and not self._received_any:
            raise TransportError("EOF")  # closed before a single byte of the reply
        self._received_any = True
        self._eof = not chunk
        return chunk if type(chunk) is bytes else bytes(chunk)

    async def _next_event(self) -> h11.Event:
        connection = self._h11
        while True:
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError as exc:
                if self._eof:
                    raise TransportError("unexpected EOF") from exc
                raise TransportError(f"net/http: HTTP/1.x transport connection broken: {exc}") from exc
            if event is h11.NEED_DATA:
                connection.receive_data(await self._receive())
            elif event is h11.PAUSED:
                raise TransportError("net/http: HTTP/1.x transport connection broken: data after the reply")
            elif isinstance(event, h11.ConnectionClosed):
                raise TransportError("unexpected EOF")
            else:
                assert isinstance(event, h11.Event)
                return event

    async def aclose(self) -> None:
        """Close at once (no TLS close_notify wait); safe to call under cancellation."""
        await trio.aclose_forcefully(self.stream)


def _content_length(headers: list[Header]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
