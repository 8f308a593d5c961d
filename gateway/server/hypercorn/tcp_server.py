"""``GatewayTCPServer`` replaces hypercorn's per-connection ``TCPServer``.

Reasons:

- **Crash fix.** ``TCPServer.protocol_send`` catches ``BrokenResourceError``/``ClosedResourceError``
  from ``send_all`` but not ``BusyResourceError``, which trio raises when another task is closing
  the stream at the same moment; here it counts like the other two: the peer is gone. A defect in
  one connection is logged and closes that connection only, never the listener.
- **Limits** (docs/inbound.md; the numbers in ``gateway.server.limits``). A connection the client
  closed is released at once (its requests are cancelled after a short grace) instead of waiting
  for the keep-alive timer; request heads (the first one from accept, the TLS handshake included:
  ``handshake.PendingConnection`` did it) and bodies and idle keep-alive connections have
  deadlines (``Watchdog``, ``RequestQueue``); every write has a deadline, so a
  client that does not read, or keeps an HTTP/2 window at zero, cannot pin a reply; open
  connections are registered with the listener's ``InboundRuntime`` for the connection bound and
  for shutdown (``Connection: close`` / GOAWAY while draining). New per-connection limits belong
  here (what the connection does) and in ``gateway.server.limits`` (the numbers and the pure
  bookkeeping).
- **Measured speed.** A reply the socket takes at once is written without a deadline, cancel scope
  or schedule point (``TLSSocketStream.send_now``; ``none`` 289 → 255 µs), and an uncontended send
  lock is taken without yielding. On an idle gateway the reading task runs a plain request's app
  itself while a spare task reads on (``hand_over_reading``; docs/performance.md, "the app runs
  inline on an idle gateway").

Byte-level tests: tests/test_server_inbound.py (slow and silent clients, closed callers, stuck
writers, connection limits, draining, a Busy stream on send) and tests/test_server_hypercorn.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import Any, Final

import h2.errors
import h2.exceptions
import structlog
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr

from gateway.server.hypercorn.config import runtime_of
from gateway.server.hypercorn.protocol import ConnectionProtocol
from gateway.server.hypercorn.task_group import GatewayTaskGroup
from gateway.server.hypercorn.watchdog import Watchdog
from gateway.server.limits import InboundLimits
from gateway.server.timeouts import caller_timeout
from gateway.wire.tls_stream import TLSSocketStream

__all__ = ["GatewayTCPServer"]

log = structlog.get_logger("gateway.server")

# How long the requests of a connection the client closed get to notice (http.disconnect) and end
# by themselves before they are cancelled.
_RELEASE_GRACE: Final = 0.25


class GatewayTCPServer(TCPServer):
    """hypercorn's per-connection server with the inbound limits and the crash fix for sends."""

    protocol: ConnectionProtocol  # type: ignore[assignment]  # the gateway's, not ProtocolWrapper

    def __init__(self, app: Any, config: Any, context: Any, state: Any, stream: Any) -> None:
        # Not hypercorn's __init__: its idle task (a TrioSingleTask and its lock) is the Watchdog here.
        self.app = app
        self.config = config
        self.context = context
        self.state = state
        self.stream = stream
        self.send_lock = trio.Lock()
        self.runtime = runtime_of(self.config)
        self.limits: InboundLimits = self.runtime.limits
        self.watchdog = Watchdog(self, self.runtime.deadlines)
        # (client, server) addresses, as the listener knows them from accept (None: ask the socket).
        self.addresses: tuple[Any, Any] | None = None
        self._host: str | None = None  # the client's, once serving (``InboundRuntime.idle``)
        self.idle = True
        self.aborted = False
        self._goaway_sent = False
        self._poked = False
        self._task_group: GatewayTaskGroup | None = None  # type: ignore[assignment]
        # The task reading from the client right now (None: one is being started); see
        # ``hand_over_reading``. A task that ran a request's app waits in ``_spare`` to read again.
        self._reader: trio.lowlevel.Task | None = None
        self._spare = trio.lowlevel.ParkingLot()
        self._read_over = False
        self._requested = False  # a request began on it (closed by its client before that: unused)
        self.opened = trio.current_time()  # the listener sets when it was accepted

    # --- the listener's side ------------------------------------------------------------------

    def poke(self) -> None:
        self.watchdog.poke()

    def spawn_lifecycle(self) -> None:
        """Draining or terminating began (``Watchdog.poke``): react in a task of this connection."""
        group = self._task_group
        if group is not None and group._nursery is not None:
            with contextlib.suppress(RuntimeError):  # the connection is closing: nothing to react
                group.spawn(self.lifecycle)
        else:
            self._poked = True  # not served yet: ``_serve`` looks when it starts

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
        """Serve the connection; its TLS handshake is done (``handshake.PendingConnection``)."""
        runtime = self.runtime
        runtime.connections.add(self)
        peer = self.addresses[0] if self.addresses is not None else None
        # An IP client's address, kept only when --handshake-rate needs to know its idle connections.
        rated = runtime.limits.handshake_rate > 0
        host = self._host = peer[0] if isinstance(peer, tuple) and rated else None
        if host is not None:  # established, no request yet (``InboundRuntime.idle_for``)
            runtime.connection_idle(host, self, trio.current_time())
        try:
            await self._serve()
        except Exception:
            # A defect in handling one connection must not end the listener (and with it every
            # other caller's connection): log it with its traceback, drop this connection only.
            log.exception("inbound connection failed; closed")
            await trio.aclose_forcefully(self.stream)
        finally:
            runtime.connections.discard(self)
            if host is not None:
                runtime.connection_busy(host, self)
            if self._read_over and not self._requested and not self.aborted:
                runtime.events.connection_unused()  # closed by its client before any request
            self._release()
            runtime.closed()

    def _release(self) -> None:
        """Break the reference cycles among this connection's objects: it has closed.

        The server, its protocol, task group and timer refer to one another (hypercorn builds them
        so: a protocol's ``send`` is the server's bound method, its task group knows the server).
        Left alone, a closed connection's ~45 objects — its h11 or h2 state and buffers and, through
        its stream, OpenSSL's — would be freed only by a full collection of the cyclic GC, which
        runs rarely once they have aged into its oldest generation: 2,000 closed TLS connections
        with half a request head each kept 40 MB resident until one ran (and that collection then
        took ~300 ms of the event loop). Cut here, reference counting frees them the moment the
        connection's task ends (tests/test_server_memory.py).
        """
        protocol = self.__dict__.pop("protocol", None)
        if protocol is not None:
            protocol.release()
        group, self._task_group = self._task_group, None
        if group is not None:
            group.release()
        self.watchdog.release()
        self._reader = None

    async def _serve(self) -> None:
        socket = self.stream.socket
        ssl = isinstance(self.stream, TLSSocketStream)
        alpn_protocol = self.stream.selected_alpn_protocol() if ssl else "http/1.1"
        try:
            if self.addresses is not None:
                client, server = self.addresses
            else:
                client = parse_socket_addr(socket.family, socket.getpeername())
                server = parse_socket_addr(socket.family, socket.getsockname())
            task_group = GatewayTaskGroup(self)
            # A plain nursery rather than ``async with task_group``: hypercorn's ``__aexit__`` drops
            # the nursery's answer, so cancelling the group (a limit closed the connection) would
            # escape as if it came from outside and cancel the whole listener.
            async with trio.open_nursery() as nursery:
                task_group._nursery = nursery
                self._task_group = task_group
                self.protocol = ConnectionProtocol(
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
                # The first request's head counts from accept: the handshake is part of it.
                self.watchdog.set(self.opened + self.limits.header_timeout, "header_timeout")
                if self.runtime.terminating or self._poked:
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
                if protocol.budget.preface_done:  # the connection preface is in: idle from now
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
            if self._host is not None:
                if event.idle:
                    self.runtime.connection_idle(self._host, self, trio.current_time())
                else:
                    self.runtime.connection_busy(self._host, self)
            if not event.idle:
                self._requested = True
                self.watchdog.set(math.inf, "")
            elif self.runtime.terminating or self.context.terminated.is_set():
                self.abort("")
            else:
                if self.runtime.draining:
                    self.watchdog.poke()  # HTTP/2: GOAWAY now that no stream is in flight
                self.watchdog.set(trio.current_time() + self.config.keep_alive_timeout, "idle_timeout")

    async def _close(self) -> None:
        stream: Any = self.stream
        if isinstance(stream, TLSSocketStream):
            # Closes at once: sends no close_notify and waits for nothing (no deadline needed).
            await stream.aclose()
            return
        with trio.move_on_after(1.0) as scope:
            with contextlib.suppress(
                trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError
            ):
                await super()._close()
        if scope.cancelled_caught:
            await trio.aclose_forcefully(self.stream)
