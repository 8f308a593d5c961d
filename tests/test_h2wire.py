"""The HTTP/2 client framer (gateway.transport.h2wire) against scripted peers on real sockets.

A raw TCP server on 127.0.0.1 plays the backend frame by frame (hyperframe-free: bytes built here,
header blocks by ``hpack.Encoder``), so each rule of RFC 9113 a client must keep or check is seen
on the wire: SETTINGS and their acknowledgement, PING, flow control both ways, CONTINUATION,
padding, 1xx, trailers, GOAWAY, RST_STREAM, and connection versus stream errors. The calls go
through the pool, as the gateway makes them. Properties at the end: what the framer encodes parses
back (frames and HPACK blocks), and what it parses is independent of how the bytes are split.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import hpack
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config.model import ClientConfig
from gateway.errors import ResponseTooLarge, TransportError, TransportTimeout
from gateway.transport import ClientPool, h2wire, http2, resolve_target
from gateway.transport.h2wire import (
    CONTINUATION,
    DATA,
    GOAWAY,
    HEADERS,
    PING,
    PRIORITY,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    ErrorCode,
)

END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, HEADER_TABLE_SIZE = 0x4, 0x5, 0x1
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">L", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">L", stream_id) + payload


def settings_frame(**values: int) -> bytes:
    codes = {
        "HEADER_TABLE_SIZE": 1,
        "MAX_CONCURRENT_STREAMS": 3,
        "INITIAL_WINDOW_SIZE": 4,
        "MAX_FRAME_SIZE": 5,
    }
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", codes[k], v) for k, v in values.items()))


def u32(value: int) -> bytes:
    return struct.pack(">L", value)


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes


@dataclass
class Peer:
    """The server side of one connection, frame by frame."""

    stream: trio.SocketStream
    index: int
    encoder: hpack.Encoder = field(default_factory=hpack.Encoder)
    decoder: hpack.Decoder = field(default_factory=hpack.Decoder)
    seen: list[Frame] = field(default_factory=list)
    client_settings: dict[int, int] = field(default_factory=dict)
    _buffer: bytearray = field(default_factory=bytearray)

    async def _read(self, n: int) -> bytes:
        while len(self._buffer) < n:
            data = await self.stream.receive_some(65536)
            if not data:
                raise EOFError
            self._buffer += data
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def next_frame(self) -> Frame:
        head = await self._read(9)
        length = int.from_bytes(head[:3], "big")
        got = Frame(head[3], head[4], int.from_bytes(head[5:], "big") & 0x7FFFFFFF, await self._read(length))
        self.seen.append(got)
        return got

    async def until(self, kind: int, stream_id: int | None = None) -> Frame:
        while True:
            got = await self.next_frame()
            if got.kind == kind and (stream_id is None or got.stream_id == stream_id):
                return got

    async def frames_until_eof(self) -> list[Frame]:
        try:
            while True:
                await self.next_frame()
        except (EOFError, trio.BrokenResourceError):
            return self.seen

    async def send(self, *frames: bytes) -> None:
        await self.stream.send_all(b"".join(frames))

    async def handshake(self, server_settings: bytes | None = None) -> None:
        """The client's preface and SETTINGS, then ours (default: empty)."""
        assert await self._read(len(PREFACE)) == PREFACE
        first = await self.next_frame()
        assert (first.kind, first.flags, first.stream_id) == (SETTINGS, 0, 0)
        for offset in range(0, len(first.payload), 6):
            ident, value = struct.unpack_from(">HL", first.payload, offset)
            self.client_settings[ident] = value
        await self.send(server_settings if server_settings is not None else settings_frame())

    async def request(self) -> tuple[int, dict[bytes, bytes], bytes]:
        """The next whole request: stream id, headers, body (acknowledging its DATA as it comes)."""
        stream_id, headers, body = 0, {}, bytearray()
        while True:
            got = await self.next_frame()
            if got.kind == HEADERS:
                stream_id = got.stream_id
                headers = dict(self.decoder.decode(got.payload, raw=True))
            elif got.kind == DATA and got.stream_id == stream_id:
                body += got.payload
                if got.payload:
                    await self.send(
                        window_update(0, len(got.payload)), window_update(stream_id, len(got.payload))
                    )
            else:
                continue
            if got.flags & END_STREAM:
                return stream_id, headers, bytes(body)

    def block(self, *fields: tuple[bytes, bytes]) -> bytes:
        return bytes(self.encoder.encode(list(fields)))

    def response(self, stream_id: int, status: bytes = b"200", body: bytes = b"{}") -> bytes:
        head = self.block((b":status", status), (b"content-type", b"application/json"))
        if not body:
            return frame(HEADERS, END_HEADERS | END_STREAM, stream_id, head)
        return frame(HEADERS, END_HEADERS, stream_id, head) + frame(DATA, END_STREAM, stream_id, body)


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, u32(increment))


Script = Callable[[Peer], Awaitable[None]]


class ScriptedServer:
    """Runs ``script(peer)`` for every connection; records the peers and when each script ended."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.peers: list[Peer] = []
        self.finished = 0
        self._changed = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(int(listeners[0].socket.getsockname()[1]))
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        peer = Peer(stream, len(self.peers))
        self.peers.append(peer)
        async with stream:
            try:
                await self.script(peer)
            except (EOFError, trio.BrokenResourceError):
                pass
            finally:
                self.finished += 1
                self._changed.set()
                self._changed = trio.Event()

    async def wait_finished(self, count: int = 1) -> None:
        while self.finished < count:
            await self._changed.wait()


async def call(
    nursery: trio.Nursery, script: Script, body: bytes = b"{}", calls: int = 1, **pool: object
) -> tuple[list[object], ScriptedServer]:
    """Make ``calls`` sequential calls through a pool; each outcome is a response or the exception."""
    server = ScriptedServer(script)
    port = await nursery.start(server.serve)
    target = resolve_target(ClientConfig(url=f"http://127.0.0.1:{port}/hook"), None)
    outcomes: list[object] = []
    async with ClientPool(h2c_prior_knowledge=True, **pool) as client:  # type: ignore[arg-type]
        for _ in range(calls):
            try:
                outcomes.append(await client.post(target, body=body, timeout_seconds=10))
            except TransportError as exc:
                outcomes.append(exc)
    return outcomes, server


def kinds(frames: list[Frame]) -> list[int]:
    return [f.kind for f in frames]


# --- the connection's setup and housekeeping ---------------------------------------------------


async def test_settings_come_first_and_the_peers_are_acknowledged(nursery: trio.Nursery) -> None:
    """The client's preface carries its SETTINGS (no push, 4 MiB stream window, 64 KiB header
    list) and a connection WINDOW_UPDATE; the server's SETTINGS are acknowledged before use."""

    async def script(peer: Peer) -> None:
        await peer.handshake(settings_frame(MAX_CONCURRENT_STREAMS=7))
        stream_id, headers, body = await peer.request()
        assert (headers[b":method"], headers[b":path"], body) == (b"POST", b"/hook?timeout=10s", b"{}")
        await peer.send(peer.response(stream_id))

    (response,), server = await call(nursery, script)
    assert response.status == 200  # type: ignore[attr-defined]
    peer = server.peers[0]
    assert peer.client_settings == {2: 0, 3: 100, 4: http2.STREAM_WINDOW, 6: 65536}
    assert (peer.seen[1].kind, peer.seen[1].stream_id) == (WINDOW_UPDATE, 0)
    assert int.from_bytes(peer.seen[1].payload, "big") == http2.CONNECTION_WINDOW - 65535
    ack = kinds(peer.seen).index(SETTINGS, 1)
    assert peer.seen[ack].flags == ACK and ack < kinds(peer.seen).index(HEADERS)


async def test_ping_is_acknowledged_with_its_payload(nursery: trio.Nursery) -> None:
    async def script(peer: Peer) -> None:
        await peer.handshake()
        stream_id, _, _ = await peer.request()
        await peer.send(frame(PING, 0, 0, b"8 bytes!"))
        pong = await peer.until(PING)
        assert (pong.flags, pong.payload) == (ACK, b"8 bytes!")
        await peer.send(peer.response(stream_id))

    (response,), _ = await call(nursery, script)
    assert response.status == 200  # type: ignore[attr-defined]


# --- replies the client accepts ------------------------------------------------------------------


def _padded(payload: bytes, pad: int) -> bytes:
    return bytes((pad,)) + payload + b"\0" * pad


REPLIES: list[tuple[str, Callable[[Peer, int], bytes], dict[bytes, bytes], bytes]] = [
    (
        "a reply split over HEADERS and two CONTINUATION frames is one header block",
        lambda peer, sid: (
            (block := peer.block((b":status", b"200"), (b"x-long", b"v" * 300), (b"x-more", b"w" * 10)))
            and frame(HEADERS, 0, sid, block[:100])
            + frame(CONTINUATION, 0, sid, block[100:200])
            + frame(CONTINUATION, END_HEADERS, sid, block[200:])
            + frame(DATA, END_STREAM, sid, b"{}")
        ),
        {b"x-long": b"v" * 300, b"x-more": b"w" * 10},
        b"{}",
    ),
    (
        "padded HEADERS and padded DATA lose their padding",
        lambda peer, sid: (
            frame(HEADERS, END_HEADERS | PADDED, sid, _padded(peer.block((b":status", b"200")), 7))
            + frame(DATA, PADDED, sid, _padded(b'{"a":', 3))
            + frame(DATA, PADDED | END_STREAM, sid, _padded(b"1}", 0))
        ),
        {},
        b'{"a":1}',
    ),
    (
        "HEADERS with the PRIORITY flag (and padding) are read past their priority fields",
        lambda peer, sid: frame(
            HEADERS,
            END_HEADERS | PRIORITY_FLAG | PADDED | END_STREAM,
            sid,
            bytes((2,)) + u32(0) + bytes((15,)) + peer.block((b":status", b"200"), (b"x-p", b"1")) + b"\0\0",
        ),
        {b"x-p": b"1"},
        b"",
    ),
    (
        "1xx informational responses are skipped; the final response follows",
        lambda peer, sid: (
            frame(HEADERS, END_HEADERS, sid, peer.block((b":status", b"100")))
            + frame(HEADERS, END_HEADERS, sid, peer.block((b":status", b"103"), (b"link", b"</a>")))
            + peer.response(sid)
        ),
        {b"content-type": b"application/json"},
        b"{}",
    ),
    (
        "trailers after the body are accepted (and dropped)",
        lambda peer, sid: (
            frame(HEADERS, END_HEADERS, sid, peer.block((b":status", b"200")))
            + frame(DATA, 0, sid, b"{}")
            + frame(HEADERS, END_HEADERS | END_STREAM, sid, peer.block((b"grpc-status", b"0")))
        ),
        {},
        b"{}",
    ),
    (
        "frames of unknown types and PRIORITY frames are ignored",
        lambda peer, sid: (
            frame(0xFA, 0, sid, b"whatever") + frame(PRIORITY, 0, sid, u32(0) + b"\x10") + peer.response(sid)
        ),
        {b"content-type": b"application/json"},
        b"{}",
    ),
]


@pytest.mark.parametrize(
    ("reply", "headers", "body"), [pytest.param(r, h, b, id=name) for name, r, h, b in REPLIES]
)
async def test_replies_the_client_reads(
    nursery: trio.Nursery, reply: Callable[[Peer, int], bytes], headers: dict[bytes, bytes], body: bytes
) -> None:
    async def script(peer: Peer) -> None:
        await peer.handshake()
        stream_id, _, _ = await peer.request()
        await peer.send(reply(peer, stream_id))
        await peer.request()  # a second call on the same connection: it survived
        await peer.send(peer.response(3))

    (first, second), server = await call(nursery, script, calls=2)
    assert (first.status, dict(first.headers), first.body) == (200, headers, body)  # type: ignore[attr-defined]
    assert second.status == 200  # type: ignore[attr-defined]
    assert len(server.peers) == 1


# --- flow control -------------------------------------------------------------------------------


async def test_a_body_larger_than_the_peers_windows_waits_for_window_updates(nursery: trio.Nursery) -> None:
    """100 000 bytes against a 65 535-byte connection window and 1 000-byte stream window: the
    client sends what the windows allow and resumes on each WINDOW_UPDATE."""
    body = bytes(range(256)) * 390 + b"tail"
    sizes: list[int] = []

    async def script(peer: Peer) -> None:
        await peer.handshake(settings_frame(INITIAL_WINDOW_SIZE=1000))
        await peer.until(HEADERS)
        received = bytearray()
        while True:
            got = await peer.until(DATA)
            received += got.payload
            sizes.append(len(got.payload))
            if got.flags & END_STREAM:
                break
            if len(received) % 1000 == 0:  # the stream window is used up: open it again
                await peer.send(window_update(0, 1000), window_update(1, 1000))
        assert bytes(received) == body
        await peer.send(peer.response(1))

    (response,), _ = await call(nursery, script, body=body)
    assert response.status == 200  # type: ignore[attr-defined]
    assert max(sizes) == 1000 and sum(sizes) == len(body)


async def test_a_new_initial_window_size_applies_to_the_open_stream(nursery: trio.Nursery) -> None:
    """The client sends 10 of 50 bytes (window 10); SETTINGS raising INITIAL_WINDOW_SIZE to 50
    mid-call gives the open stream 40 more bytes (RFC 9113 §6.9.2), and the call completes."""
    body = b"0123456789" * 5

    async def script(peer: Peer) -> None:
        await peer.handshake(settings_frame(INITIAL_WINDOW_SIZE=10))
        first = await peer.until(DATA)
        assert (first.payload, first.flags) == (body[:10], 0)
        await peer.send(settings_frame(INITIAL_WINDOW_SIZE=50))
        rest = await peer.until(DATA)
        assert (rest.payload, rest.flags) == (body[10:], END_STREAM)
        await peer.send(peer.response(1))

    (response,), server = await call(nursery, script, body=body)
    assert response.status == 200  # type: ignore[attr-defined]
    acks = [f for f in server.peers[0].seen if f.kind == SETTINGS and f.flags == ACK]
    assert len(acks) == 2


async def test_the_peers_max_frame_size_and_header_table_size_are_respected(nursery: trio.Nursery) -> None:
    """A 40 000-byte body goes out in 16 384-byte frames at most; the request's header block
    starts with a dynamic table size update to the peer's HEADER_TABLE_SIZE (RFC 7541 §4.2)."""
    body = b"b" * 40_000

    async def script(peer: Peer) -> None:
        await peer.handshake(settings_frame(HEADER_TABLE_SIZE=256, INITIAL_WINDOW_SIZE=100_000))
        await peer.send(window_update(0, 100_000))
        peer.decoder.max_allowed_table_size = 256
        stream_id, headers, got = await peer.request()
        assert (headers[b":method"], got) == (b"POST", body)
        assert peer.decoder.header_table_size == 256
        await peer.send(peer.response(stream_id))

    (response,), server = await call(nursery, script, body=body)
    assert response.status == 200  # type: ignore[attr-defined]
    sizes = [len(f.payload) for f in server.peers[0].seen if f.kind == DATA]
    assert sizes == [16384, 16384, 40_000 - 2 * 16384]


async def test_data_for_a_forgotten_stream_is_still_acknowledged(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply over max_response_bytes: ResponseTooLarge, RST_STREAM(CANCEL), and the client
    forgets the stream; the DATA the peer had already sent for it still counts against the
    connection window, and is acknowledged (else the connection would starve)."""
    monkeypatch.setattr(http2, "CONNECTION_WINDOW", 65535)  # acknowledged every 32 767 bytes

    async def script(peer: Peer) -> None:
        await peer.handshake()
        stream_id, _, _ = await peer.request()
        chunk = b"x" * 16384
        head = frame(HEADERS, END_HEADERS, stream_id, peer.block((b":status", b"200")))
        await peer.send(head, frame(DATA, 0, stream_id, chunk))
        reset = await peer.until(RST_STREAM)
        assert (reset.stream_id, int.from_bytes(reset.payload, "big")) == (1, ErrorCode.CANCEL)
        await peer.send(frame(DATA, 0, stream_id, chunk), frame(DATA, END_STREAM, stream_id, chunk))
        update = await peer.until(WINDOW_UPDATE)  # the next call may have been sent before it
        assert (update.stream_id, int.from_bytes(update.payload, "big")) == (0, 32768)
        while not [f for f in peer.seen if (f.kind, f.flags, f.stream_id) == (DATA, END_STREAM, 3)]:
            await peer.next_frame()
        await peer.send(peer.response(3))

    (too_large, fine), _ = await call(nursery, script, calls=2, max_response_bytes=1000)
    assert isinstance(too_large, ResponseTooLarge)
    assert fine.status == 200  # type: ignore[attr-defined]


# --- how streams end early ------------------------------------------------------------------


async def _goaway_below(peer: Peer) -> None:
    await peer.handshake()
    await peer.request()
    await peer.send(frame(GOAWAY, 0, 0, u32(0) + u32(ErrorCode.NO_ERROR)))
    await peer.frames_until_eof()


async def _goaway_at(peer: Peer) -> None:
    await peer.handshake()
    stream_id, _, _ = await peer.request()
    await peer.send(frame(GOAWAY, 0, 0, u32(stream_id) + u32(ErrorCode.NO_ERROR) + b"debug"))
    await peer.send(peer.response(stream_id))
    await peer.frames_until_eof()


def _reset_with(code: ErrorCode) -> Script:
    async def script(peer: Peer) -> None:
        await peer.handshake()
        while True:
            stream_id, _, _ = await peer.request()
            await peer.send(frame(RST_STREAM, 0, stream_id, u32(code)))

    return script


@pytest.mark.parametrize(
    ("script", "expected", "connections"),
    [
        pytest.param(
            _goaway_below,
            "http2: server sent GOAWAY and closed the connection; LastStreamID=0, ErrCode=NO_ERROR",
            2,
            id="GOAWAY below the call's stream: unprocessed, resent once on a new connection, then failed",
        ),
        pytest.param(
            _goaway_at,
            200,
            1,
            id="GOAWAY naming the call's stream: its reply still arrives on the closing connection",
        ),
        pytest.param(
            _reset_with(ErrorCode.REFUSED_STREAM),
            "stream error: stream ID 3; REFUSED_STREAM; received from peer",
            1,
            id="RST_STREAM(REFUSED_STREAM): unprocessed, resent once on a new stream, then failed",
        ),
        pytest.param(
            _reset_with(ErrorCode.INTERNAL_ERROR),
            "stream error: stream ID 1; INTERNAL_ERROR; received from peer",
            1,
            id="RST_STREAM with another code: the call fails, never resent",
        ),
        pytest.param(
            _reset_with(0xABC),
            "stream error: stream ID 1; unknown error code 0xabc; received from peer",
            1,
            id="RST_STREAM with a code the client does not know: named by its number",
        ),
    ],
)
async def test_streams_ended_by_the_peer(
    nursery: trio.Nursery, script: Script, expected: object, connections: int
) -> None:
    (outcome,), server = await call(nursery, script)
    if isinstance(expected, int):
        assert outcome.status == expected  # type: ignore[attr-defined]
    else:
        assert isinstance(outcome, TransportError)
        assert outcome.cause == expected
    assert len(server.peers) == connections


# --- violations: the connection or only the call -------------------------------------------------


def _after_request(*replies: Callable[[Peer, int], bytes]) -> Script:
    async def script(peer: Peer) -> None:
        await peer.handshake()
        stream_id, _, _ = await peer.request()
        for reply in replies:
            await peer.send(reply(peer, stream_id))
        await peer.frames_until_eof()

    return script


def _head(peer: Peer, sid: int) -> bytes:
    return frame(HEADERS, END_HEADERS, sid, peer.block((b":status", b"200")))


CONNECTION_ERRORS = [
    (
        "a frame larger than SETTINGS_MAX_FRAME_SIZE",
        lambda peer, sid: _head(peer, sid) + frame(DATA, 0, sid, b"x" * 16385),
        ErrorCode.FRAME_SIZE_ERROR,
        "frame of 16385 bytes exceeds SETTINGS_MAX_FRAME_SIZE",
    ),
    (
        "DATA whose padding length is not below its payload length",
        lambda peer, sid: _head(peer, sid) + frame(DATA, PADDED, sid, bytes((4,)) + b"abc"),
        ErrorCode.PROTOCOL_ERROR,
        "DATA padding exceeds the payload",
    ),
    (
        "HEADERS whose padding exceeds the payload",
        lambda peer, sid: frame(
            HEADERS, END_HEADERS | PADDED, sid, bytes((200,)) + peer.block((b":status", b"200"))
        ),
        ErrorCode.PROTOCOL_ERROR,
        "HEADERS padding exceeds the payload",
    ),
    (
        "DATA on stream 0",
        lambda peer, sid: frame(DATA, 0, 0, b"x"),
        ErrorCode.PROTOCOL_ERROR,
        "DATA on stream 0",
    ),
    (
        "SETTINGS on a stream",
        lambda peer, sid: frame(SETTINGS, 0, sid),
        ErrorCode.PROTOCOL_ERROR,
        "SETTINGS on a stream",
    ),
    (
        "PING on a stream",
        lambda peer, sid: frame(PING, 0, sid, b"12345678"),
        ErrorCode.PROTOCOL_ERROR,
        "PING on a stream",
    ),
    (
        "a SETTINGS payload that is not a multiple of 6 bytes",
        lambda peer, sid: frame(SETTINGS, 0, 0, b"\x00\x04\x00\x00\x01"),
        ErrorCode.FRAME_SIZE_ERROR,
        "SETTINGS payload not a multiple of 6 bytes",
    ),
    (
        "a connection WINDOW_UPDATE of 0",
        lambda peer, sid: window_update(0, 0),
        ErrorCode.PROTOCOL_ERROR,
        "WINDOW_UPDATE with increment 0",
    ),
    (
        "a connection window past 2**31-1",
        lambda peer, sid: window_update(0, 2**31 - 1),
        ErrorCode.FLOW_CONTROL_ERROR,
        "connection window above 2**31-1",
    ),
    (
        "an INITIAL_WINDOW_SIZE past 2**31-1",
        lambda peer, sid: frame(SETTINGS, 0, 0, struct.pack(">HL", INITIAL_WINDOW_SIZE, 2**31)),
        ErrorCode.FLOW_CONTROL_ERROR,
        "SETTINGS_INITIAL_WINDOW_SIZE above 2**31-1",
    ),
    (
        "a MAX_FRAME_SIZE below 16 384",
        lambda peer, sid: frame(SETTINGS, 0, 0, struct.pack(">HL", MAX_FRAME_SIZE, 1000)),
        ErrorCode.PROTOCOL_ERROR,
        "SETTINGS_MAX_FRAME_SIZE out of range",
    ),
    (
        "a header block interrupted by another frame before END_HEADERS",
        lambda peer, sid: (
            frame(HEADERS, 0, sid, peer.block((b":status", b"200"))) + frame(PING, 0, 0, b"12345678")
        ),
        ErrorCode.PROTOCOL_ERROR,
        "header block interrupted before END_HEADERS",
    ),
    (
        "CONTINUATION without a header block to continue",
        lambda peer, sid: frame(CONTINUATION, END_HEADERS, sid, peer.block((b":status", b"200"))),
        ErrorCode.PROTOCOL_ERROR,
        "CONTINUATION without a header block to continue",
    ),
    (
        "PUSH_PROMISE although the client disabled push",
        lambda peer, sid: frame(PUSH_PROMISE, END_HEADERS, sid, u32(2) + peer.block((b":method", b"GET"))),
        ErrorCode.PROTOCOL_ERROR,
        "PUSH_PROMISE although push is disabled",
    ),
    (
        "HEADERS on a stream the client never opened (the server's own, even ids)",
        lambda peer, sid: frame(HEADERS, END_HEADERS, 2, peer.block((b":status", b"200"))),
        ErrorCode.PROTOCOL_ERROR,
        "HEADERS on stream 2, never opened (no push)",
    ),
    (
        "DATA on an idle stream (an odd id above any opened)",
        lambda peer, sid: frame(DATA, 0, sid + 2, b"x"),
        ErrorCode.PROTOCOL_ERROR,
        "DATA on idle stream 3",
    ),
    (
        "an HPACK block that does not decode",
        lambda peer, sid: frame(HEADERS, END_HEADERS, sid, b"\xff\xff\xff\xff"),
        ErrorCode.COMPRESSION_ERROR,
        "invalid HPACK header block",
    ),
]


@pytest.mark.parametrize(
    ("reply", "code", "message"),
    [pytest.param(r, c, m, id=f"connection error: {name}") for name, r, c, m in CONNECTION_ERRORS],
)
async def test_connection_errors_fail_the_call_and_send_goaway(
    nursery: trio.Nursery, reply: Callable[[Peer, int], bytes], code: ErrorCode, message: str
) -> None:
    (outcome,), server = await call(nursery, _after_request(reply))
    assert isinstance(outcome, TransportError)
    assert outcome.cause == f"http2: peer protocol error: {message}"
    await server.wait_finished()
    goaway = [f for f in server.peers[0].seen if f.kind == GOAWAY]
    assert [
        (int.from_bytes(f.payload[:4], "big"), int.from_bytes(f.payload[4:8], "big")) for f in goaway
    ] == [(0, code)]


STREAM_ERRORS = [
    (
        "a :status that is not three digits",
        [(b":status", b"20x")],
        "invalid :status",
    ),
    (
        "a response without :status",
        [(b"content-type", b"application/json")],
        "missing :status",
    ),
    (
        "a pseudo-header after a regular header",
        [(b"content-type", b"application/json"), (b":status", b"200")],
        "invalid pseudo-header in response",
    ),
    (
        "a request pseudo-header in a response",
        [(b":status", b"200"), (b":path", b"/")],
        "invalid pseudo-header in response",
    ),
    (
        "an uppercase header name",
        [(b":status", b"200"), (b"Content-Type", b"application/json")],
        "uppercase header name",
    ),
    (
        "101 Switching Protocols, which HTTP/2 does not have",
        [(b":status", b"101")],
        "invalid informational response",
    ),
]


@pytest.mark.parametrize(
    ("fields", "detail"),
    [pytest.param(f, d, id=f"stream error, only that call fails: {name}") for name, f, d in STREAM_ERRORS],
)
async def test_malformed_responses_fail_only_their_call(
    nursery: trio.Nursery, fields: list[tuple[bytes, bytes]], detail: str
) -> None:
    async def script(peer: Peer) -> None:
        await peer.handshake()
        stream_id, _, _ = await peer.request()
        await peer.send(
            frame(HEADERS, END_HEADERS, stream_id, peer.block(*fields)) + frame(DATA, END_STREAM, 1, b"{}")
        )
        reset = await peer.until(RST_STREAM)
        assert (reset.stream_id, int.from_bytes(reset.payload, "big")) == (1, ErrorCode.PROTOCOL_ERROR)
        await peer.request()
        await peer.send(peer.response(3))

    (failed, fine), server = await call(nursery, script, calls=2)
    assert isinstance(failed, TransportError)
    assert failed.cause == f"stream error: stream ID 1; PROTOCOL_ERROR; {detail}"
    assert fine.status == 200  # type: ignore[attr-defined]
    assert len(server.peers) == 1


async def test_a_body_shorter_than_its_content_length_fails_the_call(nursery: trio.Nursery) -> None:
    async def script(peer: Peer) -> None:
        await peer.handshake()
        stream_id, _, _ = await peer.request()
        head = peer.block((b":status", b"200"), (b"content-length", b"10"))
        await peer.send(
            frame(HEADERS, END_HEADERS, stream_id, head) + frame(DATA, END_STREAM, stream_id, b"{}")
        )
        await peer.until(RST_STREAM)

    (outcome,), _ = await call(nursery, script)
    assert isinstance(outcome, TransportError)
    assert outcome.cause == "stream error: stream ID 1; PROTOCOL_ERROR; DATA shorter than content-length"


# --- properties of the framer itself (no sockets) -------------------------------------------------


def _parse(data: bytes) -> list[Frame]:
    frames, offset = [], 0
    while offset < len(data):
        length = int.from_bytes(data[offset : offset + 3], "big")
        kind, flags = data[offset + 3], data[offset + 4]
        stream_id = int.from_bytes(data[offset + 5 : offset + 9], "big")
        frames.append(Frame(kind, flags, stream_id, data[offset + 9 : offset + 9 + length]))
        offset += 9 + length
    assert offset == len(data)
    return frames


def _connected(**server_settings: int) -> h2wire.ClientConnection:
    connection = h2wire.ClientConnection(stream_window=1 << 20, connection_window=1 << 24)
    connection.receive(settings_frame(**server_settings) + window_update(0, 1 << 24))
    connection.data_to_send()
    return connection


def test_stream_ids_run_up_to_2_31_minus_1_and_then_none_is_available() -> None:
    connection = _connected()
    connection.last_stream_id = 2**31 - 3  # as after ~1 billion calls
    last = h2wire.Stream(100)
    connection.open_stream(last, [(b":method", b"POST")], end_stream=True)
    assert last.stream_id == 2**31 - 1
    assert _parse(connection.data_to_send())[0].stream_id == 2**31 - 1
    with pytest.raises(h2wire.NoStreamAvailableError):
        connection.open_stream(h2wire.Stream(100), [(b":method", b"POST")], end_stream=True)


header_names = st.binary(min_size=1, max_size=40).map(lambda b: bytes(c % 26 + 97 for c in b))
header_values = st.binary(max_size=300).map(lambda b: bytes(c % 94 + 32 for c in b))
header_lists = st.lists(st.tuples(header_names, header_values), max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    headers=header_lists,
    long_value=st.binary(max_size=40_000),
    body=st.binary(max_size=70_000),
    max_frame=st.sampled_from([16384, 16385, 20000, 1 << 20]),
    table_size=st.sampled_from([4096, 0, 100, 65536]),
    calls=st.integers(1, 3),
)
def test_encoded_frames_parse_back(
    headers: list[tuple[bytes, bytes]],
    long_value: bytes,
    body: bytes,
    max_frame: int,
    table_size: int,
    calls: int,
) -> None:
    """Our HEADERS/CONTINUATION/DATA frames parse back: header blocks decode (hpack.Decoder) to the
    same fields, DATA reassembles to the body, no frame exceeds the peer's max frame size, and
    END_STREAM / END_HEADERS sit on the last frame."""
    connection = _connected(
        MAX_FRAME_SIZE=max_frame, HEADER_TABLE_SIZE=table_size, INITIAL_WINDOW_SIZE=1 << 20
    )
    decoder = hpack.Decoder(max_header_list_size=1 << 24)
    decoder.max_allowed_table_size = table_size
    long_field = (b"x-long", long_value.hex().encode())  # up to 80 000 bytes: CONTINUATION frames
    fields = [(b":method", b"POST"), (b":path", b"/x"), *headers, long_field, (b"authorization", b" secret ")]
    for index in range(calls):
        stream = h2wire.Stream(1 << 20)
        connection.open_stream(stream, fields, end_stream=not body)
        assert connection.send_data(stream, memoryview(body), end_stream=True) == len(body)
        frames = _parse(connection.data_to_send())
        assert all(len(f.payload) <= max_frame for f in frames)
        assert {f.stream_id for f in frames} == {2 * index + 1}
        head = [f for f in frames if f.kind in (HEADERS, CONTINUATION)]
        data = [f for f in frames if f.kind == DATA]
        assert [f.kind for f in frames] == [HEADERS] + [CONTINUATION] * (len(head) - 1) + [DATA] * len(data)
        assert [bool(f.flags & END_HEADERS) for f in head] == [False] * (len(head) - 1) + [True]
        decoded = decoder.decode(b"".join(f.payload for f in head), raw=True)
        assert decoded == [*fields[:-1], (b"authorization", b"secret")]
        assert not decoded[-1].indexable  # credentials are sent never-indexed
        assert b"".join(f.payload for f in data) == body
        end_flags = [bool(f.flags & END_STREAM) for f in data or head[:1]]  # never on CONTINUATION
        assert end_flags == [False] * (len(end_flags) - 1) + [True]
        assert decoder.header_table_size == table_size and not decoder.header_table.dynamic_entries


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    headers=header_lists,
    body=st.binary(max_size=40_000),
    split=st.integers(1, 16384),
    pieces=st.integers(1, 5),
    huffman=st.booleans(),
    data=st.data(),
)
def test_replies_parse_the_same_however_the_bytes_are_split(
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    split: int,
    pieces: int,
    huffman: bool,
    data: st.DataObject,
) -> None:
    """A reply encoded by hpack (dynamic table, optionally Huffman), its header block split over
    CONTINUATION frames and its body over DATA frames, arrives whole whatever the read sizes."""
    connection = _connected()
    encoder = hpack.Encoder()
    calls = []
    wire = bytearray()
    for stream_id in (1, 3):  # two replies: the second one uses the peer's dynamic table
        stream = h2wire.Stream(1 << 20)
        connection.open_stream(stream, [(b":method", b"POST")], end_stream=True)
        calls.append(stream)
        block = bytes(encoder.encode([(b":status", b"200"), *headers], huffman=huffman))
        cut = max(1, len(block) // pieces)
        chunks = [block[i : i + cut] for i in range(0, len(block), cut)] or [b""]
        wire += frame(HEADERS, END_HEADERS if len(chunks) == 1 else 0, stream_id, chunks[0])
        for index, chunk in enumerate(chunks[1:], start=2):
            wire += frame(CONTINUATION, END_HEADERS if index == len(chunks) else 0, stream_id, chunk)
        parts = [body[i : i + split] for i in range(0, len(body), split)] or [b""]
        for index, part in enumerate(parts, start=1):
            wire += frame(DATA, END_STREAM if index == len(parts) else 0, stream_id, part)
    offset = 0
    while offset < len(wire):
        size = data.draw(st.integers(1, 20000), label="read size")
        events = connection.receive(bytes(wire[offset : offset + size]))
        offset += size
        assert all(not isinstance(e, h2wire.Stream) or e.done for e in events)
    for stream in calls:
        assert (stream.done, stream.error, stream.status) == (True, None, 200)
        assert stream.headers == headers and stream.response_body() == body
    assert connection.streams == {}


def test_a_peer_sending_pings_while_never_reading_is_a_connection_error_past_the_bound() -> None:
    connection = _connected()
    ping = frame(PING, 0, 0, b"12345678")
    for _ in range(h2wire.MAX_PENDING_FRAMES):  # acknowledged, up to the bound, though never written
        connection.receive(ping)
    with pytest.raises(h2wire.ProtocolError, match="does not read") as caught:
        connection.receive(ping)
    assert caught.value.code == h2wire.ErrorCode.ENHANCE_YOUR_CALM


def test_a_peer_sending_as_many_pings_and_reading_the_acks_is_answered_every_time() -> None:
    connection = _connected()
    ping = frame(PING, 0, 0, b"12345678")
    for _ in range(h2wire.MAX_PENDING_FRAMES + 10):
        connection.receive(ping)
        assert connection.data_to_send().endswith(b"12345678")


# --- over TLS: the calling task writes its own frames when the socket takes them -----------------


@pytest.mark.parametrize(
    ("body_size", "peer_pause", "others_in_flight", "direct"),
    [
        pytest.param(
            8 * 1024,
            0.0,
            0,
            "whole",
            id="a call's frames the socket takes at once are written by the calling task",
        ),
        pytest.param(
            8 * 1024 * 1024,
            0.3,
            0,
            "part",
            id="frames the socket cannot take at once go to the writer first in line and arrive intact",
        ),
        pytest.param(
            8 * 1024,
            0.0,
            1,
            "whole",
            id="a call with others in flight on its connection also writes its own frames when the writer is idle",
        ),
    ],
)
async def test_calls_over_tls_write_directly_or_through_the_writer(
    nursery: trio.Nursery, body_size: int, peer_pause: float, others_in_flight: int, direct: str
) -> None:
    import os

    import trustme

    from gateway.wire.tls_stream import TLSSocketStream
    from tests.support.httpservers import server_context, tcp_pair

    ca = trustme.CA()
    server_ctx = server_context(ca, "localhost", alpn=("h2",))
    client_ctx = ssl_client_context(ca)
    tcp, accepted = await tcp_pair()
    server_tls = TLSSocketStream(accepted, server_ctx, server_side=True)
    client_tls = TLSSocketStream(tcp, client_ctx, server_hostname="localhost")
    body = os.urandom(body_size)
    received: list[bytes] = []

    async def peer_script() -> None:
        await server_tls.do_handshake()
        peer = Peer(server_tls, 0)  # type: ignore[arg-type]
        big = 2**31 - 1
        await peer.handshake(settings_frame(INITIAL_WINDOW_SIZE=big) + window_update(0, big - 65535))
        for pause in (0.0, peer_pause):  # a first call, then the one looked at
            await trio.sleep(pause)  # not reading yet: the client's socket fills up
            stream_id, _, got = await peer.request()
            received.append(got)
            await peer.send(peer.response(stream_id))
        await peer.frames_until_eof()

    nursery.start_soon(peer_script)
    nursery.start_soon(client_tls.do_handshake)
    connection = http2.HTTP2Connection(client_tls, "test", lambda: None)
    written_now: list[tuple[int, int]] = []
    send_now = connection._send_now
    assert send_now is not None

    def counting(data: bytes) -> int:
        sent = send_now(data)
        written_now.append((sent, len(data)))
        return sent

    await nursery.start(connection.run)
    headers = [(b":method", b"POST"), (b":path", b"/h"), (b":scheme", b"https"), (b":authority", b"x")]
    with trio.fail_after(10):
        await connection.wait_ready()
        connection.reserved += 1
        # The first call goes out with the connection's own first frames (the writer is busy then).
        await connection.request(headers, b"{}", max_response_bytes=1 << 20)
        await trio.testing.wait_all_tasks_blocked()
        connection._send_now = counting
        connection.reserved += others_in_flight
        response = await connection.request(headers, body, max_response_bytes=1 << 20)
    assert response.status == 200
    assert received == [b"{}", body]
    if direct == "none":
        assert written_now == []
    else:
        assert written_now  # the calling task tried its own write
        assert any(sent < size for sent, size in written_now) is (direct == "part")
    connection.abort()


def ssl_client_context(ca: Any) -> Any:
    import ssl

    context = ssl.create_default_context()
    ca.configure_trust(context)
    context.set_alpn_protocols(["h2"])
    return context


# --- repeated reply header blocks -------------------------------------------------------------------


def _reply_fields(
    connection: h2wire.ClientConnection, stream_id: int, block: bytes
) -> list[tuple[bytes, bytes]]:
    """The regular headers of a reply whose HEADERS (END_STREAM) carry ``block``."""
    stream = h2wire.Stream(1 << 20)
    connection.open_stream(stream, [(b":method", b"POST")], end_stream=True)
    assert stream.stream_id == stream_id
    connection.receive(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block))
    assert stream.error is None, stream.error
    return stream.headers


INDEXED_X = bytes([0x88, 0x80 | 62])  # :status 200, then dynamic entry 62 (the newest)


def _adds(value: bytes) -> bytes:
    """:status 200 and x-a: ``value`` as a literal added to the dynamic table (it becomes entry 62)."""
    return bytes([0x88, 0x40, 3]) + b"x-a" + bytes([len(value)]) + value


def test_a_repeated_header_block_is_decoded_once_while_the_table_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded: list[bytes] = []
    real = hpack.Decoder.decode

    def spy(self: hpack.Decoder, data: bytes, raw: bool = False) -> Any:
        decoded.append(bytes(data))
        return real(self, data, raw)

    monkeypatch.setattr(hpack.Decoder, "decode", spy)
    connection = _connected()
    assert _reply_fields(connection, 1, _adds(b"1")) == [(b"x-a", b"1")]
    for stream_id in (3, 5, 7):
        assert _reply_fields(connection, stream_id, INDEXED_X) == [(b"x-a", b"1")]
    assert decoded == [_adds(b"1"), INDEXED_X]


@pytest.mark.parametrize(
    ("between", "then"),
    [
        pytest.param(
            _adds(b"2"),
            [(b"x-a", b"2")],
            id="after the peer adds an entry, the same indexed bytes are decoded anew",
        ),
        pytest.param(
            bytes([0x20, 0x88]),
            None,
            id="after the peer empties its table (size update), the same bytes are an error",
        ),
    ],
)
def test_a_repeated_header_block_follows_the_peers_table(
    between: bytes, then: list[tuple[bytes, bytes]] | None
) -> None:
    connection = _connected()
    assert _reply_fields(connection, 1, _adds(b"1")) == [(b"x-a", b"1")]
    assert _reply_fields(connection, 3, INDEXED_X) == [(b"x-a", b"1")]
    stream = h2wire.Stream(1 << 20)
    connection.open_stream(stream, [(b":method", b"POST")], end_stream=True)
    connection.receive(frame(HEADERS, END_HEADERS | END_STREAM, 5, between))
    if then is not None:
        assert _reply_fields(connection, 7, INDEXED_X) == then
    else:
        stream = h2wire.Stream(1 << 20)
        connection.open_stream(stream, [(b":method", b"POST")], end_stream=True)
        with pytest.raises(h2wire.ProtocolError):
            connection.receive(frame(HEADERS, END_HEADERS | END_STREAM, 7, INDEXED_X))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    replies=st.lists(st.sampled_from(range(4)), min_size=1, max_size=25),
    lists=st.lists(header_lists, min_size=4, max_size=4),
    sizes=st.lists(st.sampled_from([None, None, None, 0, 64, 4096]), min_size=25, max_size=25),
)
def test_replies_decode_as_a_fresh_decoder_decodes_them(
    replies: list[int], lists: list[list[tuple[bytes, bytes]]], sizes: list[int | None]
) -> None:
    """However the peer's blocks repeat, add entries and resize its table, each reply's headers are
    what a decoder that never skips a block reads."""
    connection = _connected()
    encoder, reference = hpack.Encoder(), hpack.Decoder()
    for index, which in enumerate(replies):
        if sizes[index] is not None:
            encoder.header_table_size = sizes[index]
        block = bytes(encoder.encode([(b":status", b"200"), *lists[which]]))
        expected = reference.decode(block, raw=True)[1:]
        assert _reply_fields(connection, 2 * index + 1, block) == expected


# --- deadlines of calls on an open connection (the connection's timer) ---------------------------


async def _answer_then_hang(peer: Peer) -> None:
    """Answers the first call, then reads the others and never answers them."""
    await peer.handshake()
    stream_id, _, _ = await peer.request()
    await peer.send(peer.response(stream_id))
    await peer.frames_until_eof()


async def _open_pool(nursery: trio.Nursery, script: Script) -> tuple[ClientPool, Any, ScriptedServer]:
    server = ScriptedServer(script)
    port = await nursery.start(server.serve)
    target = resolve_target(ClientConfig(url=f"http://127.0.0.1:{port}/hook"), None)
    client = ClientPool(h2c_prior_knowledge=True)
    await client.__aenter__()
    return client, target, server


@pytest.mark.parametrize(
    "timeouts",
    [
        pytest.param(
            [0.2], id="a call on an open connection that gets no reply times out at its deadline (FPT-05)"
        ),
        pytest.param(
            [30, 0.2],
            id="a later call with an earlier deadline times out at its own deadline, not the earlier call's",
        ),
    ],
)
async def test_calls_on_an_open_connection_time_out_and_are_reset(
    nursery: trio.Nursery, timeouts: list[float]
) -> None:
    client, target, server = await _open_pool(nursery, _answer_then_hang)
    try:
        assert (
            await client.post(target, body=b"{}", timeout_seconds=10)
        ).status == 200  # the connection is open
        outcomes: list[object] = []

        async def one(timeout: float) -> None:
            try:
                outcomes.append(await client.post(target, body=b"{}", timeout_seconds=timeout))
            except TransportError as exc:
                outcomes.append(exc)

        with trio.move_on_after(5) as bound:  # far beyond 0.2 s, far below 30 s
            async with trio.open_nursery() as calls:
                for timeout in timeouts[:-1]:
                    calls.start_soon(one, timeout)
                await trio.sleep(0.05)
                await one(timeouts[-1])
                calls.cancel_scope.cancel()
        assert not bound.cancelled_caught
        assert isinstance(outcomes[-1], TransportTimeout)
        peer = server.peers[0]
        with trio.fail_after(5):
            while not any(f.kind == RST_STREAM and f.stream_id == 1 + 2 * len(timeouts) for f in peer.seen):
                await trio.sleep(0.01)
        reset = next(f for f in peer.seen if f.kind == RST_STREAM and f.stream_id == 1 + 2 * len(timeouts))
        assert reset.payload == u32(ErrorCode.CANCEL)
    finally:
        await client.__aexit__(None, None, None)


async def test_the_deadlines_of_ended_calls_do_not_pile_up(nursery: trio.Nursery) -> None:
    """Calls that ended leave the connection's deadline heap: it stays bounded by the calls in flight."""

    async def answer_all(peer: Peer) -> None:
        await peer.handshake()
        while True:
            stream_id, _, _ = await peer.request()
            await peer.send(peer.response(stream_id))

    client, target, _ = await _open_pool(nursery, answer_all)
    try:
        for _ in range(300):
            assert (await client.post(target, body=b"{}", timeout_seconds=30)).status == 200
        [connection] = [c for group in client._origins.values() for c in group.h2]
        assert len(connection._deadlines) <= 64 + 2
    finally:
        await client.__aexit__(None, None, None)
