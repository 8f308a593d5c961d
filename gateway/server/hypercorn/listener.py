"""``serve_inbound`` replaces hypercorn's ``worker_serve`` (its trio accept loop) in front of the
gateway's per-connection servers (``GatewayTCPServer``). It is this package's entry point.

hypercorn's ``worker_serve`` accepts with ``trio.serve_listeners``, which logs every failed
``accept`` with a traceback and knows no connection bound, and it captures one SSLContext for the
listener's lifetime. Reasons for this loop:

- **Limit.** A connection beyond ``InboundRuntime.max_connections`` is refused at once (counted,
  reset so that it costs no TIME_WAIT here); new limits on accepting belong here. An accepted
  connection is pending (``handshake.PendingConnection``: its own bound, which evicts the oldest,
  and deadline) until its TLS handshake is done; only then is its server built.
- **Crash fix.** On EMFILE/ENFILE/ENOMEM/ENOBUFS it backs off (10 ms doubling to 1 s) with one
  rate-limited log line and no traceback, while the connections it has keep being served.
- **Certificate rotation.** Each connection is wrapped in TLS with the *current* context of
  ``tls_context()`` when its ClientHello is in, so a rotated certificate is used by the next
  handshake and a broken one never is (``serve.ReloadableTLS``).
- **Measured speed.** The TLS stream is the gateway's own (``gateway.wire.tls_stream``), about half
  the CPU of trio's per round trip (docs/performance.md).

Byte-level tests: tests/test_server_inbound.py (the connection bound, descriptor exhaustion,
certificate rotation, draining and termination over real sockets).
"""

from __future__ import annotations

import contextlib
import errno
import socket as stdlib_socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr

from gateway.server.hypercorn.config import runtime_of
from gateway.server.hypercorn.handshake import PendingConnection
from gateway.server.hypercorn.tcp_server import GatewayTCPServer
from gateway.server.limits import ACCEPT_CAPACITY_ERRNOS, InboundRuntime

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
    scheme = "https" if tls_context is not None else "http"
    urls = [f"{scheme}://{repr_socket_addr(s.family, s.getsockname())}" for s in listening]

    def connection(stream: Any) -> GatewayTCPServer:
        return GatewayTCPServer(wrapped, config, context, state, stream)

    async with trio.open_nursery() as handlers:
        async with trio.open_nursery() as acceptors:
            for sock in listening:
                acceptors.start_soon(
                    _accept_loop,
                    trio.socket.from_stdlib_socket(sock),
                    handlers,
                    connection,
                    tls_context,
                    runtime,
                )
            task_status.started(urls)
            await shutdown_trigger()
            acceptors.cancel_scope.cancel()
        for sock in listening:
            sock.close()
        await context.terminated.set()
        runtime.terminate()


async def _accept_loop(
    listener: trio.socket.SocketType,
    handlers: trio.Nursery,
    connection: Callable[[Any], GatewayTCPServer],
    tls_context: Callable[[], ssl.SSLContext] | None,
    runtime: InboundRuntime,
) -> None:
    backoff = 0.0
    while True:
        try:
            sock, _ = await listener.accept()
        except OSError as exc:
            if exc.errno in ACCEPT_CAPACITY_ERRNOS:
                runtime.accept_failed(exc)
                backoff = min(1.0, backoff * 2 or 0.01)
                await trio.sleep(backoff)
                continue
            if exc.errno in _ACCEPT_IGNORED:
                continue
            raise
        backoff = 0.0
        if not runtime.admit():
            _refuse(sock)
            continue
        pending = PendingConnection(sock, trio.current_time())
        evicted = runtime.begin_pending(pending)  # counted from accept, not from when its task runs
        if evicted is not None:
            evicted.evict()
        handlers.start_soon(_serve_connection, pending, connection, tls_context, runtime)


async def _serve_connection(
    pending: PendingConnection,
    connection: Callable[[Any], GatewayTCPServer],
    tls_context: Callable[[], ssl.SSLContext] | None,
    runtime: InboundRuntime,
) -> None:
    """One connection's task: established (``PendingConnection``), then served (``GatewayTCPServer``)."""
    try:
        stream, reason = await pending.establish(tls_context, runtime.limits)
    finally:
        runtime.end_pending(pending)
    if stream is None:
        if reason:
            runtime.events.connection_closed(reason)
        runtime.closed()
        return
    server = connection(stream)
    server.opened = pending.opened
    await server.run()


def _refuse(sock: trio.socket.SocketType) -> None:
    """Close at once with a reset, so that the refused connection costs no TIME_WAIT here."""
    with contextlib.suppress(OSError):
        sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
