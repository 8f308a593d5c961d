"""A TCP proxy on 127.0.0.1 that a test can partition or stall: the network between the gateway and
a real server, under the test's control.

``partition()`` closes every connection and refuses new ones (accepted, then closed at once) until
``heal()``; ``stall()`` keeps connections open but forwards nothing more (a watch that hangs
mid-stream) until ``heal()``. TLS passes through untouched, so a client verifies the real server's
certificate for 127.0.0.1.
"""

from __future__ import annotations

import trio


class TCPProxy:
    def __init__(self, target_port: int, *, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.accepted = 0
        self._open: set[trio.CancelScope] = set()  # one per connection open now
        self._partitioned = False
        self._flowing = trio.Event()
        self._flowing.set()

    def partition(self) -> None:
        self._partitioned = True
        for scope in self._open:
            scope.cancel()

    def stall(self) -> None:
        self._flowing = trio.Event()

    def heal(self) -> None:
        self._partitioned = False
        self._flowing.set()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(self.port)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.accepted += 1
        async with client:
            if self._partitioned:
                return
            try:
                upstream = await trio.open_tcp_stream(*self.target)
            except OSError:
                return
            async with upstream:
                scope = trio.CancelScope()
                self._open.add(scope)
                try:
                    with scope:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope)
                            nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope)
                finally:
                    self._open.discard(scope)

    async def _pump(self, source: trio.SocketStream, sink: trio.SocketStream, done: trio.CancelScope) -> None:
        try:
            while data := await source.receive_some(65536):
                await self._flowing.wait()
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.cancel()
