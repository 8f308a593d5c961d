"""Small, measured adjustments to hypercorn's trio worker: two robustness fixes and three per-request costs.

These patch hypercorn internals, so pyproject pins hypercorn to 0.18.x and
tests/test_server_hypercorn.py and tests/test_gateway_http.py exercise every one of them.

Robustness. kube-apiserver cancels its calls when its own timeout passes, so clients going away with
requests in flight is normal traffic for an admission webhook; two hypercorn 0.18 defects turn that
into a crash of the whole server process (reproduced by
``test_h2_clients_dropping_streams_do_not_kill_the_server``):

- ``H2Protocol._handle_events`` looks streams up with ``self.streams[stream_id]`` for DATA frames.
  When the connection closes while an earlier event of the same batch is being handled (the client
  disconnected), every stream is popped, and the next DATA event raises ``KeyError``, which escapes
  the connection's task group. ``GuardedH2Protocol`` drops data for streams that are gone.
- ``TCPServer.protocol_send`` catches ``BrokenResourceError``/``ClosedResourceError`` from
  ``send_all`` but not ``BusyResourceError``, which trio raises when another task is closing the
  stream at the same moment. ``GuardedTCPServer`` treats it like the other two: the peer is gone.

Cost (docs/performance.md has the numbers; each is per inbound request, 8 KB review, HTTP/1.1+TLS):

- ``RequestQueue`` replaces the per-request trio memory channel that feeds the ASGI ``receive``;
  it lets the app notice ``http.disconnect`` through a callback, so a review no longer needs a
  nursery and a watcher task to be cancelled when its caller goes away (about 50 µs).
- ``_IdleTimer`` moves the deadline of one keep-alive timer task per connection instead of
  cancelling a task and starting a new one (under a lock, with ``nursery.start``) twice per request.
- ``GatewayH11Protocol`` writes an HTTP/1.1 response head together with its body (one TLS record,
  one ``send``) and skips the empty write of a Content-Length message's end (about 30 µs).

None of them changes what goes over the wire beyond how the same bytes are split into writes.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h2.events
import h2.exceptions
import h11
import hypercorn.protocol
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h2 import H2Protocol
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


class _IdleTimer:
    """The keep-alive idle timeout as one task per connection whose deadline moves.

    Stands in for hypercorn's ``TrioSingleTask``, which cancels its task and starts a new one (with
    ``nursery.start`` under a lock) on every idle/busy switch, i.e. twice per request. Same contract
    as hypercorn's ``_idle_timeout``: while the connection is idle, close it after
    ``keep_alive_timeout`` or at once when the server is terminating; while busy, never.
    """

    __slots__ = ("_busy", "_deadline", "_on_idle", "_scope", "_server")

    def __init__(self, server: TCPServer) -> None:
        self._server = server
        self._busy = False
        self._deadline = math.inf
        self._scope: trio.CancelScope | None = None
        self._on_idle: trio.Event | None = None

    async def restart(self, task_group: Any, action: object) -> None:
        """The connection became idle (hypercorn passes its own ``_idle_timeout``: not needed)."""
        self._busy = False
        self._deadline = trio.current_time() + self._server.config.keep_alive_timeout
        if self._scope is None:
            self._scope = trio.CancelScope(deadline=self._deadline)
            task_group._nursery.start_soon(self._run)
        else:
            self._scope.deadline = self._deadline
        if self._on_idle is not None:
            self._on_idle.set()
            self._on_idle = None

    async def stop(self) -> None:
        """The connection is handling a request."""
        self._busy = True
        self._deadline = math.inf
        if self._scope is not None:
            self._scope.deadline = math.inf

    async def _run(self) -> None:
        terminated = self._server.context.terminated
        scope = self._scope
        while True:
            assert scope is not None
            with scope:
                await terminated.wait()
            # The idle deadline passed or the server is terminating; a request may have arrived
            # meanwhile: then wait until the connection is idle again and look once more.
            if not self._busy:
                break
            self._on_idle = trio.Event()
            await self._on_idle.wait()
            scope = self._scope = trio.CancelScope(deadline=self._deadline)
        self._scope = None
        with trio.CancelScope(shield=True):
            await self._server._initiate_server_close()


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


class GuardedH2Protocol(H2Protocol):
    """HTTP/2: data for a stream closed under us (client gone) is dropped, its window kept."""

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                with contextlib.suppress(h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
                    self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                continue
            await super()._handle_events([event])


class GuardedTCPServer(TCPServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_task = _IdleTimer(self)  # type: ignore[assignment]

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
        hypercorn.protocol.H2Protocol = GuardedH2Protocol  # type: ignore[attr-defined]
        _installed = True
