"""The gateway's TLS stream (gateway.wire.tls_stream) over real loopback sockets and real certificates.

It carries every inbound TLS connection and every TLS backend call, so it is held to what the
gateway relied on from ``trio.SSLStream``: the same bytes both ways (also records larger than one
TLS record, and a reader and a writer task at once, as HTTP/2 connections run), a peer's EOF as EOF,
failures as ``trio.BrokenResourceError`` with the TLS or socket error as cause, closing that never
waits for the peer and wakes a task blocked on the stream, and no descriptor left behind.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import trio
import trustme

from gateway.wire.tls_stream import TLSSocketStream, stream_socket
from tests.support.httpservers import tcp_pair


@dataclass
class Pair:
    client: TLSSocketStream
    server: TLSSocketStream


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _contexts(ca: trustme.CA, *, client_trusts: bool = True) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_ctx)
    server_ctx.set_alpn_protocols(["h2", "http/1.1"])
    client_ctx = ssl.create_default_context()
    if client_trusts:
        ca.configure_trust(client_ctx)
    client_ctx.set_alpn_protocols(["http/1.1"])
    return server_ctx, client_ctx


@pytest.fixture
async def pair(ca: trustme.CA) -> AsyncIterator[Pair]:
    server_ctx, client_ctx = _contexts(ca)
    client_tcp, server_tcp = await tcp_pair()
    p = Pair(
        TLSSocketStream(client_tcp, client_ctx, server_hostname="localhost"),
        TLSSocketStream(server_tcp, server_ctx, server_side=True),
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(p.server.do_handshake)
        await p.client.do_handshake()
    yield p
    await p.client.aclose()
    await p.server.aclose()


async def _receive_exactly(stream: TLSSocketStream, size: int) -> bytes:
    parts, got = [], 0
    while got < size:
        chunk = await stream.receive_some()
        assert chunk, f"EOF after {got} of {size} bytes"
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


# --- bytes both ways ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size",
    [
        pytest.param(1, id="a single byte arrives intact"),
        pytest.param(8_192, id="an 8 KB review (one TLS record) arrives intact"),
        pytest.param(16_384 * 3 + 7, id="a body of several full TLS records arrives intact"),
        pytest.param(2_000_000, id="2 MB, more than the socket buffers hold, arrives intact"),
    ],
)
async def test_bytes_sent_are_the_bytes_received_both_ways(pair: Pair, size: int) -> None:
    payload = os.urandom(size)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pair.client.send_all, payload)
        assert await _receive_exactly(pair.server, size) == payload
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pair.server.send_all, payload[::-1])
        assert await _receive_exactly(pair.client, size) == payload[::-1]


async def test_a_reader_task_and_a_writer_task_run_on_one_stream_at_once_as_http2_connections_do(
    pair: Pair,
) -> None:
    """Both sides send 4 MB while receiving: done one after the other, the socket buffers would fill."""
    size = 4_000_000
    payload = os.urandom(size)
    received: dict[str, bytes] = {}

    async def receive(name: str, stream: TLSSocketStream) -> None:
        received[name] = await _receive_exactly(stream, size)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive, "server", pair.server)
            nursery.start_soon(receive, "client", pair.client)
            nursery.start_soon(pair.client.send_all, payload)
            nursery.start_soon(pair.server.send_all, payload)
    assert received == {"server": payload, "client": payload}


async def test_alpn_negotiated_in_the_handshake_is_reported(pair: Pair) -> None:
    assert pair.server.selected_alpn_protocol() == "http/1.1"
    assert pair.client.selected_alpn_protocol() == "http/1.1"
    assert isinstance(pair.client.getpeercert(binary_form=True), bytes)
    assert stream_socket(pair.client) is pair.client.socket


# --- ends and failures ----------------------------------------------------------------------------


async def _closing_by_aclose(pair: Pair) -> None:
    await pair.client.aclose()


async def _closing_by_tcp_close(pair: Pair) -> None:
    pair.client.socket.close()  # no close_notify: a ragged EOF, as the API server's client may end
    await trio.lowlevel.checkpoint()


@pytest.mark.parametrize(
    "close",
    [
        pytest.param(_closing_by_aclose, id="a peer that closes reads as EOF, and EOF stays EOF"),
        pytest.param(
            _closing_by_tcp_close,
            id="a peer that drops TCP without close_notify reads as EOF too (https-compatible)",
        ),
    ],
)
async def test_a_closed_peer_reads_as_eof(pair: Pair, close: Callable[[Pair], Awaitable[None]]) -> None:
    await close(pair)
    with trio.fail_after(5):
        assert await pair.server.receive_some() == b""
        assert await pair.server.receive_some() == b""


async def test_a_peer_that_resets_makes_sending_fail_as_broken_with_the_socket_error_as_cause(
    pair: Pair,
) -> None:
    pair.client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    pair.client.socket.close()

    async def write_until_broken() -> None:
        for _ in range(100):  # the reset arrives after the first write at the latest
            await pair.server.send_all(b"x" * 65_536)
            await trio.sleep(0.01)

    with trio.fail_after(5), pytest.raises(trio.BrokenResourceError) as caught:
        await write_until_broken()
    assert isinstance(caught.value.__cause__, OSError)


async def test_an_untrusted_certificate_fails_the_handshake_as_broken_with_the_verification_error(
    ca: trustme.CA,
) -> None:
    server_ctx, client_ctx = _contexts(ca, client_trusts=False)
    client_tcp, server_tcp = await tcp_pair()
    client = TLSSocketStream(client_tcp, client_ctx, server_hostname="localhost")
    server = TLSSocketStream(server_tcp, server_ctx, server_side=True)
    failures: dict[str, BaseException] = {}

    async def handshake(name: str, stream: TLSSocketStream) -> None:
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            failures[name] = exc

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handshake, "server", server)
            nursery.start_soon(handshake, "client", client)
    assert set(failures) == {"client", "server"}
    assert isinstance(failures["client"].__cause__, ssl.SSLCertVerificationError)
    await client.aclose()
    await server.aclose()


# --- closing --------------------------------------------------------------------------------------


async def test_closing_wakes_a_task_blocked_in_receive_with_closed_resource(pair: Pair) -> None:
    outcome: list[BaseException] = []

    async def blocked() -> None:
        try:
            await pair.server.receive_some()
        except trio.ClosedResourceError as exc:
            outcome.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked)
            await trio.testing.wait_all_tasks_blocked()
            await pair.server.aclose()
    assert len(outcome) == 1


@pytest.mark.parametrize(
    "use",
    [
        pytest.param(lambda s: s.receive_some(), id="receiving after close is refused as closed"),
        pytest.param(lambda s: s.send_all(b"x"), id="sending after close is refused as closed"),
        pytest.param(lambda s: s.do_handshake(), id="a handshake after close is refused as closed"),
    ],
)
async def test_a_closed_stream_refuses_use(
    pair: Pair, use: Callable[[TLSSocketStream], Awaitable[object]]
) -> None:
    await pair.server.aclose()
    await pair.server.aclose()  # closing twice is harmless
    with pytest.raises(trio.ClosedResourceError):
        await use(pair.server)


async def test_closing_under_cancellation_still_releases_the_descriptor(pair: Pair) -> None:
    fd = pair.server.socket.fileno()
    await trio.aclose_forcefully(pair.server)
    assert pair.server.socket.fileno() == -1
    with pytest.raises(OSError):
        os.fstat(fd)


async def test_two_tasks_receiving_at_once_is_refused_as_busy(pair: Pair) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pair.server.receive_some)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await pair.server.receive_some()
        nursery.cancel_scope.cancel()


# --- waiting first after a short read --------------------------------------------------------------


async def test_a_reader_asking_for_less_than_a_record_gets_the_rest_without_waiting_for_the_socket(
    pair: Pair,
) -> None:
    """After a short read the stream waits for the socket before reading, unless OpenSSL still holds
    plaintext of the record: that must be handed over at once (nothing more will arrive to wake us)."""
    record = os.urandom(1000)
    await pair.server.send_all(record)
    with trio.fail_after(2):
        got = [await pair.client.receive_some(100) for _ in range(10)]
    assert b"".join(got) == record


async def test_after_a_short_read_records_queued_and_records_sent_later_are_all_received(pair: Pair) -> None:
    """Waiting first never loses data: records already queued on the socket and one sent later."""
    for n in range(3):
        await pair.server.send_all(b"%d" % n * 10)
    await trio.sleep(0.05)
    with trio.fail_after(2):
        assert await _receive_exactly(pair.client, 30) == b"0" * 10 + b"1" * 10 + b"2" * 10
        async with trio.open_nursery() as nursery:

            async def later() -> None:
                await trio.sleep(0.05)
                await pair.server.send_all(b"late")

            nursery.start_soon(later)
            assert await pair.client.receive_some() == b"late"


@pytest.mark.parametrize(
    ("records", "max_bytes", "expected"),
    [
        pytest.param(
            [4096, 4096, 300],
            65536,
            [8492],
            id="a request Go's HTTP client wrote through its 4 KiB buffer arrives in one receive_some",
        ),
        pytest.param(
            [1100 + 100 * n for n in range(7)],
            65536,
            [sum(1100 + 100 * n for n in range(7))],
            id="the growing short records Go's TLS starts a connection with arrive in one receive_some",
        ),
        pytest.param([4096, 4096, 300], 5000, [5000, 3492], id="several records never exceed max_bytes"),
    ],
)
async def test_short_records_already_on_the_socket_come_in_one_receive(
    pair: Pair, records: list[int], max_bytes: int, expected: list[int]
) -> None:
    """Records of one message queued on the socket are read together, not one per call with a wait
    of trio's run loop between them (what a review in several records cost the gateway)."""
    sent = [os.urandom(size) for size in records]
    for record in sent:
        await pair.server.send_all(record)  # one TLS record each
    await trio.sleep(0.05)  # all of them on the client's socket
    with trio.fail_after(2):
        got = [await pair.client.receive_some(max_bytes) for _ in expected]
    assert [len(chunk) for chunk in got] == expected
    assert b"".join(got) == b"".join(sent)


async def _read_loop(stream: TLSSocketStream, size: int, max_bytes: int = 65536) -> tuple[bytes, int]:
    """A read loop as the HTTP/2 reader runs it (``receive_now``, ``wait_readable``): bytes, waits."""
    parts, got, waits = [], 0, 0
    while got < size:
        data = stream.receive_now(max_bytes)
        if data is None:
            waits += 1
            await stream.wait_readable()
            continue
        assert data, f"EOF after {got} of {size} bytes"
        parts.append(data)
        got += len(data)
    return b"".join(parts), waits


@pytest.mark.parametrize(
    ("size", "max_bytes"),
    [
        pytest.param(100, 65536, id="a short record is read after one wait"),
        pytest.param(200_000, 65536, id="records past one TLS record arrive whole"),
        pytest.param(1000, 100, id="a reader asking for less than a record gets the rest without the socket"),
    ],
)
async def test_a_read_loop_on_receive_now_gets_every_byte(pair: Pair, size: int, max_bytes: int) -> None:
    payload = os.urandom(size)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pair.server.send_all, payload)
        with trio.fail_after(5):
            got, _ = await _read_loop(pair.client, size, max_bytes)
    assert got == payload


async def test_a_read_loop_on_receive_now_reads_short_records_already_on_the_socket_without_a_wait(
    pair: Pair,
) -> None:
    """A reply written in several short records (a backend's HEADERS and DATA written apart) is read
    on without a pass of trio's run loop per record."""
    sent = [os.urandom(size) for size in (300, 1200, 40)]
    for record in sent:
        await pair.server.send_all(record)  # one TLS record each
    await trio.sleep(0.05)
    with trio.fail_after(2):
        got, waits = await _read_loop(pair.client, sum(map(len, sent)))
    assert got == b"".join(sent)
    assert waits == 0


async def test_receive_now_reports_eof_and_refuses_use_after_close(pair: Pair) -> None:
    await pair.server.aclose()
    with trio.fail_after(5):
        while (data := pair.client.receive_now()) is None:
            await pair.client.wait_readable()
    assert data == b""
    await pair.client.aclose()
    with pytest.raises(trio.ClosedResourceError):
        pair.client.receive_now()


async def test_a_read_loop_that_always_finds_data_still_waits_every_few_reads(pair: Pair) -> None:
    """Every few reads that found data ready, ``receive_now`` asks for a wait: the loop yields."""
    size = 48 * 1024
    await pair.server.send_all(os.urandom(size))
    await trio.sleep(0.1)
    with trio.fail_after(5):
        _, waits = await _read_loop(pair.client, size, 64)
    assert waits >= (size // 64) // 8


# --- fairness -------------------------------------------------------------------------------------


async def test_a_reader_that_always_finds_data_ready_still_lets_other_tasks_run(pair: Pair) -> None:
    """Operations that need not wait skip most schedule points, never all: a flood cannot starve the loop."""
    size = 48 * 1024  # fits in the loopback socket buffers: every read below finds data ready
    with trio.fail_after(5):
        await pair.server.send_all(os.urandom(size))
    await trio.sleep(0.1)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.01)
        ticks = 0
        got = 0
        while got < size:
            got += len(await pair.client.receive_some(64))
        nursery.cancel_scope.cancel()
    reads = size // 64
    assert ticks >= reads // 8, f"{ticks} ticks of other work during {reads} reads"


async def test_send_now_writes_a_reply_the_socket_has_room_for_at_once(pair: Pair) -> None:
    """``send_now`` (the inbound reply's path) writes everything without waiting when there is room."""
    reply = b"r" * 5000
    assert pair.server.send_now(reply) == len(reply)
    assert await _receive_exactly(pair.client, len(reply)) == reply


async def test_send_now_on_a_full_socket_writes_nothing_and_send_all_finishes_with_the_same_bytes(
    pair: Pair,
) -> None:
    """A peer that does not read: ``send_now`` reports 0 (never a wait), and ``send_all`` with the same
    bytes completes once the peer reads, the bytes intact and in order."""
    chunk = os.urandom(64 * 1024)
    sent_before_full = []
    while (n := pair.server.send_now(chunk)) == len(chunk):
        sent_before_full.append(chunk)
        assert len(sent_before_full) < 10_000  # the socket buffers are finite
    assert n == 0
    received = bytearray()

    async def read_all(total: int) -> None:
        while len(received) < total:
            received.extend(await pair.client.receive_some(65536))

    total = (len(sent_before_full) + 1) * len(chunk)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all, total)
        await pair.server.send_all(chunk)
    assert bytes(received) == b"".join(sent_before_full) + chunk


@pytest.mark.parametrize(
    ("state", "error"),
    [
        pytest.param("closed", trio.ClosedResourceError, id="send_now after aclose is refused as closed"),
        pytest.param(
            "sending", trio.BusyResourceError, id="send_now while another task sends is refused as busy"
        ),
    ],
)
async def test_send_now_refuses_like_send_all(pair: Pair, state: str, error: type[Exception]) -> None:
    if state == "closed":
        await pair.server.aclose()
        with pytest.raises(error):
            pair.server.send_now(b"x")
        return
    chunk = os.urandom(64 * 1024)
    while pair.server.send_now(chunk):  # fill the socket so that send_all has to wait
        pass
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pair.server.send_all, chunk)
        await trio.sleep(0.05)
        with pytest.raises(error):
            pair.server.send_now(b"x")
        nursery.cancel_scope.cancel()


async def test_two_tasks_needing_the_same_direction_wait_together_without_polling(
    ca: trustme.CA, mock_clock: trio.testing.MockClock
) -> None:
    """An HTTP/2 connection's reader and writer both start before the handshake: both wait for the
    peer's reply on the socket, where trio lets one task wait per direction. The second waits for
    the first one's wake-up, not on a timer: under a clock that never moves, both still finish."""
    server_ctx, client_ctx = _contexts(ca)
    client_tcp, server_tcp = await tcp_pair()
    client = TLSSocketStream(client_tcp, client_ctx, server_hostname="localhost")
    server = TLSSocketStream(server_tcp, server_ctx, server_side=True)
    got: list[bytes] = []

    async def read_one() -> None:
        got.append(await client.receive_some())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_one)
        nursery.start_soon(client.send_all, b"ping")
        await trio.testing.wait_all_tasks_blocked()  # both client tasks wait for the server
        await server.do_handshake()
        assert await _receive_exactly(server, 4) == b"ping"
        await server.send_all(b"pong")
    assert got == [b"pong"]
    await client.aclose()
    await server.aclose()


# --- trio's own stream conformance checks ------------------------------------------------------------


async def _conformance_pair(ca: trustme.CA) -> tuple[TLSSocketStream, TLSSocketStream]:
    """A handshaken client/server pair that yields to the scheduler on every operation, as trio's
    streams do (``schedule_every=1``); the gateway batches those yields (see ``_schedule_point``)."""
    server_ctx, client_ctx = _contexts(ca)
    client_tcp, server_tcp = await tcp_pair()
    client = TLSSocketStream(client_tcp, client_ctx, server_hostname="localhost", schedule_every=1)
    server = TLSSocketStream(server_tcp, server_ctx, server_side=True, schedule_every=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.do_handshake)
        await client.do_handshake()
    return client, server


async def _clogged_pair(ca: trustme.CA) -> tuple[TLSSocketStream, TLSSocketStream]:
    """A pair neither side of which can send until the other reads: both directions are full
    (trio checks the pair both ways round).

    Over a Unix stream socket pair: what a writer queues there stays charged to its send buffer
    until the reader takes it, so full means full until the peer reads. (Over TCP, delayed
    acknowledgements and the kernel compacting a receive queue open room again at moments of their
    own, and the clogged checks became flaky on a loaded machine.) Each side writes 16 KiB records
    while poll() calls its socket writable, then one-byte records until the socket takes no more.
    OpenSSL keeps that last, unwritten record for a retry; it is one byte long, so trio's clogged
    checks can call ``send_all`` with other bytes after it (what the receiver would then see of
    them is not part of those checks: they never read them).
    """
    server_ctx, client_ctx = _contexts(ca)
    left, right = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = TLSSocketStream(
        trio.SocketStream(left), client_ctx, server_hostname="localhost", schedule_every=1
    )
    server = TLSSocketStream(trio.SocketStream(right), server_ctx, server_side=True, schedule_every=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.do_handshake)
        await client.do_handshake()
    record = b"x" * 16_384
    for stream in (client, server):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65_536)
        writable = select.poll()
        writable.register(stream.socket, select.POLLOUT)
        while writable.poll(0):  # at most a quarter of the buffer in use: a record fits
            assert stream.send_now(record) == len(record)
        while stream.send_now(b"x"):
            pass
    return client, server


async def test_the_tls_stream_passes_trios_two_way_stream_checks(ca: trustme.CA) -> None:
    """trio.testing.check_two_way_stream over real loopback sockets, both directions, with and
    without a clogged sender: checkpoints, argument checks, Busy/Closed/Broken errors, closing
    that wakes blocked tasks, and 1 MiB each way at once in random chunks. (TLS here closes without
    close_notify and has no half-close, so check_half_closeable_stream does not apply.)"""
    await trio.testing.check_two_way_stream(lambda: _conformance_pair(ca), lambda: _clogged_pair(ca))
