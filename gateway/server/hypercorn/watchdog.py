"""``Watchdog`` replaces the keep-alive idle task of hypercorn's ``TCPServer`` (a ``TrioSingleTask``
cancelled and restarted around every request) with one timer per connection whose deadline moves:
the request head's, the keep-alive idle one, or none while a request is in flight.

Reasons:

- **Limits.** It enforces ``--header-read-timeout`` (the TLS handshake and a request head must
  arrive in time) and ``--idle-timeout``, and it is how the listener reaches a connection when it
  starts draining or terminating (``poke``).
- **Measured speed.** hypercorn cancelled a task and started a new one (under a lock, with
  ``nursery.start``) twice per request; moving one deadline cost ~40 µs less per review
  (docs/performance.md, "The keep-alive idle timer is one task per connection").

Byte-level tests: tests/test_server_hypercorn.py (keep-alive over real sockets) and
tests/test_server_inbound.py (slow heads, idle connections, draining).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from gateway.server.hypercorn.tcp_server import GatewayTCPServer

__all__ = ["Watchdog"]


class Watchdog:
    """One timer task per connection whose deadline moves: header, idle, or none while busy.

    Also woken (``poke``) when the listener starts draining or terminating.
    """

    __slots__ = ("_poked", "_scope", "_server", "_stopped", "deadline", "reason")

    def __init__(self, server: GatewayTCPServer) -> None:
        self._server = server
        self.deadline = math.inf
        self.reason = ""
        self._scope: trio.CancelScope | None = None
        self._poked = False
        self._stopped = False

    def set(self, deadline: float, reason: str) -> None:
        self.deadline, self.reason = deadline, reason
        # Speed: a later deadline is not pushed to trio's timer heap (two to three times per request
        # on a keep-alive connection); the timer wakes at the earlier one, finds this one later and
        # sleeps again (``run``): one wake-up per keep-alive period instead of a heap update per set.
        if self._scope is not None and deadline < self._scope.deadline:
            self._scope.deadline = deadline

    def poke(self) -> None:
        self._poked = True
        if self._scope is not None:
            self._scope.cancel()

    def release(self) -> None:
        """The connection has closed: forget it (``GatewayTCPServer._release``)."""
        self._server = None  # type: ignore[assignment]
        self._scope = None

    def stop(self) -> None:
        """The client went away: nothing is left to time out."""
        self.deadline, self.reason = math.inf, ""
        self._stopped = True
        self.poke()

    async def run(self) -> None:
        server = self._server
        terminated = server.context.terminated
        while not (server.aborted or self._stopped):
            with trio.CancelScope(deadline=self.deadline) as scope:
                self._scope = scope
                if not self._poked:
                    if terminated.is_set():
                        await trio.sleep_forever()
                    await terminated.wait()
                    self._poked = True
            self._scope = None
            if trio.current_time() >= self.deadline:
                server.abort(self.reason)
                return
            if self._poked:
                self._poked = False
                await server.lifecycle()
