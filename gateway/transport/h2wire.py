"""A lean sans-IO HTTP/2 client framer: exactly what a client calling webhooks needs (RFC 9113).

``gateway.transport.http2`` owns the socket and the tasks; this module only turns calls into frame
bytes (``ClientConnection.output``) and received bytes into per-stream state and a few events. It
replaces the ``h2`` state machine, which cost about twice the CPU of the HTTP/1.1 client per call:
most of that went into generic machinery a webhook client does not use (server role, push,
priorities, event objects per frame, closed-stream bookkeeping, header normalisation passes).

What the client does and does not do:

- Requests: HEADERS (+CONTINUATION past the peer's SETTINGS_MAX_FRAME_SIZE) with the header block
  as plain HPACK literals (``LiteralEncoder``), then DATA split by the peer's max frame size and by
  the connection and stream send windows (the peer's INITIAL_WINDOW_SIZE changes apply to open
  streams, RFC 9113 §6.9.2).
- Replies: HEADERS decoded with ``hpack.Decoder`` (the peer's dynamic table is kept; a block
  repeated while that table is unchanged is decoded once, ``_decode``), 1xx skipped,
  trailers accepted and dropped, DATA collected; WINDOW_UPDATEs go back once half a window is
  consumed, for the connection always (also for data of streams given up on).
- A stream is forgotten as soon as it ends: frames for an odd id at or below the highest one
  opened belong to a closed stream and are dropped (HEADERS are still decoded, to keep HPACK in
  step), so no closed-stream table grows with a long-lived connection. Frames for a stream never
  opened are a connection error; pushed streams are refused (SETTINGS_ENABLE_PUSH=0).
- Peer violations that concern one reply (a bad :status, DATA beyond content-length, ...) are a
  stream error: RST_STREAM, and that call fails. Anything else is a connection error:
  ``ProtocolError`` is raised after GOAWAY with its code is queued.

It never imports trio: time, tasks and sockets belong to the caller.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable
from typing import Final, cast

import hpack
from hpack.table import HeaderTable

from gateway.errors import ResponseTooLarge, TransportError
from gateway.transport.wire import RetryableError

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types and flags (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

# SETTINGS identifiers (RFC 9113 §6.5.2).
(
    HEADER_TABLE_SIZE,
    ENABLE_PUSH,
    MAX_CONCURRENT_STREAMS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
) = range(1, 7)

MAX_WINDOW: Final = 2**31 - 1
MAX_STREAM_ID: Final = 2**31 - 1
DEFAULT_WINDOW: Final = 65535
MIN_MAX_FRAME_SIZE: Final = 16384  # also the default, and what we accept (we never raise it)
MAX_MAX_FRAME_SIZE: Final = 2**24 - 1
NO_LIMIT: Final = 2**32  # the peer's MAX_CONCURRENT_STREAMS until it names one

_HEAD = struct.Struct(">HBBBL")  # 24-bit length as 16 + 8 bits, type, flags, R + stream id
_SETTING = struct.Struct(">HL")
_U32 = struct.Struct(">L")
_GOAWAY_BODY = struct.Struct(">LL")
_DECODED_BLOCKS: Final = 64  # repeated reply header blocks kept per connection
SETTINGS_ACK: Final = _HEAD.pack(0, 0, SETTINGS, ACK, 0)


# Frames queued and not yet written past which a peer's PING/SETTINGS is refused (``_queue_ack``).
MAX_PENDING_FRAMES: Final = 10_000


class ErrorCode(enum.IntEnum):
    """HTTP/2 error codes (RFC 9113 §7); the names appear in error messages."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


def error_name(code: int) -> str:
    """The name of an error code; peers may send codes this client does not know."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"unknown error code 0x{code:x}"


class ProtocolError(Exception):
    """A connection error (RFC 9113 §5.4.1): GOAWAY with ``code`` is queued, the connection is done."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class NoStreamAvailableError(Exception):
    """No new stream may be opened: ids exhausted, the peer's stream limit, GOAWAY, or closed."""


class _StreamError(Exception):
    """A violation confined to one stream (RFC 9113 §5.4.2); handled inside ``receive``."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def frame_head(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    """The 9-byte frame header (RFC 9113 §4.1)."""
    return _HEAD.pack(length >> 8, length & 0xFF, kind, flags, stream_id)


class Stream:
    """One call: what is sent, what came back, and how it ended.

    The owner creates it (and may subclass it to attach a waiting task) and hands it to
    ``ClientConnection.open_stream``. ``done`` turns true exactly once: the whole reply arrived
    (``error`` is None) or the call failed (``error`` says how).
    """

    __slots__ = (
        "body",
        "body_size",
        "content_length",
        "done",
        "error",
        "headers",
        "limit",
        "local_closed",
        "recv_unacked",
        "recv_window",
        "remote_closed",
        "send_window",
        "status",
        "stream_id",
    )

    def __init__(self, limit: int) -> None:
        self.stream_id = 0
        self.limit = limit  # reply body bytes accepted; past it: ResponseTooLarge and RST_STREAM(CANCEL)
        self.status = 0  # of the final response; 0 until its HEADERS arrived
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.body_size = 0
        self.content_length = -1
        self.done = False
        self.error: TransportError | None = None
        self.local_closed = False
        self.remote_closed = False
        self.send_window = 0
        self.recv_window = 0
        self.recv_unacked = 0

    def fail(self, error: TransportError) -> bool:
        """End the call with ``error`` unless it already ended; True if this call ended it."""
        if self.done:
            return False
        self.done = True
        self.error = error
        return True

    def response_body(self) -> bytes:
        return b"".join(self.body)


class GoAway:
    """The peer's GOAWAY: streams above ``last_stream_id`` were not processed."""

    __slots__ = ("error_code", "last_stream_id")

    def __init__(self, last_stream_id: int, error_code: int) -> None:
        self.last_stream_id = last_stream_id
        self.error_code = error_code


class _Signal(enum.Enum):
    SETTINGS = "the peer's SETTINGS were applied"
    WINDOW_OPENED = "a send window grew (WINDOW_UPDATE or SETTINGS)"


SETTINGS_CHANGED: Final = _Signal.SETTINGS
WINDOW_OPENED: Final = _Signal.WINDOW_OPENED

Event = Stream | GoAway | _Signal
"""What ``receive`` reports: a stream that ended (``done``), the peer's GOAWAY, or a signal."""


class _CountedTable(HeaderTable):
    """hpack's dynamic table, counting its changes: every entry added and every size update."""

    generation = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.generation += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, value: int) -> None:
        self.generation += 1
        HeaderTable.maxsize.fset(self, value)  # type: ignore[attr-defined]


class ClientConnection:
    """The client side of one HTTP/2 connection, without I/O.

    The owner writes ``data_to_send()`` to the socket (everything is queued as whole frames, so
    any prefix of the output may be dropped only with the connection), feeds what it reads to
    ``receive``, and acts on the events.
    """

    def __init__(
        self,
        *,
        stream_window: int,
        connection_window: int,
        max_header_list_size: int = 65536,
        max_concurrent_streams: int = 100,
    ) -> None:
        self.output: list[bytes | memoryview] = []
        self.streams: dict[int, Stream] = {}  # open streams only; forgotten once they end
        self.encoder = LiteralEncoder()
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._table = self._decoder.header_table = _CountedTable()
        # Header blocks that left the peer's dynamic table as it was, decoded, while it stays so:
        # a backend's replies repeat the same block (indexed fields) until an entry is added.
        self._decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self._decoded_at = 0  # the table's generation the blocks above were decoded against
        # ``_response_fields`` of those same field lists (by identity, the list kept alive beside it).
        self._responses: dict[int, tuple[int, list[tuple[bytes, bytes]], int, list[tuple[bytes, bytes]]]] = {}
        self._max_header_block = 4 * max_header_list_size  # Huffman may make a block ~4x larger
        self._stream_window = stream_window
        self._stream_ack_at = stream_window // 2
        self._recv_window = max(connection_window, DEFAULT_WINDOW)
        self._connection_ack_at = self._recv_window // 2
        self._recv_unacked = 0
        self.send_window = DEFAULT_WINDOW  # the connection's send window; streams have their own
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame_size = MIN_MAX_FRAME_SIZE
        self.peer_max_concurrent_streams = NO_LIMIT
        self.settings_received = False
        self.goaway: GoAway | None = None
        self.last_stream_id = 0  # the highest stream id opened
        self.closed = False  # GOAWAY sent: no new streams
        self._failed = False  # a connection error: nothing more is read
        self._buffer = bytearray()
        self._events: list[Event] = []  # what the current ``receive`` reports
        # A header block waiting for CONTINUATION frames: stream id, fragments, END_STREAM, bad priority.
        self._continuation: tuple[int, bytearray, bool, bool] | None = None

        settings = b"".join(
            _SETTING.pack(ident, value)
            for ident, value in (
                (ENABLE_PUSH, 0),
                (MAX_CONCURRENT_STREAMS, max_concurrent_streams),
                (INITIAL_WINDOW_SIZE, stream_window),
                (MAX_HEADER_LIST_SIZE, max_header_list_size),
            )
        )
        preface = [PREFACE, frame_head(len(settings), SETTINGS, 0, 0), settings]
        if self._recv_window > DEFAULT_WINDOW:
            preface.append(_window_update(0, self._recv_window - DEFAULT_WINDOW))
        self.output.append(b"".join(preface))

    # --- sending ------------------------------------------------------------------------------

    def _queue_ack(self, frame: bytes) -> None:
        """Queue a PING or SETTINGS acknowledgement, unless the peer is not reading what we send.

        A backend that keeps sending PING or SETTINGS while never reading its socket would make
        the unwritten acknowledgements grow without end. The writer drains ``output`` whenever the
        socket takes bytes, and the gateway's own calls queue a few frames each, so thousands of
        pending frames mean the peer stopped reading: that is a connection error.
        """
        if len(self.output) >= MAX_PENDING_FRAMES:
            raise ProtocolError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"more than {MAX_PENDING_FRAMES} frames unwritten: the peer sends PING or SETTINGS"
                " and does not read",
            )
        self.output.append(frame)

    def data_to_send(self) -> bytes:
        """All queued frames as one write (the body's memoryview is copied once, here)."""
        output = self.output
        if not output:
            return b""
        self.output = []
        if len(output) == 1 and type(output[0]) is bytes:
            return output[0]
        return b"".join(output)

    def can_open_stream(self) -> bool:
        return (
            not self.closed and self.goaway is None and len(self.streams) < self.peer_max_concurrent_streams
        )

    def open_stream(
        self, stream: Stream, headers: Iterable[tuple[bytes, bytes]], *, end_stream: bool
    ) -> None:
        """Queue the request's HEADERS on a new stream; ``NoStreamAvailableError`` when none may be opened."""
        stream_id = self.last_stream_id + 2 if self.last_stream_id else 1
        if not self.can_open_stream() or stream_id > MAX_STREAM_ID:
            raise NoStreamAvailableError
        block = self.encoder.encode(headers)
        self.last_stream_id = stream_id
        stream.stream_id = stream_id
        stream.send_window = self.peer_initial_window
        stream.recv_window = self._stream_window
        stream.local_closed = end_stream
        self.streams[stream_id] = stream
        flags = END_STREAM if end_stream else 0
        max_frame = self.peer_max_frame_size
        if len(block) <= max_frame:
            self.output.append(frame_head(len(block), HEADERS, flags | END_HEADERS, stream_id) + block)
            return
        # Past the peer's frame size: HEADERS, then CONTINUATION frames; nothing may come between
        # them, which holds because the whole sequence is queued here at once.
        view = memoryview(block)
        chunks = [view[offset : offset + max_frame] for offset in range(0, len(block), max_frame)]
        frames: list[bytes | memoryview] = [frame_head(len(chunks[0]), HEADERS, flags, stream_id), chunks[0]]
        for index, chunk in enumerate(chunks[1:], start=2):
            last = END_HEADERS if index == len(chunks) else 0
            frames += (frame_head(len(chunk), CONTINUATION, last, stream_id), chunk)
        self.output.append(b"".join(frames))

    def send_window_for(self, stream: Stream) -> int:
        """How many body bytes ``send_data`` would frame now."""
        return min(self.send_window, stream.send_window)

    def send_data(self, stream: Stream, data: memoryview, *, end_stream: bool) -> int:
        """Queue as much of ``data`` as the send windows allow; returns how many bytes.

        ``end_stream`` marks the last frame when all of ``data`` fits. A stream that is no longer
        open (reset, or the connection failed) takes nothing: the owner checks ``stream.done``.
        """
        stream_id = stream.stream_id
        if stream.local_closed or self._failed or self.streams.get(stream_id) is not stream:
            return 0
        size = len(data)
        room = min(size, self.send_window, stream.send_window)
        if room <= 0 and size:
            return 0
        output = self.output
        max_frame = self.peer_max_frame_size
        if room == size and room <= max_frame:  # the usual case: one frame, no slicing
            flags = END_STREAM if end_stream else 0
            output += (frame_head(room, DATA, flags, stream_id), data)
        else:
            for offset in range(0, room, max_frame):
                n = min(room - offset, max_frame)
                flags = END_STREAM if end_stream and offset + n == size else 0
                output += (frame_head(n, DATA, flags, stream_id), data[offset : offset + n])
        self.send_window -= room
        stream.send_window -= room
        if room == size and end_stream:
            stream.local_closed = True
            if stream.remote_closed:
                del self.streams[stream_id]
        return room

    def reset(self, stream: Stream, code: ErrorCode = ErrorCode.CANCEL) -> None:
        """RST_STREAM for a stream still open (else nothing); the stream is forgotten."""
        if self._failed or self.streams.get(stream.stream_id) is not stream:
            return
        del self.streams[stream.stream_id]
        self.output.append(_rst_stream(stream.stream_id, code))

    def close(self, code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        """Queue GOAWAY (no stream of the peer's was processed: last id 0); no new streams."""
        if not self.closed:
            self.closed = True
            self.output.append(_goaway(code))

    # --- receiving ----------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """Process received bytes; raises ``ProtocolError`` on a connection error (GOAWAY queued)."""
        if self._failed:
            return []
        buffer = self._buffer
        if buffer:  # a frame was split across reads
            buffer += data
            data = bytes(buffer)
            buffer.clear()
        events: list[Event] = []
        self._events = events
        try:
            offset = self._frames(data)
        except ProtocolError as exc:
            self._failed = True
            self.closed = True
            self.output.append(_goaway(exc.code))
            raise
        if offset < len(data):
            buffer += memoryview(data)[offset:]
        return events

    def _frames(self, data: bytes) -> int:
        """Handle the whole frames in ``data``; returns where the first incomplete one starts."""
        end = len(data)
        offset = 0
        while end - offset >= 9:
            high, low, kind, flags, stream_id = _HEAD.unpack_from(data, offset)
            length = high << 8 | low
            if length > MIN_MAX_FRAME_SIZE:  # our SETTINGS_MAX_FRAME_SIZE; checked before buffering
                raise ProtocolError(
                    ErrorCode.FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds SETTINGS_MAX_FRAME_SIZE"
                )
            start = offset + 9
            if end - start < length:
                break
            offset = start + length
            stream_id &= MAX_STREAM_ID
            if self._continuation is not None and kind != CONTINUATION:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "header block interrupted before END_HEADERS")
            if not self.settings_received and (kind != SETTINGS or flags & ACK):
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "the server preface must start with SETTINGS")
            if kind == DATA:
                self._on_data(flags, stream_id, data, start, length)
            elif kind == HEADERS:
                self._on_headers(flags, stream_id, data, start, length)
            elif kind == WINDOW_UPDATE:
                self._on_window_update(stream_id, data, start, length)
            elif kind == SETTINGS:
                self._on_settings(flags, stream_id, data, start, length)
            elif kind == RST_STREAM:
                self._on_rst_stream(stream_id, data, start, length)
            elif kind == PING:
                if stream_id:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
                if length != 8:
                    raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "PING payload is not 8 bytes")
                if not flags & ACK:
                    self._queue_ack(frame_head(8, PING, ACK, 0) + data[start:offset])
            elif kind == GOAWAY:
                self._on_goaway(stream_id, data, start, length)
            elif kind == CONTINUATION:
                self._on_continuation(flags, stream_id, data, start, length)
            elif kind == PRIORITY:  # advisory, and only about the peer's scheduling of our streams
                if not stream_id:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
                if length != 5:
                    raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "PRIORITY payload is not 5 bytes")
            elif kind == PUSH_PROMISE:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE although push is disabled")
            # Unknown frame types are ignored (RFC 9113 §5.5).
        return offset

    def _window_opened(self) -> None:
        if WINDOW_OPENED not in self._events:  # once per ``receive`` is enough
            self._events.append(WINDOW_OPENED)

    def _closed_or_idle(self, stream_id: int, what: str) -> None:
        """A frame for a stream not open: dropped if it was ours and ended, else a connection error."""
        if stream_id & 1 and stream_id <= self.last_stream_id:
            return
        if not stream_id & 1:
            raise ProtocolError(
                ErrorCode.PROTOCOL_ERROR, f"{what} on stream {stream_id}, never opened (no push)"
            )
        raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"{what} on idle stream {stream_id}")

    def _stream_error(self, stream: Stream, error: _StreamError) -> None:
        """RST_STREAM with the error's code; the call fails unless its reply was already complete."""
        if self.streams.get(stream.stream_id) is stream:
            del self.streams[stream.stream_id]
        self.output.append(_rst_stream(stream.stream_id, error.code))
        cause = f"stream error: stream ID {stream.stream_id}; {error.code.name}; {error.detail}"
        if stream.fail(TransportError(cause)):
            self._events.append(stream)

    def _on_data(self, flags: int, stream_id: int, data: bytes, start: int, length: int) -> None:
        if not stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        # The whole payload counts, padding included, whatever becomes of the stream (§6.9.1).
        self._recv_window -= length
        if self._recv_window < 0:
            raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_unacked += length
        if self._recv_unacked >= self._connection_ack_at:
            self.output.append(_window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        end = start + length
        if flags & PADDED:
            if not length or data[start] >= length:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA padding exceeds the payload")
            end -= data[start]
            start += 1
        stream = self.streams.get(stream_id)
        if stream is None:
            self._closed_or_idle(stream_id, "DATA")
            return
        try:
            self._stream_data(stream, flags, data[start:end], length)
        except _StreamError as error:
            self._stream_error(stream, error)

    def _stream_data(self, stream: Stream, flags: int, chunk: bytes, length: int) -> None:
        """A DATA frame's ``chunk`` (padding removed) for an open stream; ``length``: flow-controlled."""
        if stream.remote_closed:
            raise _StreamError(ErrorCode.STREAM_CLOSED, "DATA after END_STREAM")
        stream.recv_window -= length
        if stream.recv_window < 0:
            raise _StreamError(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the stream window")
        if not stream.status:
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, "DATA before the response HEADERS")
        if chunk:
            stream.body_size += len(chunk)
            if stream.body_size > stream.limit:
                self.reset(stream, ErrorCode.CANCEL)
                if stream.fail(ResponseTooLarge(stream.limit)):
                    self._events.append(stream)
                return
            if 0 <= stream.content_length < stream.body_size:
                raise _StreamError(ErrorCode.PROTOCOL_ERROR, "more DATA than content-length")
            stream.body.append(chunk)
        if flags & END_STREAM:
            self._remote_end(stream)
            return
        stream.recv_unacked += length
        if stream.recv_unacked >= self._stream_ack_at:
            self.output.append(_window_update(stream.stream_id, stream.recv_unacked))
            stream.recv_window += stream.recv_unacked
            stream.recv_unacked = 0

    def _remote_end(self, stream: Stream) -> None:
        if 0 <= stream.content_length != stream.body_size:
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, "DATA shorter than content-length")
        stream.remote_closed = True
        if stream.local_closed:
            del self.streams[stream.stream_id]
        if not stream.done:
            stream.done = True
            self._events.append(stream)

    def _on_headers(self, flags: int, stream_id: int, data: bytes, start: int, length: int) -> None:
        if not stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        end = start + length
        if flags & PADDED:
            if not length:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its pad length")
            end -= data[start]
            start += 1
        self_dependent = False
        if flags & PRIORITY_FLAG:  # stream dependency and weight: read only to reject self-dependence
            if end - start < 5:
                code = ErrorCode.PROTOCOL_ERROR if flags & PADDED else ErrorCode.FRAME_SIZE_ERROR
                raise ProtocolError(code, "HEADERS too short for its priority")
            self_dependent = _U32.unpack_from(data, start)[0] & MAX_STREAM_ID == stream_id
            start += 5
        if end < start:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "HEADERS padding exceeds the payload")
        end_stream = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._on_header_block(stream_id, data[start:end], end_stream, self_dependent)
        else:
            self._continuation = (stream_id, bytearray(data[start:end]), end_stream, self_dependent)

    def _on_continuation(self, flags: int, stream_id: int, data: bytes, start: int, length: int) -> None:
        pending = self._continuation
        if pending is None or pending[0] != stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without a header block to continue")
        block = pending[1]
        block += data[start : start + length]
        if len(block) > self._max_header_block:
            raise ProtocolError(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self._continuation = None
            self._on_header_block(stream_id, bytes(block), pending[2], pending[3])

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The fields of a header block (read-only: a repeated block gets the same list).

        Speed: decoding a block is a function of its bytes and the dynamic table; a block that
        changed nothing in the table decodes the same way again until the table changes
        (``_CountedTable.generation``), so its fields are kept until then (~10 µs per reply).
        """
        generation = self._table.generation
        if generation == self._decoded_at:
            fields = self._decoded.get(block)
            if fields is not None:
                return fields
        else:
            self._decoded.clear()
            self._responses.clear()
            self._decoded_at = generation
        try:
            fields = cast("list[tuple[bytes, bytes]]", self._decoder.decode(block, raw=True))
        except hpack.OversizedHeaderListError:
            raise ProtocolError(ErrorCode.ENHANCE_YOUR_CALM, "header list too large") from None
        except (hpack.HPACKError, ValueError, IndexError):
            # hpack's own message may quote header bytes: not in ours.
            raise ProtocolError(ErrorCode.COMPRESSION_ERROR, "invalid HPACK header block") from None
        if self._table.generation == generation and len(self._decoded) < _DECODED_BLOCKS:
            self._decoded[block] = fields
        return fields

    def _on_header_block(self, stream_id: int, block: bytes, end_stream: bool, self_dependent: bool) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            self._closed_or_idle(stream_id, "HEADERS")
            self._decode(block)  # the fields are dropped, but the peer's dynamic table moves on
            return
        fields = self._decode(block)
        try:
            self._stream_headers(stream, fields, end_stream, self_dependent)
        except _StreamError as error:
            self._stream_error(stream, error)

    def _stream_headers(
        self, stream: Stream, fields: list[tuple[bytes, bytes]], end_stream: bool, self_dependent: bool
    ) -> None:
        """A decoded header block for an open stream: 1xx, the response, or trailers."""
        if stream.remote_closed:
            raise _StreamError(ErrorCode.STREAM_CLOSED, "HEADERS after END_STREAM")
        if self_dependent:
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, "stream depends on itself")
        if stream.status:
            _check_trailers(fields, end_stream)  # accepted, and dropped: webhooks do not use them
            self._remote_end(stream)
            return
        # Speed: a repeated block decodes to the same list (``_decode``), which checks the same way.
        known = self._responses.get(id(fields))
        if known is not None and known[3] is fields:
            status, headers, content_length = known[0], known[1], known[2]
        else:
            status, headers, content_length = _response_fields(fields)
            if len(self._responses) < _DECODED_BLOCKS:
                self._responses[id(fields)] = (status, headers, content_length, fields)
        if status < 200:
            if status == 101 or end_stream:
                raise _StreamError(ErrorCode.PROTOCOL_ERROR, "invalid informational response")
            return  # 1xx: informational, the final response follows
        stream.status = status
        stream.headers = headers
        stream.content_length = content_length
        if end_stream:
            self._remote_end(stream)

    def _on_window_update(self, stream_id: int, data: bytes, start: int, length: int) -> None:
        if length != 4:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE payload is not 4 bytes")
        increment = _U32.unpack_from(data, start)[0] & MAX_WINDOW
        if not stream_id:
            if not increment:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE with increment 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "connection window above 2**31-1")
            self._window_opened()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            self._closed_or_idle(stream_id, "WINDOW_UPDATE")
            return
        if not increment:
            self._stream_error(
                stream, _StreamError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE with increment 0")
            )
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._stream_error(stream, _StreamError(ErrorCode.FLOW_CONTROL_ERROR, "window above 2**31-1"))
            return
        self._window_opened()

    def _on_settings(self, flags: int, stream_id: int, data: bytes, start: int, length: int) -> None:
        if stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if length:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS acknowledgement with a payload")
            return  # our settings hold from the start: we never lower a limit we announced
        if length % 6:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS payload not a multiple of 6 bytes")
        for offset in range(start, start + length, 6):
            ident, value = _SETTING.unpack_from(data, offset)
            if ident == HEADER_TABLE_SIZE:
                self.encoder.header_table_size = value
            elif ident == ENABLE_PUSH:
                if value > 1:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
            elif ident == MAX_CONCURRENT_STREAMS:
                self.peer_max_concurrent_streams = value
            elif ident == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(
                        ErrorCode.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2**31-1"
                    )
                # Applies to the streams already open, and may make their windows negative (§6.9.2).
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "a stream window above 2**31-1")
            elif ident == MAX_FRAME_SIZE:
                if not MIN_MAX_FRAME_SIZE <= value <= MAX_MAX_FRAME_SIZE:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_max_frame_size = value
            # MAX_HEADER_LIST_SIZE is advisory; unknown settings are ignored (§6.5.2).
        self._queue_ack(SETTINGS_ACK)
        self.settings_received = True
        self._events.append(SETTINGS_CHANGED)
        self._window_opened()

    def _on_rst_stream(self, stream_id: int, data: bytes, start: int, length: int) -> None:
        if not stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if length != 4:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM payload is not 4 bytes")
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            self._closed_or_idle(stream_id, "RST_STREAM")
            return
        code = _U32.unpack_from(data, start)[0]
        name = error_name(code)
        # REFUSED_STREAM: the peer did not process the stream at all (§8.7), so it may go elsewhere.
        error_class = RetryableError if code == ErrorCode.REFUSED_STREAM else TransportError
        if stream.fail(error_class(f"stream error: stream ID {stream_id}; {name}; received from peer")):
            self._events.append(stream)

    def _on_goaway(self, stream_id: int, data: bytes, start: int, length: int) -> None:
        if stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
        if length < 8:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY payload shorter than 8 bytes")
        last, code = _GOAWAY_BODY.unpack_from(data, start)
        last &= MAX_STREAM_ID
        if self.goaway is not None:  # a later GOAWAY may only lower the last stream id (§6.8)
            last = min(last, self.goaway.last_stream_id)
        self.goaway = GoAway(last, code)
        # The peer's debug data is not reported: it is free text from the peer.
        cause = (
            "http2: server sent GOAWAY and closed the connection;"
            f" LastStreamID={last}, ErrCode={error_name(code)}"
        )
        for unprocessed in [open_id for open_id in self.streams if open_id > last]:
            stream = self.streams.pop(unprocessed)
            if stream.fail(RetryableError(cause)):
                self._events.append(stream)
        self._events.append(self.goaway)


def _response_fields(fields: list[tuple[bytes, bytes]]) -> tuple[int, list[tuple[bytes, bytes]], int]:
    """A response's status, regular headers and content-length (-1 if absent).

    ``_StreamError`` if malformed: pseudo-headers other than one valid :status, or after a regular
    header (RFC 9113 §8.3), or an uppercase name (§8.2.1).
    """
    status = 0
    content_length = -1
    headers: list[tuple[bytes, bytes]] = []
    for name, value in fields:
        if name[:1] == b":":
            if headers or name != b":status" or status:
                raise _StreamError(ErrorCode.PROTOCOL_ERROR, "invalid pseudo-header in response")
            if len(value) != 3 or not value.isdigit() or value[:1] == b"0":
                raise _StreamError(ErrorCode.PROTOCOL_ERROR, "invalid :status")
            status = int(value)
            continue
        if name.lower() != name:
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, "uppercase header name")
        if name == b"content-length":
            if not value.isdigit():
                raise _StreamError(ErrorCode.PROTOCOL_ERROR, "invalid content-length")
            content_length = int(value)
        headers.append((name, value))
    if not status:
        raise _StreamError(ErrorCode.PROTOCOL_ERROR, "missing :status")
    return status, headers, content_length


def _check_trailers(fields: list[tuple[bytes, bytes]], end_stream: bool) -> None:
    if not end_stream:
        raise _StreamError(ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM")
    for name, _ in fields:
        if name[:1] == b":" or name.lower() != name:
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, "invalid trailer name")


def _window_update(stream_id: int, increment: int) -> bytes:
    return frame_head(4, WINDOW_UPDATE, 0, stream_id) + _U32.pack(increment)


def _rst_stream(stream_id: int, code: int) -> bytes:
    return frame_head(4, RST_STREAM, 0, stream_id) + _U32.pack(code)


def _goaway(code: int) -> bytes:
    return frame_head(8, GOAWAY, 0, 0) + _GOAWAY_BODY.pack(0, code)


# --- HPACK, outbound --------------------------------------------------------------------------

# Kept out of any compression context and never memoised: credentials (as h2's own normalisation
# did, their surrounding whitespace trimmed), and the per-call traceparent, which never repeats.
NEVER_INDEXED: Final = frozenset({b"authorization", b"proxy-authorization", b"traceparent"})


class LiteralEncoder:
    """HPACK as plain literals: no Huffman coding, no dynamic table, each field's bytes memoised.

    Pure-Python HPACK (table search, Huffman coding) cost ~25 µs per call; HTTP/2 is only spoken to
    loopback backends (TRN-08), where the few bytes indexing saves do not matter. Every field is a
    "literal without indexing" (RFC 7541 §6.2.2; ``NEVER_INDEXED`` names and ``hpack``'s
    never-indexed tuples "never indexed", §6.2.3), so the encoding of a field does not depend on
    earlier blocks and most fields of a call (method, path, authority, content type) are the same
    bytes every time: they are kept per connection, bounded. Decoders accept this form like any
    other.
    """

    MEMO_FIELDS = 256

    def __init__(self) -> None:
        self._memo: dict[tuple[bytes, bytes], bytes] = {}
        self._table_size = 4096
        self._table_size_changes: list[int] = []

    @property
    def header_table_size(self) -> int:
        return self._table_size

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        # The peer's SETTINGS_HEADER_TABLE_SIZE. We never insert, but its decoder's table follows
        # our size updates, so a change must still be signalled (RFC 7541 §4.2).
        if value != self._table_size:
            self._table_size = value
            self._table_size_changes.append(value)

    def encode(self, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
        """One header block; plain tuples of the same name and value are encoded once per connection."""
        memo = self._memo
        block: list[bytes] = []
        if self._table_size_changes:
            # The smallest size since the last block, then the final one (RFC 7541 §4.2).
            smallest = min(self._table_size_changes)
            block.append(_integer(smallest, 5, 0x20))
            if smallest != self._table_size:
                block.append(_integer(self._table_size, 5, 0x20))
            self._table_size_changes.clear()
        for header in headers:
            plain = type(header) is tuple
            if plain:
                field = memo.get(header)
                if field is not None:
                    block.append(field)
                    continue
            name, value = header[0], header[1]
            if name in NEVER_INDEXED:
                block.append(_literal(0x10, name, value.strip()))
            elif not plain and not getattr(header, "indexable", True):
                block.append(_literal(0x10, name, value))
            else:
                field = _literal(0x00, name, value)
                if plain and len(memo) < self.MEMO_FIELDS:
                    memo[header] = field
                block.append(field)
        return b"".join(block)


def _literal(first: int, name: bytes, value: bytes) -> bytes:
    """One literal header field with a new name (RFC 7541 §6.2.2/§6.2.3), no Huffman coding."""
    return b"".join((bytes((first,)), _integer(len(name), 7, 0), name, _integer(len(value), 7, 0), value))


def _integer(n: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) with ``first``'s bits above the prefix (Huffman bit clear)."""
    limit = (1 << prefix_bits) - 1
    if n < limit:
        return bytes((first | n,))
    out = bytearray((first | limit,))
    n -= limit
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
