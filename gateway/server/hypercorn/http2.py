"""``GuardedH2Protocol`` replaces hypercorn's ``H2Protocol`` (HTTP/2 on one connection).

Reasons:

- **Crash fix: data for a closed stream.** ``H2Protocol._handle_events`` looks streams up with
  ``self.streams[stream_id]`` for DATA frames. When an earlier event of the same batch closed the
  stream (RST_STREAM, then DATA for it), the lookup raises ``KeyError``, which escapes the
  connection's task group. Data for streams that are gone is dropped here (keeping the connection
  window).
- **Crash fix: early GOAWAY** (pgjones/hypercorn#226). When the server is terminating, the last
  stream to close makes ``H2Protocol`` send GOAWAY, which can happen before the END_STREAM of that
  stream's reply is written (the reply then ends with a protocol error for the caller). A stream
  reports itself closed only once its reply has left the send buffer.
- **Limits.** The frame budget (SETTINGS, PING, RST_STREAM, WINDOW_UPDATE, ... floods, small DATA
  frames, and the resets a client makes the server send — MadeYouReset, CVE-2025-8671: GOAWAY
  ENHANCE_YOUR_CALM; ``gateway.server.limits.FrameBudget``), h2's memory of
  closed streams bounded per connection (``gateway.wire.H2_CLOSED_STREAMS_REMEMBERED``), and a
  stream over the concurrent-stream limit refused alone (RST_STREAM REFUSED_STREAM) where h2
  would end the connection and every stream on it (``_ServerConnection``).
- Each stream is built with a ``StreamTaskGroup`` that knows its stream id, so that its request
  gets the body deadline (which resets this stream) and the write deadline of HTTP/2 replies.

Byte-level tests: tests/test_server_inbound.py (scripted client frames over real sockets and
against the protocol itself: RST_STREAM then DATA, GOAWAY while draining, control-frame floods,
slow bodies and zero windows, the 251st stream) and tests/test_server_framing.py (a lower-case
``:method``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.utilities
import trio
from h2.stream import StreamClosedBy
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h2 import H2Protocol
from hyperframe.frame import RstStreamFrame

from gateway.server.hypercorn.config import runtime_of
from gateway.server.hypercorn.task_group import StreamTaskGroup
from gateway.server.limits import FrameBudget
from gateway.wire import H2_CLOSED_STREAMS_REMEMBERED

__all__ = ["GuardedH2Protocol"]


class _ServerConnection(h2.connection.H2Connection):
    """h2's connection, refusing one stream over SETTINGS_MAX_CONCURRENT_STREAMS instead of the connection.

    h2 answers a HEADERS frame that opens one stream too many with a connection error (GOAWAY
    PROTOCOL_ERROR), which ends every stream in flight; RFC 9113 §5.1.2 lets the server refuse
    that stream alone: RST_STREAM REFUSED_STREAM (the client may retry it; nghttp2 and Go do the
    same). The header block is still decoded, so that HPACK's shared table stays in step with the
    client's, and the stream counts as opened (and reset by us): its id cannot be used again.
    DATA that was already on its way for a stream the gateway reset is dropped (its bytes are given
    back to the connection window) instead of answered with another RST_STREAM each: RFC 9113
    §5.1 tells an endpoint to ignore frames on a stream it reset.
    """

    on_refused: Callable[[], object] = staticmethod(lambda: None)  # counts a refused stream
    on_reset: Callable[[], object] = staticmethod(lambda: None)  # charges an RST_STREAM the server sends

    def _prepare_for_sending(self, frames: list[Any]) -> None:
        for f in frames:
            if type(f) is RstStreamFrame:
                self.on_reset()
        super()._prepare_for_sending(frames)

    def _receive_headers_frame(self, frame: Any) -> tuple[list[Any], list[h2.events.Event]]:
        sid = frame.stream_id
        if (
            sid not in self.streams
            and sid % 2 == 1
            and sid > self.highest_inbound_stream_id
            and self.open_inbound_streams >= self.local_settings.max_concurrent_streams
        ):
            try:
                self.decoder.decode(frame.data, raw=True)
            except Exception as exc:  # HPACK errors: a connection error, as h2 makes them
                raise h2.exceptions.ProtocolError(f"Error decoding header block: {exc}") from exc
            self.highest_inbound_stream_id = sid
            self._closed_streams[sid] = StreamClosedBy.SEND_RST_STREAM
            self.on_refused()
            reset = RstStreamFrame(sid)
            reset.error_code = h2.errors.ErrorCodes.REFUSED_STREAM
            return [reset], []
        return super()._receive_headers_frame(frame)

    def _handle_data_on_closed_stream(
        self, events: list[h2.events.Event], exc: h2.exceptions.StreamClosedError, frame: Any
    ) -> tuple[list[Any], list[h2.events.Event]]:
        frames, found = super()._handle_data_on_closed_stream(events, exc, frame)
        if self._closed_streams.get(frame.stream_id) is StreamClosedBy.SEND_RST_STREAM:
            frames = [f for f in frames if not isinstance(f, RstStreamFrame)]
        return frames, found


class GuardedH2Protocol(H2Protocol):
    """HTTP/2 with the crash fixes (data for closed streams, early GOAWAY) and the frame budget."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One stream over the limit is refused, not the connection (_ServerConnection): the same
        # connection as hypercorn's, of the subclass.
        connection = _ServerConnection(config=self.connection.config)
        connection.DEFAULT_MAX_INBOUND_FRAME_SIZE = self.connection.DEFAULT_MAX_INBOUND_FRAME_SIZE
        connection.local_settings = self.connection.local_settings
        self.connection._frame_dispatch_table.clear()  # freed now, not by the cyclic GC (release)
        self.connection = connection
        events = runtime_of(self.config).events
        connection.on_refused = lambda: events.connection_closed("stream_limit")
        connection.on_reset = self._reset_sent
        # Protection: a caller cycling streams would make h2 remember 2**16 closed ones (~11.5 MB)
        # on every connection; the new connection has closed none yet (see gateway.wire).
        self.connection._closed_streams = h2.utilities.SizeLimitDict(size_limit=H2_CLOSED_STREAMS_REMEMBERED)
        self._address = self.client[0] if self.client else ""
        self.budget = runtime_of(self.config).budget_for(self._address, trio.current_time())
        self._sent = trio.lowlevel.ParkingLot()
        self.flooded = False
        self._over = False  # the resets this connection made the server send put it over budget

    def _reset_sent(self) -> None:
        if not self.budget.charge(FrameBudget.RESET_COST, trio.current_time()):
            self._over = True

    def release(self) -> None:
        """The connection has closed: drop what refers back to it (``GatewayTCPServer._release``)."""
        self.send = self.task_group = None  # type: ignore[assignment]
        self.streams.clear()
        self.stream_buffers.clear()
        self.connection._frame_dispatch_table.clear()  # h2's only cycle: its own bound methods
        vars(self.connection).pop("on_reset", None)  # our hook, a bound method of this protocol

    async def handle(self, event: Any) -> None:
        if (
            isinstance(event, RawData)
            and not self.closed
            and not self.budget.feed(event.data, trio.current_time())
        ):
            await self._calm_down()
            return
        await super().handle(event)
        if isinstance(event, Closed):
            self._sent.unpark_all()
        elif self._over and not self.flooded and not self.closed:
            await self._calm_down()

    async def _calm_down(self) -> None:
        """Over the frame budget: GOAWAY ENHANCE_YOUR_CALM, then close (counted)."""
        self.flooded = True
        runtime = runtime_of(self.config)
        runtime.flooded(self._address, self.budget, trio.current_time())
        events = runtime.events
        events.h2_goaway("flood")
        events.connection_closed("h2_flood")
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        await self._flush()
        await self.send(Closed())

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                # Crash fix: the stream was closed by an earlier event of this batch (or refused).
                with contextlib.suppress(h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
                    self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                continue
            if isinstance(event, h2.events.RequestReceived) and _lower_case_method(event.headers):
                # The HTTP/1.1 rule (http11_fast.framing_error): methods are case-sensitive, and
                # hypercorn would upper-case this one. Refused with 400 without starting the app.
                self.connection.send_headers(
                    event.stream_id,
                    [(b":status", b"400"), (b"content-length", b"0"), *self.config.response_headers("h2")],
                    end_stream=True,
                )
                continue
            await super()._handle_events([event])

    async def _send_data(self, stream_id: int) -> None:
        await super()._send_data(stream_id)
        if stream_id not in self.stream_buffers:
            self._sent.unpark_all()

    async def stream_send(self, event: Any) -> None:
        if isinstance(event, StreamClosed):
            # Crash fix (early GOAWAY): the last stream closing on a terminating (or draining)
            # server makes a GOAWAY go out; the stream counts as closed, and the connection as
            # idle, only once this stream's reply (and END_STREAM) has been written.
            while event.stream_id in self.stream_buffers and not self.closed:
                await self._sent.park()
        await super().stream_send(event)

    async def _create_stream(self, request: h2.events.RequestReceived) -> None:
        # hypercorn builds the stream (HTTPStream or WSStream) with the protocol's task group and
        # keeps it; while it does, the protocol's group is this stream's view of it. Only stream
        # creation reads the protocol's group after ``initiate``, and one task handles a
        # connection's events, so no other stream can be built with this view.
        group: Any = self.task_group  # a GatewayTaskGroup (tcp_server builds it)
        self.task_group = StreamTaskGroup(group, request.stream_id)  # type: ignore[assignment]
        try:
            await super()._create_stream(request)
        finally:
            self.task_group = group


def _lower_case_method(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b":method":
            return value != value.upper()
    return False
