"""Small, measured adjustments to hypercorn's trio worker: one robustness fix and three per-request costs.

Robustness: hypercorn 0.18's ``TCPServer.protocol_send`` catches ``BrokenResourceError`` and
``ClosedResourceError`` from ``send_all`` but not ``BusyResourceError``, which trio raises when the
stream is being closed by another task (an HTTP/2 client that disconnects with streams in flight:
kube-apiserver cancels calls on its timeout). The exception then escapes the connection's task
group and takes the whole server down. We treat it exactly like the other two: the peer is gone.

Cost (docs/performance.md has the numbers; each is per inbound request, 8 KB review, HTTP/1.1+TLS):

- ``RequestQueue`` replaces the per-request trio memory channel that feeds the ASGI ``receive``;
  it lets the app notice ``http.disconnect`` through a callback, so a review no longer needs a
  nursery and a watcher task to be cancelled when its caller goes away (about 50 µs).
- ``_SingleTask`` restarts the keep-alive idle timer without hypercorn's lock and
  ``nursery.start`` round trip (about 35 µs).
- ``GatewayH11Protocol`` writes an HTTP/1.1 response head together with its body (one TLS record,
  one ``send``) and skips the empty write of a Content-Length message's end (about 30 µs).

None of them changes what goes over the wire beyond how the same bytes are split into writes.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
import hypercorn.protocol
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import tcp_server
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.tcp_server import TCPServer

Message = MutableMapping[str, Any]

_installed = False


class RequestQueue:
    """The ASGI ``receive`` side of one request, fed by hypercorn (body chunks, then disconnect).

    Bounded like the memory channel it replaces (``max_app_queue_size``). ``disconnected`` turns
    true and ``on_disconnect`` is called as soon as hypercorn reports the caller gone, whether or not
    the app is reading: that is how a review in dispatch gets cancelled without a watcher task.
    """

    __slots__ = ("_items", "_readers", "_size", "_writers", "disconnected", "on_disconnect")

    def __init__(self, size: int) -> None:
        self._items: deque[Message] = deque()
        self._size = max(size, 1)
        self._readers = trio.lowlevel.ParkingLot()
        self._writers = trio.lowlevel.ParkingLot()
        self.disconnected = False
        self.on_disconnect: Callable[[], object] | None = None

    async def put(self, message: Message) -> None:
        """hypercorn's ``app_put``: waits while the queue is full."""
        while len(self._items) >= self._size:
            await self._writers.park()
        self._items.append(message)
        self._readers.unpark()
        if message["type"] == "http.disconnect":
            self.disconnected = True
            if self.on_disconnect is not None:
                self.on_disconnect()

    async def receive(self) -> Message:
        """The app's ``receive``: the next message, waiting for one if needed."""
        while not self._items:
            await self._readers.park()
        message = self._items.popleft()
        self._writers.unpark()
        return message


class GatewayTaskGroup(TaskGroup):
    """hypercorn's per-connection task group, handing apps a ``RequestQueue`` instead of a channel."""

    async def spawn_app(
        self, app: Any, config: Any, scope: Any, send: Callable[[Any], Awaitable[None]]
    ) -> Callable[[Any], Awaitable[None]]:
        queue = RequestQueue(config.max_app_queue_size)
        assert self._nursery is not None
        handle: Any = _handle  # hypercorn types receive as its own event union
        self._nursery.start_soon(
            handle, app, config, scope, queue.receive, send, trio.to_thread.run_sync, trio.from_thread.run
        )
        return queue.put


class _SingleTask:
    """hypercorn's ``TrioSingleTask`` (the keep-alive idle timer) without the lock and ``nursery.start``.

    Same contract: ``restart`` cancels the running action and starts it again; ``stop`` cancels it.
    """

    __slots__ = ("_scope",)

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None

    async def restart(self, task_group: Any, action: Callable[[], Awaitable[None]]) -> None:
        if self._scope is not None:
            self._scope.cancel()
        scope = self._scope = trio.CancelScope()
        task_group._nursery.start_soon(_run_in, scope, action)

    async def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None


async def _run_in(scope: trio.CancelScope, action: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await action()


class GatewayH11Protocol(H11Protocol):
    """HTTP/1.1: the response head waits for the first body bytes and goes out in the same write."""

    _held = b""

    async def _send_h11_event(self, event: Any) -> None:
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
        if self._held and isinstance(event, StreamClosed):  # an app that never sent its body
            data, self._held = self._held, b""
            await self.send(RawData(data=data))
        await super().stream_send(event)


class GuardedTCPServer(TCPServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_task = _SingleTask()  # type: ignore[assignment]

    async def protocol_send(self, event: Any) -> None:
        try:
            await super().protocol_send(event)
        except trio.BusyResourceError:
            await self.protocol.handle(Closed())

    async def _close(self) -> None:
        with contextlib.suppress(trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError):
            await super()._close()


def install() -> None:
    """Make hypercorn's trio worker use the classes above (idempotent, process-wide)."""
    global _installed  # noqa: PLW0603 - a one-time process-wide patch, by design
    if not _installed:
        hypercorn_run.TCPServer = GuardedTCPServer  # type: ignore[attr-defined]
        tcp_server.TaskGroup = GatewayTaskGroup  # type: ignore[attr-defined]
        hypercorn.protocol.H11Protocol = GatewayH11Protocol  # type: ignore[attr-defined]
        _installed = True
