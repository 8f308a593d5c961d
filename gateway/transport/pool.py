"""The outbound HTTP client: a pool of HTTP/1.1 and HTTP/2 connections per backend origin.

Bottom of the call path: the dispatcher's caller resolves a ``Target`` and awaits ``post``; this
module connects (DNS, TCP, TLS, ALPN), reuses and retires connections, bounds the whole call by its
deadline (FPT-05) and maps every failure to ``TransportError`` (ERR-06). Redirects are returned,
not followed (FPT-11). The pool owns a nursery: HTTP/2 reader/writer tasks and the idle reaper.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType

import trio

from gateway import __version__
from gateway.errors import TransportError, TransportTimeout
from gateway.transport.http2 import HTTP2Connection
from gateway.transport.http11 import HTTP11Connection
from gateway.transport.resolve import Origin, Target
from gateway.transport.wire import Header, HTTPResponse, RetryableError
from gateway.wire.errors import dial_error, hostport, tls_error
from gateway.wire.tls_stream import TLSSocketStream

DEFAULT_MAX_RESPONSE_BYTES = 16 * 1024 * 1024  # TRN-12
DEFAULT_MAX_CONNECTIONS_PER_ORIGIN = 64
DEFAULT_IDLE_TIMEOUT_SECONDS = 90.0  # Go's http.Transport IdleConnTimeout
CLOSE_GRACE_SECONDS = 1.0

Connection = HTTP11Connection | HTTP2Connection


class _OriginConnections:
    """The connections of one origin, and the callers waiting for one."""

    __slots__ = ("busy", "connecting", "h1_only", "h2", "idle", "label", "lot", "origin")

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.label = hostport(origin.host, origin.port)
        self.idle: list[HTTP11Connection] = []  # most recently used last: reused first
        self.busy: dict[HTTP11Connection, None] = {}
        self.h2: list[HTTP2Connection] = []
        self.connecting = 0
        self.h1_only = False  # an HTTP/2-capable origin answered ALPN with http/1.1
        self.lot = trio.lowlevel.ParkingLot()

    def count(self) -> int:
        return len(self.idle) + len(self.busy) + len(self.h2) + self.connecting

    def changed(self) -> None:
        self.h2 = [connection for connection in self.h2 if not connection.closed]
        self.lot.unpark_all()

    def connections(self) -> list[Connection]:
        return [*self.busy, *reversed(self.idle), *self.h2]


class ClientPool:
    """Pooled HTTP client for backend calls; use as ``async with ClientPool() as pool``.

    ``connect_override`` maps a target host to the (ip, port) actually dialled, keeping the TLS
    server name (tests, sidecars). ``h2c_prior_knowledge`` speaks HTTP/2 without TLS to loopback
    ``http`` targets.
    """

    def __init__(
        self,
        *,
        max_connections_per_origin: int = DEFAULT_MAX_CONNECTIONS_PER_ORIGIN,
        idle_timeout_seconds: float = DEFAULT_IDLE_TIMEOUT_SECONDS,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        h2c_prior_knowledge: bool = False,
        connect_override: Mapping[str, tuple[str, int]] | None = None,
        user_agent: str = f"webhook-gateway/{__version__}",
        on_peer_certificate: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self._max_connections = max_connections_per_origin
        self._idle_timeout = idle_timeout_seconds
        self._max_response_bytes = max_response_bytes
        self._h2c = h2c_prior_knowledge
        self._connect_override = dict(connect_override or {})
        # after every TLS handshake: (server name, the certificate the backend presented, DER)
        self._on_peer_certificate = on_peer_certificate
        self._user_agent = user_agent.encode()
        # TRN-05: sent with every call, after the request line or pseudo-headers.
        self._fixed_headers: tuple[Header, ...] = (
            (b"content-type", b"application/json"),
            (b"accept", b"application/json, */*"),
            (b"user-agent", self._user_agent),
        )
        self._origins: dict[Origin, _OriginConnections] = {}
        self._exit_stack = AsyncExitStack()
        self._nursery: trio.Nursery | None = None
        self._reaper_scope = trio.CancelScope()
        self._closed = False

    def __repr__(self) -> str:
        connections = [c for group in self._origins.values() for c in group.connections()]
        return f"<ClientPool origins={len(self._origins)} connections={connections!r}>"

    async def __aenter__(self) -> ClientPool:
        self._nursery = await self._exit_stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._reap_idle_connections)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        self._closed = True
        self._reaper_scope.cancel()
        assert self._nursery is not None
        # HTTP/2 connections get a moment to write GOAWAY; the deadline bounds shutdown.
        self._nursery.cancel_scope.deadline = trio.current_time() + CLOSE_GRACE_SECONDS
        with trio.CancelScope(shield=True):
            for group in self._origins.values():
                for connection in group.connections():
                    if isinstance(connection, HTTP2Connection):
                        connection.close_gracefully()
                    else:
                        await connection.aclose()
        self._origins.clear()
        return await self._exit_stack.__aexit__(exc_type, exc, traceback)

    def open_connections(self) -> dict[Origin, int]:
        """Open (or opening) connections per origin, for metrics."""
        return {origin: group.count() for origin, group in self._origins.items() if group.count()}

    async def post(
        self,
        target: Target,
        *,
        body: bytes,
        headers: Sequence[Header] = (),
        timeout_seconds: float,
    ) -> HTTPResponse:
        """POST a JSON body to ``target`` and return the complete reply (any status, 3xx included).

        Adds the TRN-05 headers and the target's credentials; ``headers`` are extra ones. The whole
        call is bounded by ``timeout_seconds`` (``TransportTimeout``); other failures raise
        ``TransportError`` and ``ResponseTooLarge`` (TRN-12).
        """
        if timeout_seconds <= 0:
            raise TransportTimeout()
        if self._closed or self._nursery is None:
            raise TransportError("client pool is closed")
        deadline = trio.current_time() + timeout_seconds
        group = self._origins.get(target.origin)
        if group is None:
            group = self._origins[target.origin] = _OriginConnections(target.origin)
        path = target.wire_request_target(timeout_seconds)
        common: list[Header] = [
            *self._fixed_headers,
            (b"content-length", b"%d" % len(body)),
            *target.auth_headers,
        ]
        for name, value in headers:
            common.append((name.lower(), value))

        def h2_headers() -> list[Header]:
            return [*target.pseudo_headers(), (b":path", path), *common]

        # At most one resend, and only of a request the backend provably never processed.
        attempts = 2
        # Speed: a free HTTP/2 stream slot is taken without a schedule point, and the only wait
        # left is the reply's, which the connection's timer bounds (no cancel scope of our own).
        free = _free_h2_stream(group)
        if free is not None:
            try:
                return await free.request(
                    h2_headers(), body, max_response_bytes=self._max_response_bytes, deadline=deadline
                )
            except RetryableError:
                attempts = 1
            finally:
                self._release_stream(group, free)
        with trio.move_on_at(deadline):
            for attempt in range(attempts):
                connection = await self._acquire(group, target)
                try:
                    if isinstance(connection, HTTP2Connection):
                        return await connection.request(
                            h2_headers(),
                            body,
                            max_response_bytes=self._max_response_bytes,
                        )
                    return await connection.request(
                        path,
                        [target.host_header(), *common],
                        body,
                        max_response_bytes=self._max_response_bytes,
                    )
                except RetryableError as exc:
                    if attempt == attempts - 1:
                        raise TransportError(exc.cause, exc.kind) from exc
                finally:
                    if isinstance(connection, HTTP2Connection):
                        self._release_stream(group, connection)
                    else:
                        await self._release_connection(group, connection)
            raise AssertionError("unreachable")
        raise TransportTimeout()

    async def _acquire(self, group: _OriginConnections, target: Target) -> Connection:
        may_speak_h2 = target.http2_allowed and (target.scheme == "https" or self._h2c)
        while True:
            # The reaper forgets empty origins; a caller that slept meanwhile puts its own back.
            self._origins.setdefault(group.origin, group)
            for h2_connection in group.h2:
                if h2_connection.can_open_stream():
                    h2_connection.reserved += 1
                    return h2_connection
            while group.idle:
                connection = group.idle.pop()
                expired = connection.idle_since + self._idle_timeout <= trio.current_time()
                if expired or connection.peer_closed_while_idle():
                    await _close(connection)
                    continue
                connection.state = "ACTIVE"
                group.busy[connection] = None
                return connection
            opening = group.connecting or any(not c.ready for c in group.h2)
            if opening and may_speak_h2 and not group.h1_only:
                # The connection being opened may multiplex us: wait for it instead of dialling.
                await group.lot.park()
                continue
            if group.count() < self._max_connections:
                h1_connection = await self._connect(group, target)
                if h1_connection is not None:
                    return h1_connection
                continue  # a new HTTP/2 connection: take a stream slot like everyone else
            await group.lot.park()

    async def _connect(self, group: _OriginConnections, target: Target) -> HTTP11Connection | None:
        group.connecting += 1
        try:
            stream, alpn = await self._open_stream(target)
            speak_h2 = alpn == "h2" or (target.scheme == "http" and self._h2c and target.http2_allowed)
            if not speak_h2:
                if target.http2_allowed and target.scheme == "https":
                    group.h1_only = True
                connection = HTTP11Connection(stream, group.label)
                connection.state = "ACTIVE"
                group.busy[connection] = None
                return connection
            h2_connection = HTTP2Connection(stream, group.label, on_change=group.changed)
            assert self._nursery is not None
            await self._nursery.start(h2_connection.run)
            group.h2.append(h2_connection)
        finally:
            group.connecting -= 1
            group.lot.unpark_all()
        try:
            await h2_connection.wait_ready()
        except BaseException:
            h2_connection.abort()
            raise
        return None

    async def _open_stream(self, target: Target) -> tuple[trio.abc.Stream, str | None]:
        host, port = self._connect_override.get(target.host, (target.host, target.port))
        try:
            tcp = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            raise dial_error(exc, host, port) from exc
        if target.scheme == "http":
            return tcp, None
        assert target.ssl_context is not None
        try:
            tls = TLSSocketStream(tcp, target.ssl_context, server_hostname=target.server_hostname)
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            await trio.aclose_forcefully(tls)
            raise tls_error(exc, target.server_hostname) from exc
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
        if self._on_peer_certificate is not None:
            der = tls.getpeercert(binary_form=True)
            if isinstance(der, bytes):
                self._on_peer_certificate(target.server_hostname or target.host, der)
        return tls, tls.selected_alpn_protocol()

    def _release_stream(self, group: _OriginConnections, connection: HTTP2Connection) -> None:
        connection.reserved -= 1
        if connection.reserved == 0:
            connection.idle_since = trio.current_time()
            if connection.goaway:
                connection.close_gracefully()
        if group.lot:
            group.lot.unpark_all()

    async def _release_connection(self, group: _OriginConnections, connection: HTTP11Connection) -> None:
        del group.busy[connection]
        if connection.state == "IDLE" and not self._closed:
            group.idle.append(connection)
        else:
            await _close(connection)
        if group.lot:
            group.lot.unpark_all()

    async def retire_idle_connections(self) -> None:
        """Close connections idle for longer than the idle timeout; forget empty origins."""
        deadline = trio.current_time() - self._idle_timeout
        for origin, group in list(self._origins.items()):
            keep = []
            for connection in group.idle:
                if connection.idle_since <= deadline:
                    await _close(connection)
                else:
                    keep.append(connection)
            group.idle = keep
            for h2_connection in group.h2:
                if h2_connection.reserved == 0 and h2_connection.idle_since <= deadline:
                    h2_connection.close_gracefully()
            if not group.count() and not group.lot:
                del self._origins[origin]

    async def _reap_idle_connections(self) -> None:
        with self._reaper_scope:
            while True:
                await trio.sleep(max(self._idle_timeout / 2, 0.05))
                await self.retire_idle_connections()


def _free_h2_stream(group: _OriginConnections) -> HTTP2Connection | None:
    """A stream slot on one of the group's HTTP/2 connections, reserved; None if none is free."""
    for connection in group.h2:
        if connection.can_open_stream():
            connection.reserved += 1
            return connection
    return None


async def _close(connection: HTTP11Connection) -> None:
    # Cleanup runs even when the caller was cancelled: shielded, and bounded.
    with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_GRACE_SECONDS):
        await connection.aclose()
