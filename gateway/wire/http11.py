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

Header = tuple[bytes, bytes]
RECEIVE_BYTES = 65536


class HTTP11Exchange:
    """One HTTP/1.1 client connection; one request at a time (the caller guarantees it)."""

    __slots__ = ("_eof", "_h11", "_received_any", "peer", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._h11 = h11.Connection(h11.CLIENT)
        self.peer = socket_peer(stream)
        self._received_any = False
        self._eof = False

    @property
    def reusable(self) -> bool:
        """True after a complete exchange on a connection both sides keep open."""
        return self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE

    async def send(self, method: bytes, target: bytes, headers: Sequence[Header], body: bytes = b"") -> None:
        """Write one whole request (head and body)."""
        connection = self._h11
        if connection.our_state is h11.DONE and connection.their_state is h11.DONE:
            connection.start_next_cycle()
        self._received_any = False
        try:
            data = connection.send(h11.Request(method=method, target=target, headers=list(headers))) or b""
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
        event = await self._next_event()
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            return None
        raise TransportError("unexpected EOF")

    async def receive_body(self, limit: int) -> bytes:
        """The whole body; ``ResponseTooLarge`` past ``limit`` bytes."""
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
                try:
                    chunk = await self.stream.receive_some(RECEIVE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise stream_error(exc, "read", self.peer) from exc
                if not chunk and not self._received_any:
                    raise TransportError("EOF")  # closed before a single byte of the reply
                self._received_any = True
                self._eof = not chunk
                connection.receive_data(bytes(chunk))
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
