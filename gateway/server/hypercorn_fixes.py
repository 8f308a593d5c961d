"""The smallest patch that keeps hypercorn's trio worker alive when a client vanishes mid-send.

hypercorn 0.18's ``TCPServer.protocol_send`` catches ``BrokenResourceError`` and
``ClosedResourceError`` from ``send_all`` but not ``BusyResourceError``, which trio raises when the
stream is being closed by another task (an HTTP/2 client that disconnects with streams in flight:
kube-apiserver cancels calls on its timeout). The exception then escapes the connection's task
group and takes the whole server down. We treat it exactly like the other two: the peer is gone.
"""

from __future__ import annotations

import contextlib
from typing import Any

import trio
from hypercorn.events import Closed
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.tcp_server import TCPServer

_installed = False


class GuardedTCPServer(TCPServer):
    async def protocol_send(self, event: Any) -> None:
        try:
            await super().protocol_send(event)
        except trio.BusyResourceError:
            await self.protocol.handle(Closed())

    async def _close(self) -> None:
        with contextlib.suppress(trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError):
            await super()._close()


def install() -> None:
    """Make hypercorn's trio worker build ``GuardedTCPServer`` connections (idempotent)."""
    global _installed  # noqa: PLW0603 - a one-time process-wide patch, by design
    if not _installed:
        hypercorn_run.TCPServer = GuardedTCPServer  # type: ignore[attr-defined]
        _installed = True
