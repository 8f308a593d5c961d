"""One HTTP/2 connection to a backend: drives an ``h2.H2Connection`` with many calls multiplexed.

Calls only change the h2 state machine (synchronously) and wait; the socket belongs to two tasks
that live in the pool's nursery: a reader (frames in → events → per-stream state) and a writer
(drains h2's output). So a cancelled call can never leave a half-written frame on the wire: it
just queues RST_STREAM(CANCEL) (trio: cancellation at any checkpoint; h2: sans-IO).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack
import trio

from gateway.errors import ResponseTooLarge, TransportError, TransportErrorKind
from gateway.transport.wire import Header, HTTPResponse, RetryableError
from gateway.wire import H2_CLOSED_STREAMS_REMEMBERED
from gateway.wire.errors import socket_peer, stream_error

RECEIVE_BYTES = 65536
STREAM_WINDOW = 4 * 1024 * 1024  # what each call may receive before we acknowledge it
CONNECTION_WINDOW = 16 * 1024 * 1024
_MAX_STREAM_ID = 2**31 - 1
# Kept out of the HPACK dynamic table: credentials (as h2's own normalisation would), and the
# per-call traceparent, which is never repeated and would only evict the headers that are.
_NEVER_INDEXED = frozenset({b"authorization", b"proxy-authorization", b"traceparent"})


class _LiteralEncoder(hpack.Encoder):
    """HPACK as plain literals: no Huffman coding, no dynamic table, each field's bytes memoised.

    Pure-Python HPACK (table search, Huffman coding) cost ~25 µs per call; HTTP/2 is only spoken to
    loopback backends (TRN-08), where the few bytes indexing saves do not matter. Every field is a
    "literal without indexing" (RFC 7541 §6.2.2; credentials "never indexed", §6.2.3), so the
    encoding of a field does not depend on earlier blocks and most fields of a call (method, path,
    authority, content type) are the same bytes every time: they are kept per connection, bounded.
    Decoders accept this form like any other.
    """

    MEMO_FIELDS = 256

    def __init__(self) -> None:
        super().__init__()
        self._memo: dict[tuple[bytes, bytes], bytes] = {}

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        if self.table_size_changes:  # a peer's new HEADER_TABLE_SIZE: hpack signals it (rare)
            return super().encode(headers, huffman=False)
        memo = self._memo
        block = []
        for header in headers:
            name, value = header[0], header[1]
            if isinstance(header, hpack.HeaderTuple) and not header.indexable:
                block.append(_literal(0x10, name, value))  # never indexed, never memoised
                continue
            field = memo.get((name, value))
            if field is None:
                field = _literal(0x00, name, value)
                if len(memo) < self.MEMO_FIELDS:
                    memo[name, value] = field
            block.append(field)
        return b"".join(block)


def _literal(first: int, name: bytes, value: bytes) -> bytes:
    """One literal header field with a new name (RFC 7541 §6.2.2/§6.2.3), no Huffman coding."""
    return b"".join((bytes((first,)), _length(len(name)), name, _length(len(value)), value))


def _length(n: int) -> bytes:
    """A string length: an HPACK integer with a 7-bit prefix and the Huffman bit clear (§5.1)."""
    if n < 0x7F:
        return bytes((n,))
    out = bytearray((0x7F,))
    n -= 0x7F
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _outbound(headers: Sequence[Header]) -> list[Any]:
    """The header list for h2, normalised here once instead of by h2's generic per-call pass.

    Names are already lower-case (the pool builds them); what h2's normalisation would still do is
    strip credential values and keep them out of compression contexts.
    """
    return [
        hpack.NeverIndexedHeaderTuple(name, value.strip()) if name in _NEVER_INDEXED else (name, value)
        for name, value in headers
    ]


class _Stream:
    """The receiving side of one call, filled by the reader task."""

    __slots__ = ("body", "done", "error", "headers", "limit", "local_closed", "status")

    def __init__(self, limit: int) -> None:
        self.status = 0
        self.headers: list[Header] = []
        self.body = bytearray()
        self.done = trio.Event()
        self.error: TransportError | None = None
        self.limit = limit
        self.local_closed = False

    def fail(self, error: TransportError) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class _BackendH2(h2.connection.H2Connection):
    MAX_CLOSED_STREAMS = H2_CLOSED_STREAMS_REMEMBERED  # not h2's 2**16 (see gateway.wire)


class HTTP2Connection:
    """An HTTP/2 client connection; the pool reserves a stream slot before each ``request``."""

    def __init__(self, stream: trio.abc.Stream, label: str, on_change: Callable[[], None]) -> None:
        self._stream = stream
        self._peer = socket_peer(stream)
        self._on_change = on_change
        # Headers are normalised by ``_outbound`` (h2 still validates them): ~20 µs less per call.
        config = h2.config.H2Configuration(
            client_side=True, header_encoding=None, normalize_outbound_headers=False
        )
        self._h2 = _BackendH2(config=config)
        self._h2.encoder = _LiteralEncoder()
        self._h2.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 65536,
            },
        )
        _keep_open_after_goaway(self._h2)
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self._streams: dict[int, _Stream] = {}
        self._outbox = bytearray(self._h2.data_to_send())
        self._writer_wakeup = trio.Event()
        self._window_changed = trio.Event()
        self._ready = trio.Event()
        self._scope = trio.CancelScope()
        self._closing = False
        self._failure: str | None = None
        self._failure_kind: TransportErrorKind = "transport"
        self.label = label
        self.reserved = 0  # stream slots handed out by the pool and not yet released
        self.requests = 0
        self.goaway = False
        self.closed = False
        self.idle_since = trio.current_time()

    def __repr__(self) -> str:
        if self.closed:
            state = "CLOSED"
        elif self.goaway or self._closing:
            state = "GOAWAY"
        else:
            state = "ACTIVE" if self.reserved else "IDLE"
        return f"<HTTP2Connection {self.label} {state} streams={self.reserved} requests={self.requests}>"

    # --- what the pool asks -------------------------------------------------------------------

    @property
    def max_streams(self) -> int:
        """The peer's MAX_CONCURRENT_STREAMS (its SETTINGS arrive before the connection is used)."""
        return int(self._h2.remote_settings.max_concurrent_streams)

    @property
    def ready(self) -> bool:
        """The peer's SETTINGS arrived (or the connection failed): the pool may use or drop it."""
        return self._ready.is_set()

    def can_open_stream(self) -> bool:
        """True when a new call may be multiplexed onto this connection now."""
        return (
            self._ready.is_set()
            and not (self.closed or self.goaway or self._closing)
            and self.reserved < self.max_streams
            and self._h2.highest_outbound_stream_id + 2 * (self.reserved + 1) < _MAX_STREAM_ID
        )

    async def wait_ready(self) -> None:
        """Wait for the peer's first SETTINGS; ``TransportError`` if the connection fails first."""
        await self._ready.wait()
        if self._failure is not None:
            raise TransportError(self._failure, self._failure_kind)

    def close_gracefully(self) -> None:
        """Send GOAWAY, then close once it is written; calls in flight fail."""
        if not self.closed and not self._closing:
            self._closing = True
            self._h2.close_connection()
            self._flush()

    def abort(self) -> None:
        """Close at once: the reader and writer stop, every call in flight fails."""
        self._fail("http2: client connection force closed")
        self._scope.cancel()

    # --- the tasks in the pool's nursery ------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read and write until the connection ends; always closes the stream."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_loop, nursery.cancel_scope)
                    task_status.started()
                    await self._read_loop()
                    nursery.cancel_scope.cancel()
        finally:
            self._fail(self._failure or "http2: client connection lost")
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self._stream)

    async def _read_loop(self) -> None:
        while True:
            try:
                data = await self._stream.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._fail(*_cause_and_kind(stream_error(exc, "read", self._peer)))
                return
            if not data:
                self._fail("unexpected EOF")
                return
            try:
                events = self._h2.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                self._fail(f"http2: peer protocol error: {exc}")
                return
            for event in events:
                self._handle(event)
            self._flush()

    async def _write_loop(self, scope: trio.CancelScope) -> None:
        try:
            while True:
                if self._outbox:
                    data = bytes(self._outbox)
                    self._outbox.clear()
                    await self._stream.send_all(data)
                    continue
                if self._closing:
                    break
                self._writer_wakeup = trio.Event()
                await self._writer_wakeup.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(*_cause_and_kind(stream_error(exc, "write", self._peer)))
        scope.cancel()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data:
            self._outbox += data
            self._writer_wakeup.set()

    def _fail(self, cause: str, kind: TransportErrorKind = "transport") -> None:
        if self.closed:
            return
        self.closed = True
        self._failure = cause
        self._failure_kind = kind
        for stream in self._streams.values():
            stream.fail(TransportError(cause, kind))
        self._ready.set()
        self._pulse_window()
        self._on_change()

    def _pulse_window(self) -> None:
        self._window_changed.set()
        self._window_changed = trio.Event()

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            # Always acknowledge, even for streams we gave up on, or the connection window shrinks.
            self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            stream = self._streams.get(event.stream_id)
            if stream is not None and not stream.done.is_set():
                stream.body += event.data
                if len(stream.body) > stream.limit:
                    self._reset(event.stream_id)
                    stream.fail(ResponseTooLarge(stream.limit))
        elif isinstance(event, h2.events.ResponseReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                for name, value in event.headers:
                    if name == b":status":
                        stream.status = int(value)
                    elif not name.startswith(b":"):
                        stream.headers.append((name, value))
        elif isinstance(event, h2.events.StreamEnded):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.done.set()
                self._pulse_window()
        elif isinstance(event, h2.events.StreamReset):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.local_closed = True
                code = _error_name(event.error_code)
                error_class = RetryableError if code == "REFUSED_STREAM" else TransportError
                stream.fail(
                    error_class(f"stream error: stream ID {event.stream_id}; {code}; received from peer")
                )
                self._pulse_window()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._on_goaway(event)
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self._pulse_window()
            if isinstance(event, h2.events.RemoteSettingsChanged):
                self._ready.set()
                self._on_change()

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        # Streams above last_stream_id were never processed: they may be resent elsewhere.
        self.goaway = True
        last = event.last_stream_id if event.last_stream_id is not None else 0
        code = _error_name(event.error_code)
        for stream_id, stream in self._streams.items():
            if stream_id > last:
                stream.fail(
                    RetryableError(
                        "http2: server sent GOAWAY and closed the connection;"
                        f" LastStreamID={last}, ErrCode={code}"
                    )
                )
        self._ready.set()
        self._pulse_window()
        if not self._streams:
            self.close_gracefully()
        self._on_change()

    # --- one call -----------------------------------------------------------------------------

    async def request(
        self, headers: Sequence[Header], body: bytes, *, max_response_bytes: int
    ) -> HTTPResponse:
        """Send one call on a new stream and wait for the whole reply.

        On cancellation (the caller's deadline or the caller going away) the stream is reset with
        CANCEL. ``RetryableError`` marks a stream the peer refused or dropped unprocessed (GOAWAY).
        """
        if self.closed or self.goaway or self._closing:
            raise RetryableError(self._failure or "http2: client connection lost")
        try:
            stream_id = self._h2.get_next_available_stream_id()
            self._h2.send_headers(stream_id, _outbound(headers), end_stream=not body)
        except (h2.exceptions.NoAvailableStreamIDError, h2.exceptions.TooManyStreamsError) as exc:
            raise RetryableError("http2: no stream available on this connection") from exc
        stream = _Stream(max_response_bytes)
        stream.local_closed = not body
        self._streams[stream_id] = stream
        self.requests += 1
        try:
            self._flush()
            if body:
                await self._send_body(stream_id, stream, body)
            await stream.done.wait()
        finally:
            del self._streams[stream_id]
            if not stream.done.is_set() or not stream.local_closed:
                self._reset(stream_id)
        if stream.error is not None:
            raise stream.error
        return HTTPResponse(stream.status, stream.headers, bytes(stream.body), "HTTP/2")

    async def _send_body(self, stream_id: int, stream: _Stream, body: bytes) -> None:
        view = memoryview(body)
        offset = 0
        while offset < len(body):
            if stream.done.is_set():
                return  # answered or failed early: stop sending
            window = min(self._h2.local_flow_control_window(stream_id), self._h2.max_outbound_frame_size)
            if window <= 0:
                await self._window_changed.wait()
                continue
            chunk = view[offset : offset + window]
            offset += len(chunk)
            self._h2.send_data(stream_id, bytes(chunk), end_stream=offset == len(body))
            self._flush()
        stream.local_closed = True

    def _reset(self, stream_id: int) -> None:
        if self.closed:
            return
        try:
            self._h2.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.CANCEL)
        except h2.exceptions.ProtocolError:
            return  # already closed on both sides
        self._flush()


def _keep_open_after_goaway(connection: h2.connection.H2Connection) -> None:
    # h2 moves its connection state machine to CLOSED on GOAWAY and then refuses the replies to
    # streams the server promised to finish (RFC 9113 §6.8; python-hyper/h2 issue #1181). Keep this
    # connection's machine open on a received GOAWAY: we stop opening streams ourselves.
    machine = connection.state_machine
    transitions = dict(machine._transitions)
    open_state = h2.connection.ConnectionState.CLIENT_OPEN
    transitions[(open_state, h2.connection.ConnectionInputs.RECV_GOAWAY)] = (None, open_state)
    machine._transitions = transitions


def _error_name(code: int | h2.errors.ErrorCodes | None) -> str:
    try:
        return h2.errors.ErrorCodes(int(code or 0)).name
    except ValueError:
        return f"unknown error code 0x{int(code or 0):x}"


def _cause_and_kind(error: TransportError) -> tuple[str, TransportErrorKind]:
    return error.cause, error.kind
