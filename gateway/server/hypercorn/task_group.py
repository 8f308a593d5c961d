"""``GatewayTaskGroup`` replaces hypercorn's per-connection ``TaskGroup``; ``StreamTaskGroup`` is
its view for one HTTP/2 stream.

Reasons:

- **Measured speed.** A request's ``receive`` is a ``RequestQueue`` instead of a memory channel,
  and the queue is given to the app as the ``webhook-gateway.disconnect`` scope extension
  (``gateway.server.extensions``): about 50 µs per review (docs/performance.md). On an otherwise
  idle gateway a plain HTTP/1.1 request's app runs in the task that read it (``run_inline``; the
  row "the app runs inline on an idle gateway" of docs/performance.md).
- **Limit.** Each request gets its body deadline, and an HTTP/2 reply its write deadline
  (``GatewayTCPServer.bounded_send``); requests in flight are counted for the listener.

hypercorn calls ``spawn_app(app, config, scope, send)`` without saying which stream or protocol
the request came on; the gateway's protocols say it instead of the task group guessing it: the
HTTP/1.1 stream calls ``start_request`` itself, and the HTTP/2 protocol hands each stream a
``StreamTaskGroup`` that knows its stream id (``GuardedH2Protocol._create_stream``).

Byte-level tests: tests/test_server_hypercorn.py, tests/test_server_http11.py and
tests/test_server_inbound.py (slow bodies, stuck writers, closed callers over real sockets).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.protocol.h11 import STREAM_ID
from hypercorn.trio.task_group import TaskGroup, _handle

from gateway.server.extensions import DISCONNECT
from gateway.server.hypercorn.request_queue import RequestQueue

if TYPE_CHECKING:
    from gateway.server.hypercorn.tcp_server import GatewayTCPServer
    from gateway.server.limits import InboundRuntime

__all__ = ["GatewayTaskGroup", "StreamTaskGroup"]

Send = Callable[[Any], Awaitable[None]]


class GatewayTaskGroup(TaskGroup):
    """hypercorn's per-connection task group: a ``RequestQueue`` per request, deadlines on sends."""

    def __init__(self, server: GatewayTCPServer | None = None) -> None:
        super().__init__()
        self._server = server
        self._inline: Callable[[], Awaitable[None]] | None = None

    def cancel(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def release(self) -> None:
        """The connection has closed: forget it (``GatewayTCPServer._release``)."""
        self._server = None
        self._nursery = None
        self._inline = None

    def cancel_after(self, seconds: float) -> None:
        if self._nursery is not None:
            scope = self._nursery.cancel_scope
            scope.deadline = min(scope.deadline, trio.current_time() + seconds)

    async def spawn_app(self, app: Any, config: Any, scope: Any, send: Send) -> Send:
        """hypercorn's entry for requests the gateway's protocols do not start themselves.

        Only HTTP/1.1 comes here (an upgrade or a WebSocket on hypercorn's own path): HTTP/2
        streams start through their ``StreamTaskGroup``, plain HTTP/1.1 requests through
        ``GatewayHTTPStream``.
        """
        return self.start_request(app, config, scope, send, stream_id=STREAM_ID, http11=True)

    def start_request(
        self,
        app: Any,
        config: Any,
        scope: Any,
        send: Send,
        *,
        stream_id: int,
        http11: bool,
        inline: bool = False,
        on_first_receive: Callable[[], Awaitable[None]] | None = None,
    ) -> Send:
        """Start the app's task for one request; returns where the request's messages go.

        ``inline``: the app is not started here but kept for ``run_inline``, which the reading task
        calls once the request's body is queued (see ``GatewayTCPServer.hand_over_reading``).
        """
        queue = RequestQueue(config.max_app_queue_size)
        queue.on_first_receive = on_first_receive
        scope["extensions"][DISCONNECT] = queue  # the seam: gateway.server.extensions
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


class StreamTaskGroup:
    """The connection's task group as one HTTP/2 stream sees it: its requests know the stream id.

    hypercorn's ``HTTPStream``/``WSStream`` call ``spawn_app`` (and ``spawn``) on the task group
    they were built with; given this one, the request is started with its stream id (the body
    deadline resets that stream) and the write deadline of HTTP/2 replies.
    """

    __slots__ = ("_group", "stream_id")

    def __init__(self, group: GatewayTaskGroup, stream_id: int) -> None:
        self._group = group
        self.stream_id = stream_id

    async def spawn_app(self, app: Any, config: Any, scope: Any, send: Send) -> Send:
        return self._group.start_request(app, config, scope, send, stream_id=self.stream_id, http11=False)

    def spawn(self, func: Callable[..., Any], *args: Any) -> None:
        self._group.spawn(func, *args)


async def _counted(runtime: InboundRuntime, call: Callable[[], Awaitable[None]]) -> None:
    """An app's task; the listener counts it in flight from its start (``start_request``) to here."""
    try:
        await call()
    finally:
        runtime.requests_in_flight -= 1
