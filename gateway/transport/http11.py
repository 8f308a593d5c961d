"""One pooled HTTP/1.1 connection to a backend, on the shared exchange loop (``gateway.wire.http11``).

The pool hands a connection to one call at a time; after a clean exchange it goes back to the
pool's idle list, anything else (error, cancellation, ``Connection: close``) retires it.
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from typing import Literal

import trio

from gateway.transport.wire import Header, HTTPResponse
from gateway.wire.http11 import HTTP11Exchange
from gateway.wire.tls_stream import stream_socket

ConnectionState = Literal["ACTIVE", "IDLE", "CLOSED"]


class HTTP11Connection:
    """An HTTP/1.1 connection; ``request`` is never called concurrently (the pool guarantees it)."""

    def __init__(self, stream: trio.abc.Stream, label: str) -> None:
        self._exchange = HTTP11Exchange(stream)
        sock = stream_socket(stream)
        self._fileno = sock.fileno() if sock is not None else -1
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
        exchange = self._exchange
        await exchange.send(b"POST", target, headers, body)
        status, response_headers = await exchange.receive_head(max_response_bytes)
        response_body = await exchange.receive_body(max_response_bytes)
        if exchange.reusable:
            self.state = "IDLE"
            self.idle_since = trio.current_time()
        return HTTPResponse(status, response_headers, response_body, "HTTP/1.1")

    async def aclose(self) -> None:
        """Close at once (no TLS close_notify wait); safe to call under cancellation."""
        self.state = "CLOSED"
        await self._exchange.aclose()
