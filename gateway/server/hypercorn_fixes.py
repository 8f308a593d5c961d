"""The smallest patches that keep hypercorn's trio worker alive when HTTP/2 clients vanish.

kube-apiserver cancels its calls when its own timeout passes, so clients going away with requests
in flight is normal traffic for an admission webhook. Two hypercorn 0.18 defects turn that into a
crash of the whole server process (reproduced by tests/test_gateway_http.py and
``test_h2_client_dropping_streams_does_not_kill_the_server``):

1. ``H2Protocol._handle_events`` looks streams up with ``self.streams[stream_id]`` for DATA frames.
   When the connection closes while an earlier event of the same batch is being handled (the
   client disconnected), every stream is popped, and the next DATA event raises ``KeyError``,
   which escapes the connection's task group.
2. ``TCPServer.protocol_send`` catches ``BrokenResourceError``/``ClosedResourceError`` from
   ``send_all`` but not ``BusyResourceError``, which trio raises when another task is closing the
   stream at the same moment.

Both are treated as what they are: the peer is gone, for that stream or that connection.
"""

from __future__ import annotations

import contextlib
from typing import Any

import h2.events
import h2.exceptions
import trio
from hypercorn import protocol as hypercorn_protocol
from hypercorn.events import Closed
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.tcp_server import TCPServer

_installed = False


class GuardedH2Protocol(H2Protocol):
    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                # The stream was closed under us (client gone): drop its data, keep the window.
                with contextlib.suppress(h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
                    self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                continue
            await super()._handle_events([event])


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
    """Make hypercorn build the guarded protocol and connection classes (idempotent)."""
    global _installed  # noqa: PLW0603 - a one-time process-wide patch, by design
    if not _installed:
        hypercorn_protocol.H2Protocol = GuardedH2Protocol  # type: ignore[attr-defined]
        hypercorn_run.TCPServer = GuardedTCPServer  # type: ignore[attr-defined]
        _installed = True
