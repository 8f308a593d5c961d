"""``RequestQueue`` replaces the trio memory channel hypercorn's ``TaskGroup.spawn_app`` opens per
request to feed the ASGI ``receive``.

Reasons:

- **Measured speed.** It reports the caller going away through a callback (the
  ``webhook-gateway.disconnect`` scope extension, ``gateway.server.extensions``), so a review no
  longer needs a nursery and a watcher task reading ``receive`` to be cancelled when its caller
  goes away: about 50 µs per review (docs/performance.md, "The caller going away is noticed by a
  callback").
- **Limit.** The request body's deadline (``--body-read-timeout``, capped by the caller's
  ``?timeout=``) lives here: a body that has not fully arrived by then ends the request.

Byte-level tests: tests/test_server_hypercorn.py (a caller closing mid-request is seen by the app
through the extension) and tests/test_server_inbound.py (slow bodies over HTTP/1.1 and HTTP/2).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

__all__ = ["RequestQueue"]

Message = MutableMapping[str, Any]


class RequestQueue:
    """The ASGI ``receive`` side of one request, fed by hypercorn (body chunks, then disconnect).

    Bounded like the memory channel it replaces (``max_app_queue_size``). It is the request's
    ``DisconnectSignal`` (``gateway.server.extensions``): ``disconnected`` turns true and
    ``on_disconnect`` is called as soon as hypercorn reports the caller gone, whether or not the app
    is reading.

    ``body_deadline``: when the body has not fully arrived by then, ``on_body_timeout`` is called
    and the app reads ``http.disconnect`` (the server closes the connection or resets the stream).
    """

    __slots__ = (
        "_items",
        "_readers",
        "_size",
        "_writers",
        "body_deadline",
        "disconnected",
        "on_body_timeout",
        "on_disconnect",
        "on_first_receive",
    )

    def __init__(self, size: int) -> None:
        self._items: deque[Message] = deque()
        self._size = max(size, 1)
        self._readers = trio.lowlevel.ParkingLot()
        self._writers = trio.lowlevel.ParkingLot()
        self.disconnected = False
        self.on_disconnect: Callable[[], object] | None = None
        self.body_deadline = math.inf
        self.on_body_timeout: Callable[[], object] | None = None
        # Awaited once, when the app first reads: the 100 Continue of a request that expects it.
        self.on_first_receive: Callable[[], Awaitable[None]] | None = None

    def _caller_gone(self) -> None:
        self.disconnected = True
        self.body_deadline = math.inf
        if self.on_disconnect is not None:
            self.on_disconnect()

    async def put(self, message: Message) -> None:
        """hypercorn's ``app_put``: waits while the queue is full (never for the disconnect)."""
        kind = message["type"]
        if kind == "http.disconnect":
            self._items.append(message)
            self._readers.unpark()
            self._caller_gone()
            return
        while len(self._items) >= self._size:
            await self._writers.park()
        self._items.append(message)
        self._readers.unpark()
        if not message.get("more_body", False):
            self.body_deadline = math.inf  # the whole body is here

    async def receive(self) -> Message:
        """The app's ``receive``: the next message, waiting for one if needed."""
        if self.on_first_receive is not None:
            first, self.on_first_receive = self.on_first_receive, None
            await first()
        while not self._items:
            if self.body_deadline == math.inf:
                await self._readers.park()
                continue
            with trio.move_on_at(self.body_deadline):
                await self._readers.park()
            if not self._items and trio.current_time() >= self.body_deadline:
                self.body_deadline = math.inf
                self.disconnected = True
                if self.on_body_timeout is not None:
                    self.on_body_timeout()
                return {"type": "http.disconnect"}
        message = self._items.popleft()
        self._writers.unpark()
        return message
