"""``serve_inbound`` replaces hypercorn's ``worker_serve`` (its trio accept loop) in front of the
gateway's per-connection servers (``GatewayTCPServer``). It is this package's entry point.

hypercorn's ``worker_serve`` accepts with ``trio.serve_listeners``, which logs every failed
``accept`` with a traceback and knows no connection bound, and it captures one SSLContext for the
listener's lifetime. Reasons for this loop:

- **Limit.** A connection beyond ``InboundRuntime.max_connections`` is refused at once (counted,
  reset so that it costs no TIME_WAIT here); new limits on accepting belong here. An accepted
  connection is pending (``handshake.PendingConnection``: its own bound, which evicts the oldest,
  and deadline) until its TLS handshake is done; only then is its server built. Its handshake is
  computed when ``handshake.HandshakeGate`` admits it, behind the established connections; while
  ``--max-waiting-handshakes`` wait there, nothing is accepted (``InboundRuntime.accept_room``):
  the next dials wait in the kernel's accept queue (a backlog of 1024), where they cost nothing.
- **Crash fix.** On EMFILE/ENFILE/ENOMEM/ENOBUFS it backs off (10 ms doubling to 1 s) with one
  rate-limited log line and no traceback, while the connections it has keep being served.
- **Certificate rotation.** Each connection is wrapped in TLS with the *current* context of
  ``tls_context()`` when its ClientHello is in, so a rotated certificate is used by the next
  handshake and a broken one never is (``serve.ReloadableTLS``).
- **Measured speed.** The TLS stream is the gateway's own (``gateway.wire.tls_stream``), about half
  the CPU of trio's per round trip (docs/performance.md). A new connection is accepted on the
  plain non-blocking socket, up to 16 per pass of the run loop, and handed to the TLS stream as
  it is (no trio socket object, stream or setsockopt per connection: TCP_NODELAY is inherited
  from the listening socket), its addresses as accept returned them, and its deadlines kept by
  the listener's one timer task (``watchdog.Deadlines``): a new connection cost 585 µs of CPU
  beyond its request, 465 µs after (the TLS handshake alone: ~265 µs;
  ``python benchmarks/bench_connection.py``, docs/inbound.md).

Byte-level tests: tests/test_server_inbound.py (the connection bound, descriptor exhaustion,
certificate rotation, draining and termination over real sockets).
"""

from __future__ import annotations

import errno
import socket as stdlib_socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr, repr_socket_addr

from gateway.server.cgroup import CpuShare
from gateway.server.hypercorn.config import runtime_of
from gateway.server.hypercorn.handshake import (
    ABANDONED,
    BUSY_CPU_SHARE,
    HANDSHAKE_FAILURES,
    STALE_DIAL_IDLE,
    HandshakeGate,
    PendingConnection,
    client_gone,
    reset,
)
from gateway.server.hypercorn.tcp_server import GatewayTCPServer
from gateway.server.hypercorn.watchdog import Deadlines
from gateway.server.limits import ACCEPT_CAPACITY_ERRNOS, InboundRuntime

# Connections accepted in one pass of the run loop, at most (then the other tasks run).
_ACCEPT_BATCH = 16
# ... and connections taken from the kernel's queue, dials given up there included.
_ACCEPT_EXAMINED = 8 * _ACCEPT_BATCH

# A connection that went away between the kernel's accept queue and accept(): not our problem.
_ACCEPT_IGNORED = frozenset(
    e for e in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM, getattr(errno, "ENOSR", None)) if e is not None
)


async def serve_inbound(
    app: Any,
    config: HypercornConfig,
    *,
    tls_context: Callable[[], ssl.SSLContext] | None,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``config.bind`` until ``shutdown_trigger`` returns, then terminate.

    Terminating stops accepting, closes idle connections at once and lets busy ones close after
    their last answer; the caller bounds how long that may take (it cancels this task).
    """
    runtime = runtime_of(config)
    context = WorkerContext(None)
    wrapped = ASGIWrapper(app)
    state = ConnectionState({})
    sockets = config.create_sockets()
    listening = [*sockets.secure_sockets, *sockets.insecure_sockets]
    for sock in listening:
        sock.listen(config.backlog)
        sock.setblocking(False)
        if sock.family in (stdlib_socket.AF_INET, stdlib_socket.AF_INET6):
            # Accepted connections inherit it (Linux): no setsockopt per connection.
            sock.setsockopt(stdlib_socket.IPPROTO_TCP, stdlib_socket.TCP_NODELAY, 1)
    scheme = "https" if tls_context is not None else "http"
    urls = [f"{scheme}://{repr_socket_addr(s.family, s.getsockname())}" for s in listening]

    deadlines = Deadlines()
    runtime.deadlines = deadlines
    async with trio.open_nursery() as timers:
        timers.start_soon(deadlines.run)  # every connection's deadlines: one task (``watchdog``)
        if tls_context is not None and runtime.limits.handshake_burst > 0:
            cpu = CpuShare(runtime.cpu_budget)
            runtime.handshakes = HandshakeGate(
                runtime.limits.handshake_burst,
                busy=lambda: cpu.share() >= BUSY_CPU_SHARE,
                rate=runtime.limits.handshake_rate,
            )
            timers.start_soon(runtime.handshakes.run)
        async with trio.open_nursery() as handlers:
            async with trio.open_nursery() as acceptors:
                for sock in listening:
                    local = parse_socket_addr(sock.family, sock.getsockname())

                    def connection(stream: Any, peer: Any, local: Any = local) -> GatewayTCPServer:
                        server = GatewayTCPServer(wrapped, config, context, state, stream)
                        server.addresses = (peer, local)
                        return server

                    acceptors.start_soon(_accept_loop, sock, handlers, connection, tls_context, runtime)
                task_status.started(urls)
                await shutdown_trigger()
                acceptors.cancel_scope.cancel()
            for sock in listening:
                sock.close()
            await context.terminated.set()
            runtime.terminate()
        timers.cancel_scope.cancel()  # every connection has ended: no deadline is left


async def _accept_loop(
    listener: stdlib_socket.socket,
    handlers: trio.Nursery,
    connection: Callable[[Any, Any], GatewayTCPServer],
    tls_context: Callable[[], ssl.SSLContext] | None,
    runtime: InboundRuntime,
) -> None:
    """Accept on the (non-blocking) listening socket itself: no trio socket object per connection.

    It accepts what the kernel's queue holds, up to ``_ACCEPT_BATCH`` connections per pass of the
    run loop, then lets the other tasks run; while ``runtime.accept_room`` handshakes wait for the
    event loop (``HandshakeGate``), it accepts none, and in one pass at most as many as would fill
    that room (the ones accepted in a pass reach the gate only once their tasks run). A TLS dial
    whose client closed it while it waited in the kernel's queue (Go's transport gives a dial up at
    its TLS handshake timeout, counted from the TCP connect) is reset at accept and counted, taking
    no place at the gate: the queue is first in, first out, and live dials wait behind the given-up
    ones.
    """
    backoff = 0.0
    room = runtime.accept_room
    while True:
        batch = _ACCEPT_BATCH
        gate = runtime.handshakes
        if room and gate is not None:
            if gate.waiting >= room:
                paused = trio.current_time()
                await gate.room(room)
                runtime.events.accept_paused(trio.current_time() - paused)
            batch = min(batch, room - gate.waiting)
        taken = examined = 0
        while taken < batch and examined < _ACCEPT_EXAMINED:
            examined += 1
            try:
                sock, peer = listener.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(listener)
                break
            except OSError as exc:
                if exc.errno in ACCEPT_CAPACITY_ERRNOS:
                    runtime.accept_failed(exc)
                    backoff = min(1.0, backoff * 2 or 0.01)
                    await trio.sleep(backoff)
                    break
                if exc.errno in _ACCEPT_IGNORED:
                    continue
                raise
            backoff = 0.0
            sock.setblocking(False)
            if room and gate is not None and client_gone(sock):  # a TLS dial given up in the queue
                reset(sock)
                runtime.events.handshake_abandoned("accept_queue")
                continue
            if not runtime.admit():
                reset(sock)  # refused: a reset, so that it costs no TIME_WAIT here
                continue
            taken += 1
            pending = PendingConnection(sock, trio.current_time(), peer)
            evicted = runtime.begin_pending(pending)  # counted from accept, not from when its task runs
            if evicted is not None:
                evicted.evict()
            handlers.start_soon(_serve_connection, pending, connection, tls_context, runtime)
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()


async def _serve_connection(
    pending: PendingConnection,
    connection: Callable[[Any, Any], GatewayTCPServer],
    tls_context: Callable[[], ssl.SSLContext] | None,
    runtime: InboundRuntime,
) -> None:
    """One connection's task: established (``PendingConnection``), then served (``GatewayTCPServer``)."""
    try:
        host = pending.peer[0] if isinstance(pending.peer, tuple) else None  # an IP client's address

        def stale() -> bool:  # a connection of its client's is idle: no review waits for this dial
            return host is not None and runtime.idle_for(host, trio.current_time()) >= STALE_DIAL_IDLE

        stream, reason = await pending.establish(tls_context, runtime.limits, runtime.handshakes, stale)
    finally:
        runtime.end_pending(pending)
    if stream is None:
        if reason == ABANDONED:
            runtime.events.handshake_abandoned("gate")
        elif reason in HANDSHAKE_FAILURES:
            runtime.events.handshake_failed(reason)
        elif reason:
            runtime.events.connection_closed(reason)
        runtime.closed()
        return
    server = connection(stream, pending.peer)
    server.opened = pending.opened
    await server.run()
