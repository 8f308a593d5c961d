"""One HTTP/1.1 connection to a backend: drives an ``h11.Connection`` over a trio stream.

The pool hands a connection to one call at a time; after a clean exchange it goes back to the
pool's idle list, anything else (error, cancellation, ``Connection: close``) retires it.
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from typing import Literal

import h11
import trio

from gateway.errors import ResponseTooLarge, TransportError
from gateway.transport.wire import Header, HTTPResponse, socket_peer, stream_error

RECEIVE_BYTES = 65536
ConnectionState = Literal["ACTIVE", "IDLE", "CLOSED"]


class HTTP11Connection:
    """An HTTP/1.1 connection; ``request`` is never called concurrently (the pool guarantees it)."""

    def __init__(self, stream: trio.abc.Stream, label: str) -> None:
        self._stream = stream
        self._h11 = h11.Connection(h11.CLIENT)
        self._peer = socket_peer(stream)
        inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        self._fileno = inner.socket.fileno() if isinstance(inner, trio.SocketStream) else -1
        self.label = label
        self.state: ConnectionState = "IDLE"
        self.requests = 0
        self.idle_since = trio.current_time()

    def __repr__(self) -> str:
        return f"<HTTP11Connection {self.label} {self.state} requests={self.requests}>"

    def peer_closed_while_idle(self) -> bool:
        """True when an idle connection has something to read: the peer closed it (or misbehaves)."""
        # A healthy idle HTTP/1.1 connection has nothing to read; EOF or reset show as readable.
        poller = select.poll()
        poller.register(self._fileno, select.POLLIN)
        return bool(poller.poll(0))

    async def request(
        self, target: bytes, headers: Sequence[Header], body: bytes, *, max_response_bytes: int
    ) -> HTTPResponse:
        """POST ``body`` to ``target`` and read the whole reply.

        Raises ``ResponseTooLarge`` past ``max_response_bytes``, ``TransportError`` otherwise; never
        ``RetryableError``: once ``send_all`` started, some of the request may have reached the
        backend, and a POST the backend may have processed is never sent again (FPT-10). A stale
        pooled connection is caught before writing, by ``peer_closed_while_idle``. Unless the
        exchange ends cleanly, the connection is left ``CLOSED`` for the pool to dispose of.
        """
        self.requests += 1
        self.state = "CLOSED"  # until proven reusable
        connection = self._h11
        try:
            parts = [connection.send(h11.Request(method=b"POST", target=target, headers=list(headers)))]
            if body:
                parts.append(connection.send(h11.Data(data=body)))
            parts.append(connection.send(h11.EndOfMessage()))
        except h11.LocalProtocolError as exc:
            raise TransportError(f"net/http: invalid request: {exc}") from exc
        try:
            await self._stream.send_all(b"".join(part for part in parts if part))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise TransportError(stream_error(exc, "write", self._peer)) from exc
        response = await self._receive(max_response_bytes)
        if connection.our_state is h11.DONE and connection.their_state is h11.DONE:
            connection.start_next_cycle()
            self.state = "IDLE"
            self.idle_since = trio.current_time()
        return response

    async def _receive(self, limit: int) -> HTTPResponse:
        connection = self._h11
        status = 0
        headers: list[Header] = []
        body = bytearray()
        received_any = eof = False
        while True:
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError as exc:
                raise TransportError(
                    "unexpected EOF" if eof else f"net/http: HTTP/1.x transport connection broken: {exc}"
                ) from exc
            if event is h11.NEED_DATA:
                try:
                    chunk = await self._stream.receive_some(RECEIVE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise TransportError(stream_error(exc, "read", self._peer)) from exc
                if not chunk and not received_any:
                    raise TransportError("EOF")
                received_any = True
                eof = not chunk
                connection.receive_data(bytes(chunk))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = list(event.headers)
                length = _content_length(headers)
                if length is not None and length > limit:
                    raise ResponseTooLarge(limit)
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > limit:
                    raise ResponseTooLarge(limit)
            elif isinstance(event, h11.EndOfMessage):
                return HTTPResponse(status, headers, bytes(body), "HTTP/1.1")
            elif isinstance(event, h11.ConnectionClosed):
                raise TransportError("unexpected EOF")
            # h11.InformationalResponse (1xx before the final reply) is skipped.

    async def aclose(self) -> None:
        """Close at once (no TLS close_notify wait); safe to call under cancellation."""
        self.state = "CLOSED"
        await trio.aclose_forcefully(self._stream)


def _content_length(headers: list[Header]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
