"""The client's plain HTTP/1.1 exchange (``gateway.wire.http11_plain``) against h11 itself.

A request it frames must be the bytes h11 writes for it; a reply head it reads must be one h11
reads the same way (status, headers, body length). Tables name the shapes that must be taken or
left to h11, and hypothesis throws generated heads at both. The last tests go through a real
socket: the backend call's exchange (``gateway.wire.http11.HTTP11Exchange``) reads plain replies
without h11, hands every other reply to h11 with the same result and errors as before, and
reuses a connection only after a complete plain reply.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import h11
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import ResponseTooLarge, TransportError
from gateway.wire.http11 import HTTP11Exchange
from gateway.wire.http11_plain import frame_request, parse_plain_response

BACKEND_HEADERS = [
    (b"Host", b"127.0.0.1:8443"),
    (b"Content-Type", b"application/json"),
    (b"Accept", b"application/json, */*"),
    (b"User-Agent", b"webhook-gateway"),
    (b"content-length", b"20"),
]
BODY = b'{"kind":"Admission"}'


def h11_request_bytes(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    connection = h11.Connection(h11.CLIENT)
    data = connection.send(h11.Request(method=method, target=target, headers=headers)) or b""
    if body:
        data += connection.send(h11.Data(data=body)) or b""
    return data + (connection.send(h11.EndOfMessage()) or b"")


def h11_reply(data: bytes, method: bytes = b"POST") -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """What h11, having sent a request, reads from ``data``: status, headers and the whole body."""
    connection = h11.Connection(h11.CLIENT)
    connection.send(
        h11.Request(method=method, target=b"/", headers=[(b"host", b"a"), (b"content-length", b"0")])
    )
    connection.send(h11.EndOfMessage())
    connection.receive_data(data)
    status, headers, body = 0, [], b""
    while True:
        event = connection.next_event()
        if isinstance(event, h11.Response):
            status, headers = event.status_code, list(event.headers)
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return status, headers, body
        else:
            raise AssertionError(f"h11 did not read a whole reply: {event!r}")


def reply(*lines: bytes, start: bytes = b"HTTP/1.1 200 OK", body: bytes = b"") -> bytes:
    return b"\r\n".join((start, *lines)) + b"\r\n\r\n" + body


# --- framing the request ---------------------------------------------------------------------------

FRAMED = [
    pytest.param(
        b"POST", b"/validate?timeout=10s", BACKEND_HEADERS, BODY, id="a backend call's POST is framed"
    ),
    pytest.param(
        b"POST",
        b"/v",
        [(b"Content-Length", b"20"), (b"HOST", b"b")],
        BODY,
        id="Host is written first, in its own spelling, as h11 writes it",
    ),
    pytest.param(b"GET", b"/api/v1/namespaces", [(b"host", b"k")], b"", id="a GET without a body is framed"),
    pytest.param(
        b"POST", b"/", [(b"host", b"a"), (b"content-length", b"0")], b"", id="an empty body is framed"
    ),
]

LEFT_TO_H11 = [
    pytest.param(b"HEAD", b"/", [(b"host", b"a")], b"", id="HEAD is left to h11 (its reply has no body)"),
    pytest.param(b"POST", b"/", [(b"content-length", b"3")], b"abc", id="a missing Host is left to h11"),
    pytest.param(
        b"POST",
        b"/",
        [(b"host", b"a"), (b"host", b"b"), (b"content-length", b"0")],
        b"",
        id="two Hosts are left to h11",
    ),
    pytest.param(
        b"POST", b"/", [(b"host", b"a")], b"abc", id="a body without a length is left to h11 (chunked)"
    ),
    pytest.param(
        b"POST",
        b"/",
        [(b"host", b"a"), (b"content-length", b"9")],
        b"abc",
        id="a wrong length is left to h11",
    ),
    pytest.param(
        b"POST",
        b"/",
        [(b"host", b"a"), (b"content-length", b"3"), (b"content-length", b"3")],
        b"abc",
        id="two lengths are left to h11",
    ),
    pytest.param(
        b"POST",
        b"/",
        [(b"host", b"a"), (b"connection", b"close"), (b"content-length", b"0")],
        b"",
        id="a Connection header is left to h11",
    ),
    pytest.param(
        b"POST",
        b"/",
        [(b"host", b"a"), (b"expect", b"100-continue"), (b"content-length", b"0")],
        b"",
        id="Expect is left to h11",
    ),
    pytest.param(
        b"POST",
        b"/",
        [(b"host", b"a"), (b"x-evil", b"1\r\nx-smuggled: 2"), (b"content-length", b"0")],
        b"",
        id="a value with a line break is left to h11 (which refuses it): no header is smuggled",
    ),
    pytest.param(
        b"POST",
        b"/",
        [(b"host", b"a"), (b"bad name", b"1"), (b"content-length", b"0")],
        b"",
        id="a bad name too",
    ),
    pytest.param(
        b"POST", b"/a b", [(b"host", b"a"), (b"content-length", b"0")], b"", id="a target with a space too"
    ),
]


@pytest.mark.parametrize(("method", "target", "headers", "body"), FRAMED)
def test_a_plain_request_is_framed_byte_for_byte_as_h11_writes_it(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    assert frame_request(method, target, headers, body) == h11_request_bytes(method, target, headers, body)


@pytest.mark.parametrize(("method", "target", "headers", "body"), LEFT_TO_H11)
def test_any_other_request_is_left_to_h11(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    assert frame_request(method, target, headers, body) is None


_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCXYZ-_0123456789!#", min_size=1, max_size=12).map(
    str.encode
)
_VALUES = st.binary(max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    extra=st.lists(st.tuples(_NAMES, _VALUES), max_size=6),
    body=st.binary(max_size=40),
    target=st.binary(min_size=1, max_size=20),
)
def test_a_framed_request_is_always_the_bytes_h11_writes_and_h11_refuses_none_it_would_have_framed(
    extra: list[tuple[bytes, bytes]], body: bytes, target: bytes
) -> None:
    headers = [(b"host", b"a"), *extra, (b"content-length", b"%d" % len(body))]
    framed = frame_request(b"POST", target, headers, body)
    if framed is None:
        return
    assert framed == h11_request_bytes(b"POST", target, headers, body)


# --- reading the reply head ------------------------------------------------------------------------

GO_BACKEND_REPLY = reply(
    b"Content-Type: application/json",
    b"Date: Tue, 24 Nov 2026 18:00:00 GMT",
    b"Content-Length: 11",
    body=b'{"ok":true}',
)

PLAIN_REPLIES = [
    pytest.param(GO_BACKEND_REPLY, id="a Go backend's reply is read"),
    pytest.param(reply(b"content-length: 0"), id="an empty body is read"),
    pytest.param(
        reply(b"Content-Length: 3", b"Connection: keep-alive", body=b"abc"), id="keep-alive is read"
    ),
    pytest.param(
        reply(b"Content-Length: 3", start=b"HTTP/1.1 500", body=b"err"), id="an error status is read"
    ),
    pytest.param(
        reply(b"X-Empty:", b"X-Spaces:  a  b  ", b"Content-Length: 1", body=b"x"),
        id="values trimmed as h11 trims",
    ),
]

REPLIES_LEFT_TO_H11 = [
    pytest.param(reply(b"Transfer-Encoding: chunked") + b"0\r\n\r\n", id="a chunked body is left to h11"),
    pytest.param(
        reply(b"Content-Length: 3", b"Connection: close", body=b"abc"), id="Connection: close is left to h11"
    ),
    pytest.param(
        reply(b"Content-Length: 3", start=b"HTTP/1.0 200 OK", body=b"abc"), id="HTTP/1.0 is left to h11"
    ),
    pytest.param(
        reply(start=b"HTTP/1.1 100 Continue") + GO_BACKEND_REPLY, id="an interim 100 reply is left to h11"
    ),
    pytest.param(reply(b"Content-Length: 0", start=b"HTTP/1.1 204 No Content"), id="204 is left to h11"),
    pytest.param(
        reply(b"Content-Length: 3", b"Content-Length: 3", body=b"abc"), id="two equal lengths are left to h11"
    ),
    pytest.param(reply(b"Content-Length: 3, 3", body=b"abc"), id="a length list is left to h11"),
    pytest.param(reply(b"X-Fold: a", b" b", b"Content-Length: 0"), id="a folded line is left to h11"),
]


@pytest.mark.parametrize("data", PLAIN_REPLIES)
def test_a_plain_reply_head_is_read_as_h11_reads_it(data: bytes) -> None:
    head = parse_plain_response(data)
    assert head is not None
    status, headers, body = h11_reply(data)
    assert (head.status, head.headers) == (status, headers)
    assert data[head.head_size : head.head_size + head.length] == body
    assert head.head_size + head.length == len(data)


@pytest.mark.parametrize("data", REPLIES_LEFT_TO_H11)
def test_any_other_reply_is_left_to_h11(data: bytes) -> None:
    assert parse_plain_response(data) is None


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(reply(b"Content-Length: 1", body=b"x")[:-3], id="an incomplete head"),
        pytest.param(reply(b"Content-Type: x"), id="a reply without a length (read until EOF)"),
        pytest.param(reply(b"Content-Length: 1", b"Bad Header: x", body=b"x"), id="a malformed header line"),
        pytest.param(b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n", id="a malformed status line"),
    ],
)
def test_a_head_h11_would_refuse_or_read_otherwise_is_not_taken(data: bytes) -> None:
    assert parse_plain_response(data) is None


@settings(max_examples=300, deadline=None)
@given(
    status=st.integers(min_value=100, max_value=599),
    extra=st.lists(st.tuples(_NAMES, _VALUES), max_size=6),
    body=st.binary(max_size=30),
)
def test_every_reply_head_taken_is_read_by_h11_the_same_way(
    status: int, extra: list[tuple[bytes, bytes]], body: bytes
) -> None:
    lines = [b"%s: %s" % field for field in extra] + [b"Content-Length: %d" % len(body)]
    data = reply(*lines, start=b"HTTP/1.1 %d X" % status, body=body)
    head = parse_plain_response(data)
    if head is None:
        return
    assert (head.status, head.headers, data[head.head_size :]) == h11_reply(data)


# --- through a real socket --------------------------------------------------------------------------


async def _exchange_with(
    replies: list[bytes], client: Callable[[HTTP11Exchange], Awaitable[Any]], *, close_after: bool = False
) -> tuple[Any, list[bytes]]:
    """Run ``client`` on an exchange whose peer answers each request with the next of ``replies``
    (written in two pieces, to split heads and bodies across reads); returns its result and what the
    peer received."""
    received: list[bytes] = []
    result: list[Any] = []

    async def peer(stream: trio.SocketStream) -> None:
        buffer = b""
        for data in replies:
            while b"\r\n\r\n" not in buffer or len(buffer) < buffer.index(b"\r\n\r\n") + 4 + _length(buffer):
                buffer += await stream.receive_some(65536)
            end = buffer.index(b"\r\n\r\n") + 4 + _length(buffer)
            received.append(buffer[:end])
            buffer = buffer[end:]
            half = len(data) // 2
            await stream.send_all(data[:half])
            await trio.sleep(0.01)
            await stream.send_all(data[half:])
        if close_after:
            await stream.aclose()
        else:
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, peer, 0)
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(5):
            result.append(await client(HTTP11Exchange(stream)))
        await stream.aclose()
        nursery.cancel_scope.cancel()
    return result[0], received


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            return int(value)
    return 0


async def _post(exchange: HTTP11Exchange, body: bytes = BODY) -> tuple[int, bytes, bool]:
    headers = [(b"host", b"a"), (b"content-length", b"%d" % len(body))]
    await exchange.send(b"POST", b"/v", headers, body)
    status, _ = await exchange.receive_head(1024)
    return status, await exchange.receive_body(1024), exchange.reusable


@pytest.mark.parametrize(
    ("data", "plain"),
    [
        pytest.param(GO_BACKEND_REPLY, True, id="a plain reply is read without h11, which stays idle"),
        pytest.param(
            reply(b"Transfer-Encoding: chunked") + b"b\r\n" + b'{"ok":true}' + b"\r\n0\r\n\r\n",
            False,
            id="a chunked reply is handed to h11 and read the same",
        ),
        pytest.param(
            reply(start=b"HTTP/1.1 100 Continue") + GO_BACKEND_REPLY,
            False,
            id="an interim reply is handed to h11, which skips it",
        ),
    ],
)
async def test_a_backend_reply_is_read_whole_on_either_path_and_the_connection_kept(
    data: bytes, plain: bool
) -> None:
    async def client(exchange: HTTP11Exchange) -> tuple[tuple[int, bytes, bool], Any]:
        outcome = await _post(exchange)
        return outcome, exchange._h11.our_state  # which path read the reply

    (outcome, h11_state), received = await _exchange_with([data], client)
    assert outcome == (200, b'{"ok":true}', True)
    assert received == [
        h11_request_bytes(b"POST", b"/v", [(b"host", b"a"), (b"content-length", b"20")], BODY)
    ]
    assert (h11_state is h11.IDLE) == plain


async def test_a_connection_carries_plain_and_handed_over_exchanges_one_after_another() -> None:
    chunked = reply(b"Transfer-Encoding: chunked") + b"1\r\nx\r\n0\r\n\r\n"
    replies = [GO_BACKEND_REPLY, chunked, GO_BACKEND_REPLY, chunked]

    async def client(exchange: HTTP11Exchange) -> list[tuple[int, bytes, bool]]:
        return [await _post(exchange) for _ in replies]

    outcomes, received = await _exchange_with(replies, client)
    assert outcomes == [(200, b'{"ok":true}', True), (200, b"x", True)] * 2
    assert len(received) == 4


@pytest.mark.parametrize(
    ("data", "error"),
    [
        pytest.param(
            reply(b"Content-Length: 99", body=b"short"),
            "unexpected EOF",
            id="a body cut short by EOF fails the call",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Le", "unexpected EOF", id="a head cut short by EOF fails the call"
        ),
        pytest.param(b"", "EOF", id="a close before any byte of the reply fails the call as EOF"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nBad Header: x\r\nContent-Length: 0\r\n\r\n",
            "net/http: HTTP/1.x transport connection broken",
            id="a malformed head is refused by h11 with its message",
        ),
    ],
)
async def test_a_broken_reply_fails_the_call_as_before(data: bytes, error: str) -> None:
    async def client(exchange: HTTP11Exchange) -> str:
        with pytest.raises(TransportError) as caught:
            await _post(exchange)
        return str(caught.value)

    message, _ = await _exchange_with([data], client, close_after=True)
    assert message.startswith(error)


async def test_a_declared_length_over_the_limit_fails_at_the_head() -> None:
    async def client(exchange: HTTP11Exchange) -> None:
        await exchange.send(b"POST", b"/v", [(b"host", b"a"), (b"content-length", b"0")], b"")
        with pytest.raises(ResponseTooLarge):
            await exchange.receive_head(10)

    await _exchange_with([reply(b"Content-Length: 11", body=b'{"ok":true}')], client)


async def test_bytes_past_the_reply_mean_the_connection_is_not_reused() -> None:
    async def client(exchange: HTTP11Exchange) -> tuple[int, bytes, bool]:
        return await _post(exchange)

    outcome, _ = await _exchange_with([GO_BACKEND_REPLY + b"HTTP/1.1 200 OK\r\n"], client)
    assert outcome == (200, b'{"ok":true}', False)


async def test_a_streamed_plain_body_arrives_in_pieces_and_ends() -> None:
    async def client(exchange: HTTP11Exchange) -> bytes:
        await exchange.send(b"GET", b"/watch", [(b"host", b"a")])
        assert (await exchange.receive_head())[0] == 200
        parts = []
        while (part := await exchange.receive_data()) is not None:
            parts.append(part)
        return b"".join(parts)

    body = b"y" * 5000
    data, _ = await _exchange_with([reply(b"Content-Length: 5000", body=body)], client)
    assert data == body


async def test_a_new_request_before_the_last_reply_was_read_to_its_end_is_refused() -> None:
    """As h11 refuses it: the rest of the old reply would be read as the head of the new one."""

    async def client(exchange: HTTP11Exchange) -> str:
        await exchange.send(b"POST", b"/v", [(b"host", b"a"), (b"content-length", b"0")], b"")
        await exchange.receive_head()
        with pytest.raises(TransportError) as caught:
            await exchange.send(b"POST", b"/v", [(b"host", b"a"), (b"content-length", b"0")], b"")
        return str(caught.value)

    message, _ = await _exchange_with([GO_BACKEND_REPLY], client)
    assert message.startswith("net/http: invalid request")
