"""The HTTP/1.1 fast path (``gateway.server.http11_fast``) against h11 itself.

A head the fast path takes must be one h11 takes the same way (method, target, headers in both
spellings, body, keep-alive, no 100-continue), and a reply it frames must be the bytes h11 writes.
Tables name the shapes that must be taken or left to h11; hypothesis then throws generated and
mutated heads at both. Through real sockets, tests/test_server_http11.py checks that what callers
see does not change; here the last tests check that the fast path is the one taken.
"""

from __future__ import annotations

from typing import Any

import h11
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.server.http11_fast import closes, frame_reply, parse_plain_request
from tests.support.inbound import RecordingApp, serve_asgi

APISERVER_HEAD = (
    b"POST /validate?timeout=10s HTTP/1.1\r\n"
    b"Host: gateway.webhooks.svc:443\r\n"
    b"User-Agent: kube-apiserver-admission\r\n"
    b"Content-Length: 20\r\n"
    b"Accept: application/json, */*\r\n"
    b"Content-Type: application/json\r\n"
    b"Accept-Encoding: gzip\r\n"
    b"\r\n"
)
BODY = b'{"kind":"Admission"}'


def h11_reading(data: bytes) -> tuple[h11.Connection, list[Any]]:
    """What h11 makes of ``data`` as a server: its connection and the events up to NEED_DATA."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(data)
    events: list[Any] = []
    while (event := connection.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        events.append(event)
    return connection, events


def assert_h11_agrees(data: bytes) -> None:
    """``data`` was taken by the fast path: h11 reads exactly the same request from it."""
    taken = parse_plain_request(data)
    assert taken is not None
    connection, events = h11_reading(data)
    request, *rest = events
    assert isinstance(request, h11.Request)
    assert (request.method, request.target, request.http_version) == (taken.method, taken.target, b"1.1")
    assert list(request.headers) == taken.headers
    assert request.headers.raw_items() == taken.raw_headers
    body = b"".join(bytes(e.data) for e in rest if isinstance(e, h11.Data))
    assert body == taken.body
    ended = any(isinstance(e, h11.EndOfMessage) for e in rest)
    assert ended == (taken.body_left == 0)
    if not ended:  # the rest of the body, as the fast path counts it, ends h11's message exactly
        connection.receive_data(b"x" * taken.body_left)
        tail = [connection.next_event(), connection.next_event()]
        assert isinstance(tail[-1], h11.EndOfMessage) or isinstance(tail[0], h11.EndOfMessage)
    assert connection.their_state in (h11.SEND_BODY, h11.DONE)
    assert not connection.they_are_waiting_for_100_continue
    assert connection._cstate.keep_alive
    assert not connection._receive_buffer  # nothing h11 would keep for later


def head(*lines: bytes, start: bytes = b"POST /validate HTTP/1.1") -> bytes:
    return b"\r\n".join([start, *lines]) + b"\r\n\r\n"


TAKEN = [
    pytest.param(APISERVER_HEAD + BODY, id="kube-apiserver's POST with its whole body is taken"),
    pytest.param(APISERVER_HEAD + BODY[:7], id="a head with part of its body is taken; the rest is counted"),
    pytest.param(APISERVER_HEAD, id="a head whose body has not arrived yet is taken"),
    pytest.param(head(b"host: a", start=b"GET /healthz HTTP/1.1"), id="a GET without a body is taken"),
    pytest.param(head(b"Host: a", b"Content-Length: 0"), id="an empty body is taken"),
    pytest.param(
        head(b"Host: a", b"Connection: Keep-Alive", b"Content-Length: 2") + b"{}",
        id="Connection keep-alive is taken",
    ),
    pytest.param(
        head(b"Host: a", b"X-A:  spaced  out \t", b"Content-Length: 2") + b"{}",
        id="header values lose the whitespace around them, as in h11",
    ),
    pytest.param(
        head(b"HOST: a", b"X-Mixed-Case: V", b"content-length: 0002") + b"{}",
        id="names keep their spelling in the raw list; leading zeros in the length are fine",
    ),
    pytest.param(head(b"Host: a", b"X-Empty:", b"Content-Length: 0"), id="an empty header value is taken"),
    pytest.param(
        head(b"Host: a", b"X-Obs: caf\xc3\xa9 \x01", b"Content-Length: 0"),
        id="obs-text and controls h11 allows in values are taken",
    ),
]

LEFT_TO_H11 = [
    pytest.param(APISERVER_HEAD[:-2], id="an incomplete head is left to h11"),
    pytest.param(
        APISERVER_HEAD + BODY + b"GET / HTTP/1.1\r\n",
        id="bytes after the body (a pipelined request) are left to h11",
    ),
    pytest.param(
        head(b"Host: a", start=b"POST / HTTP/1.0"), id="HTTP/1.0 (no keep-alive by default) is left to h11"
    ),
    pytest.param(
        head(b"Host: a", start=b"HEAD / HTTP/1.1"), id="HEAD (a reply without a body) is left to h11"
    ),
    pytest.param(
        head(b"Host: a", start=b"PRI * HTTP/2.0"), id="the HTTP/2 preface is left to h11 and hypercorn"
    ),
    pytest.param(head(b"Host: a", b"Transfer-Encoding: chunked"), id="a chunked body is left to h11"),
    pytest.param(
        head(b"Host: a", b"Expect: 100-continue", b"Content-Length: 1"),
        id="Expect 100-continue is left to h11",
    ),
    pytest.param(
        head(b"Host: a", b"Upgrade: h2c", b"Connection: Upgrade"),
        id="an upgrade is left to h11 and hypercorn",
    ),
    pytest.param(
        head(b"Host: a", b"Connection: close", b"Content-Length: 0"), id="Connection close is left to h11"
    ),
    pytest.param(head(b"Content-Length: 0"), id="a missing Host is left to h11 (it answers 400)"),
    pytest.param(head(b"Host: a", b"Host: b"), id="two Host headers are left to h11 (it answers 400)"),
    pytest.param(
        head(b"Host: a", b"Content-Length: 1", b"Content-Length: 1") + b"x",
        id="a repeated Content-Length is left to h11",
    ),
    pytest.param(head(b"Host: a", b"Content-Length: 1, 1") + b"x", id="a Content-Length list is left to h11"),
    pytest.param(
        head(b"Host: a", b"Content-Length: -1"),
        id="a malformed Content-Length is left to h11 (it answers 400)",
    ),
    pytest.param(
        head(b"Host: a", b"Content-Length: " + b"9" * 19),
        id="a Content-Length of 19 digits or more is left to h11",
    ),
    pytest.param(head(b"Host: a", b"X-Fold: one", b" two"), id="a folded header line is left to h11"),
    pytest.param(head(b"Host: a", b"X-Bad : v"), id="space before the colon is left to h11 (it answers 400)"),
    pytest.param(b"POST / HTTP/1.1\nHost: a\r\n\r\n", id="a bare LF line end is left to h11"),
    pytest.param(b"\r\n" + head(b"Host: a"), id="an empty line before the request line is left to h11"),
    pytest.param(
        head(b"Host: a", start=b"POST /a b HTTP/1.1"),
        id="a space in the target is left to h11 (it answers 400)",
    ),
    pytest.param(head(b"Host: a", b"X-Nul: a\x00b"), id="NUL in a value is left to h11 (it answers 400)"),
]


@pytest.mark.parametrize("data", TAKEN)
def test_the_fast_path_takes_plain_requests_as_h11_reads_them(data: bytes) -> None:
    assert_h11_agrees(data)


@pytest.mark.parametrize("data", LEFT_TO_H11)
def test_the_fast_path_leaves_other_shapes_to_h11(data: bytes) -> None:
    assert parse_plain_request(data) is None


# --- generated heads --------------------------------------------------------------------------

_TOKEN = st.text("abcXYZ-_.!#09", min_size=1, max_size=8).map(str.encode)
_VALUE = st.one_of(
    st.text("ab 9\t,;=-", max_size=10).map(str.encode),
    st.sampled_from(
        [b"close", b"keep-alive", b"Keep-Alive, close", b"chunked", b"100-continue", b" 3 ", b"1,1", b"-1"]
    ),
    st.binary(max_size=6),
)
_NAMES = st.sampled_from(
    [b"Host", b"Content-Length", b"Connection", b"Expect", b"Transfer-Encoding", b"Upgrade", b"TE", b"X-A"]
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """Plain requests, then changed near the fast path's edges: methods, versions, the headers
    that matter, a wrong or missing length, a flipped byte, a cut anywhere."""
    method = draw(st.sampled_from([b"POST", b"POST", b"GET", b"HEAD", b"PUT"]))
    version = draw(st.sampled_from([b"1.1", b"1.1", b"1.1", b"1.0"]))
    target = draw(st.sampled_from([b"/v", b"/v?timeout=3s", b"/%41", b"*"]))
    body = draw(st.binary(max_size=16))
    fields = [(b"Host", b"gw")]
    fields += draw(st.lists(st.tuples(st.one_of(_NAMES, _TOKEN), _VALUE), max_size=3))
    length = draw(st.sampled_from([b"%d" % len(body), b"%d" % len(body), None, b"%d" % (len(body) + 3)]))
    if length is not None:
        fields.insert(draw(st.integers(0, len(fields))), (b"Content-Length", length))
    lines = [method + b" " + target + b" HTTP/" + version]
    lines += [name + draw(st.sampled_from([b": ", b": ", b":", b" :"])) + value for name, value in fields]
    data = bytearray(b"\r\n".join(lines) + b"\r\n\r\n" + body)
    if draw(st.booleans()):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(data))) if draw(st.booleans()) else 0
    return bytes(data[: len(data) - cut])


def test_generated_heads_reach_both_sides() -> None:
    """The generator yields heads the fast path takes and heads it leaves (else the properties
    below would check nothing)."""
    taken: set[bool] = set()

    @settings(max_examples=300, deadline=None, database=None)
    @given(requests())
    def sample(data: bytes) -> None:
        taken.add(parse_plain_request(data) is not None)

    sample()
    assert taken == {True, False}


@settings(max_examples=3000, deadline=None)
@given(requests())
def test_any_head_the_fast_path_takes_h11_reads_the_same(data: bytes) -> None:
    if parse_plain_request(data) is not None:
        assert_h11_agrees(data)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_taken_by_the_fast_path_are_read_the_same_by_h11(data: bytes) -> None:
    if parse_plain_request(data) is not None:
        assert_h11_agrees(data)


# --- replies ----------------------------------------------------------------------------------


def h11_reply(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[bytes, bool]:
    """What h11 writes for this reply to kube-apiserver's request, and whether it keeps the connection."""
    connection, _ = h11_reading(APISERVER_HEAD + BODY)
    data = connection.send(h11.Response(status_code=status, headers=headers))
    data += connection.send(h11.Data(data=body)) if body else b""
    data += connection.send(h11.EndOfMessage())
    return data, connection.our_state is h11.DONE


DATE = (b"date", b"Tue, 24 Nov 2026 15:57:39 GMT")
SERVER = (b"server", b"hypercorn-h11")

REPLIES = [
    pytest.param(
        200,
        [(b"content-type", b"application/json"), (b"content-length", b"2"), DATE, SERVER],
        b"{}",
        id="the gateway's reply is h11's bytes",
    ),
    pytest.param(
        400,
        [(b"content-length", b"6"), (b"x-Spelt", b"as given")],
        b"reason",
        id="other statuses and header spellings are h11's bytes",
    ),
    pytest.param(
        200,
        [(b"content-length", b"0"), (b"connection", b"close")],
        b"",
        id="a reply that closes the connection is h11's bytes",
    ),
    pytest.param(
        200,
        [(b"content-length", b"0"), (b"connection", b"keep-alive, Close")],
        b"",
        id="close among other Connection tokens closes",
    ),
]


@pytest.mark.parametrize(("status", "headers", "body"), REPLIES)
def test_a_whole_reply_is_framed_as_h11_frames_it(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    framed = frame_reply(status, headers, body)
    data, kept = h11_reply(status, headers, body)
    assert framed == data
    assert closes(headers) == (not kept)


NOT_FRAMED = [
    pytest.param(
        200,
        [(b"content-type", b"text/plain")],
        b"x",
        id="a reply without Content-Length is left to h11 (it chunks it)",
    ),
    pytest.param(
        200,
        [(b"content-length", b"2")],
        b"x",
        id="a Content-Length other than the body's is left to h11 (it refuses it)",
    ),
    pytest.param(
        200,
        [(b"content-length", b"1"), (b"content-length", b"1")],
        b"x",
        id="two Content-Length headers are left to h11",
    ),
    pytest.param(204, [(b"content-length", b"0")], b"", id="204 (no body allowed) is left to h11"),
    pytest.param(304, [(b"content-length", b"0")], b"", id="304 is left to h11"),
    pytest.param(
        200,
        [(b"content-length", b"1"), (b"transfer-encoding", b"chunked")],
        b"x",
        id="Transfer-Encoding is left to h11",
    ),
    pytest.param(
        200,
        [(b"content-length", b"1"), (b"host", b"h")],
        b"x",
        id="a Host header (h11 writes it first) is left to h11",
    ),
]


@pytest.mark.parametrize(("status", "headers", "body"), NOT_FRAMED)
def test_other_replies_are_left_to_h11(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    assert frame_reply(status, headers, body) is None


_HEADER = st.tuples(
    st.sampled_from([b"content-type", b"x-a", b"connection", b"warning"]),
    st.sampled_from([b"v", b"close", b"keep-alive", b"a, close", b"closed", b"w w"]),
)


@settings(max_examples=500, deadline=None)
@given(
    st.integers(200, 599).filter(lambda s: s not in (204, 304)),
    st.lists(_HEADER, max_size=4),
    st.binary(max_size=40),
)
def test_any_framed_reply_is_h11s_bytes(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", b"%d" % len(body))]
    data, kept = h11_reply(status, headers, body)
    assert frame_reply(status, headers, body) == data
    assert closes(headers) == (not kept)


# --- the fast path is the one taken, through a socket --------------------------------------------


async def _exchange(stream: trio.SocketStream, parts: list[bytes]) -> bytes:
    for part in parts:
        await stream.send_all(part)
        await trio.sleep(0.05)
    reply = b""
    with trio.fail_after(5):
        while not reply.endswith(BODY):
            reply += await stream.receive_some(65536)
    return reply


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([APISERVER_HEAD + BODY], id="a plain request and its whole reply never reach h11"),
        pytest.param(
            [APISERVER_HEAD + BODY[:5], BODY[5:]],
            id="a plain request whose body comes in two reads never reaches h11",
        ),
    ],
)
async def test_plain_exchanges_bypass_h11(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, parts: list[bytes]
) -> None:
    fed: list[bytes] = []
    real = h11.Connection.receive_data

    def spy(self: h11.Connection, data: bytes) -> None:
        if self.our_role is h11.SERVER:
            fed.append(data)
        real(self, data)

    monkeypatch.setattr(h11.Connection, "receive_data", spy)
    port, stop = await serve_asgi(nursery, RecordingApp())
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    for _ in range(3):  # and again on the same keep-alive connection
        reply = await _exchange(stream, parts)
        assert reply.startswith(b"HTTP/1.1 200 \r\ncontent-type: text/plain\r\ncontent-length: 25\r\n")
        assert reply.endswith(b"\r\n\r\necho:" + BODY)
    assert fed == []
    await stream.aclose()
    stop.set()
