"""HTTP/1.1 through hypercorn with the gateway's per-request cuts (``GatewayH11Protocol``,
``GatewayHTTPStream``), over real sockets: what a caller sees and what the app is given must be what
stock hypercorn gives, request shape by request shape; only how the same bytes are grouped changes.
"""

from __future__ import annotations

from typing import Any

import h11
import pytest
import trio
from hypercorn.config import Config

from gateway.server.extensions import DISCONNECT, disconnect_signal
from tests.support.inbound import RecordingApp, serve_asgi

BODY = b'{"kind":"AdmissionReview"}' * 40


Reply = tuple[int, dict[bytes, bytes], bytes]
Request = tuple[str, str, bytes, tuple[tuple[str, str], ...]]


def _encode(request: Request) -> bytes:
    method, path, body, extra = request
    conn = h11.Connection(h11.CLIENT)
    head = [("host", "gw"), *extra]
    if body or method == "POST":
        head.append(("content-length", str(len(body))))
    data = conn.send(h11.Request(method=method, target=path, headers=head))
    return data + (conn.send(h11.Data(data=body)) if body else b"") + conn.send(h11.EndOfMessage())


async def _read_replies(stream: trio.SocketStream, requests: list[Request]) -> list[Reply]:
    """One reply per request, read off the connection in order (each with its own h11 client)."""
    replies: list[Reply] = []
    leftover = b""
    with trio.fail_after(5):
        for method, path, _, _ in requests:
            conn = h11.Connection(h11.CLIENT)
            conn.send(
                h11.Request(method=method, target=path, headers=[("host", "gw"), ("content-length", "0")])
            )
            conn.send(h11.EndOfMessage())
            if leftover:  # (b"" would tell h11 the peer closed)
                conn.receive_data(leftover)
            status, headers, body = 0, {}, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status, headers = event.status_code, dict(event.headers)
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            leftover = conn.trailing_data[0]
            replies.append((status, headers, body))
    return replies


def _post(path: str, body: bytes, *extra: tuple[str, str]) -> Request:
    return ("POST", path, body, extra)


WHOLE = _post("/whole", BODY)

# (requests, how their bytes are cut into writes (offsets from the end; each part then a pause),
#  expected (status, body) replies, the (body, more_body) messages the app was given for the first)
CASES = [
    pytest.param(
        [WHOLE],
        [],
        [(200, b"echo:" + BODY)],
        [(BODY, False)],
        id="a body that arrives whole reaches the app as one message and the reply is the app's",
    ),
    pytest.param(
        [WHOLE],
        [300],
        [(200, b"echo:" + BODY)],
        [(BODY[:-300], True), (BODY[-300:], False)],
        id="a body that arrives in two parts reaches the app as two messages, the last one final",
    ),
    pytest.param(
        [_post("/whole", b"")],
        [],
        [(200, b"echo:")],
        [(b"", False)],
        id="an empty body is one final empty message",
    ),
    pytest.param(
        [_post("/stream", BODY)],
        [],
        [(200, b"echo:" + BODY)],
        [(BODY, False)],
        id="a reply the app streams in two parts arrives whole",
    ),
    pytest.param(
        [_post("/nobody", BODY)],
        [],
        [(204, b"")],
        [(BODY, False)],
        id="a head without a body is sent when the app ends",
    ),
    pytest.param(
        [_post("/early", BODY)],
        [],
        [(500, b"")],
        [(BODY, False)],
        id="an app that ends without answering gets hypercorn's 500",
    ),
    pytest.param(
        [("HEAD", "/whole", b"", ())],
        [],
        [(200, b"")],
        [(b"", False)],
        id="a HEAD request gets the head with the body's length and no body",
    ),
    pytest.param(
        [_post("/whole", b"one"), _post("/whole", b"two")],
        [],
        [(200, b"echo:one"), (200, b"echo:two")],
        [(b"one", False)],
        id="two pipelined requests in one write are answered in order",
    ),
    pytest.param(
        [WHOLE, _post("/whole", b"two")],
        [len(_encode(_post("/whole", b"two"))) + 300],
        [(200, b"echo:" + BODY), (200, b"echo:two")],
        [(BODY[:-300], True), (BODY[-300:], False)],
        id="the end of a body and the next request in one write are answered in order",
    ),
    pytest.param(
        [_post("/stream", BODY[:5]), _post("/whole", BODY)],
        [len(_encode(_post("/whole", BODY)))],
        [(200, b"echo:" + BODY[:5]), (200, b"echo:" + BODY)],
        [(BODY[:5], False)],
        id="after a reply the app streamed, the next request on the connection is answered",
    ),
    pytest.param(
        [_post("/whole", BODY, ("expect", "100-continue"))],
        [],
        [(200, b"echo:" + BODY)],
        [(BODY, False)],
        id="a request that expects 100-continue is answered",
    ),
    pytest.param(
        [_post("/whole", BODY, ("upgrade", "something"))],
        [],
        [(200, b"echo:" + BODY)],
        [(BODY, False)],
        id="a request with an Upgrade header is answered in HTTP/1.1 (Upgrade is ignored)",
    ),
]


@pytest.mark.parametrize(("requests", "cuts", "replies", "received"), CASES)
async def test_http11_request_shapes(
    nursery: trio.Nursery,
    requests: list[Request],
    cuts: list[int],
    replies: list[tuple[int, bytes]],
    received: list[tuple[bytes, bool]],
) -> None:
    app = RecordingApp()
    port, stop = await serve_asgi(nursery, app)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    data = b"".join(_encode(r) for r in requests)
    parts = [data[: len(data) - cut] for cut in cuts[:1]] + [data[len(data) - cut :] for cut in cuts[:1]] or [
        data
    ]
    for part in parts:
        await stream.send_all(part)
        await trio.sleep(0.1 if len(parts) > 1 else 0)
    got = await _read_replies(stream, requests)
    assert [(status, body) for status, _, body in got] == replies
    for (status, headers, _), (_, _, body, _) in zip(got, requests, strict=True):
        assert headers[b"server"] == b"hypercorn-h11"
        assert b"date" in headers
        if status == 200:
            assert headers[b"content-type"] == b"text/plain"
            assert int(headers[b"content-length"]) == len(b"echo:" + body)
    assert [(m.get("body", b""), m.get("more_body", False)) for m in app.messages[0]] == received
    # The seam (gateway.server.extensions): every request's scope carries its disconnect signal,
    # whichever class started it (the fast path, GatewayHTTPStream, or hypercorn's own stream).
    assert all(disconnect_signal(scope) is not None for scope in app.scopes)
    await stream.aclose()
    stop.set()


async def test_the_scope_is_the_one_hypercorn_builds(nursery: trio.Nursery) -> None:
    """Every key and value of hypercorn's HTTP/1.1 scope, for a path with a query and an escape."""
    app = RecordingApp()
    port, stop = await serve_asgi(nursery, app)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(_encode(_post("/wh%6Fle?timeout=10s&x=1", b"{}", ("x-trace", "A b"))))
    await _read_replies(stream, [WHOLE])
    scope = dict(app.scopes[0])
    client, server = scope.pop("client"), scope.pop("server")
    # The gateway's one addition (gateway.server.extensions): the caller's disconnect signal.
    assert scope["extensions"].pop(DISCONNECT) is not None
    assert app.disconnected == [False]  # while the request was served (the signal turns true at its end)
    assert client == stream.socket.getsockname()[:2]
    assert server == ("127.0.0.1", port)
    assert scope == {
        "type": "http",
        "http_version": "1.1",
        "asgi": {"spec_version": "2.1", "version": "3.0"},
        "method": "POST",
        "scheme": "http",
        "path": "/whole",
        "raw_path": b"/wh%6Fle",
        "query_string": b"timeout=10s&x=1",
        "root_path": "",
        "headers": [(b"host", b"gw"), (b"x-trace", b"A b"), (b"content-length", b"2")],
        "state": {},
        "extensions": {},
    }
    await stream.aclose()
    stop.set()


async def test_an_unknown_host_gets_404_when_server_names_are_set(nursery: trio.Nursery) -> None:
    app = RecordingApp()
    port, stop = await serve_asgi(nursery, app, server_names=["gateway.example"])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(_encode(WHOLE))
    [(status, _, _)] = await _read_replies(stream, [WHOLE])
    assert status == 404
    assert app.scopes == []  # the app never ran
    await stream.aclose()
    stop.set()


@pytest.mark.parametrize(
    ("settings", "extra", "closes_after"),
    [
        pytest.param(
            {"keep_alive_max_requests": 2},
            (),
            2,
            id="the last request a connection may carry is answered, then it closes",
        ),
        pytest.param(
            {},
            (("connection", "close"),),
            1,
            id="a request with Connection close is answered, then the connection closes",
        ),
    ],
)
async def test_connection_close_ends_the_connection_after_the_reply(
    nursery: trio.Nursery, settings: dict[str, Any], extra: tuple[tuple[str, str], ...], closes_after: int
) -> None:
    port, stop = await serve_asgi(nursery, RecordingApp(), **settings)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    request = _post("/whole", b"x", *extra)
    for n in range(1, closes_after + 1):
        await stream.send_all(_encode(request))
        [(status, headers, body)] = await _read_replies(stream, [request])
        assert (status, body) == (200, b"echo:x")
        assert (headers.get(b"connection") == b"close") == (n == closes_after)
    with trio.fail_after(5):
        assert await stream.receive_some(100) == b""  # the server closed it
    await stream.aclose()
    stop.set()


async def test_a_whole_response_is_one_write(nursery: trio.Nursery) -> None:
    """Head, body and end of a response the app sends whole go to the socket in one write (the
    protocol's writes are recorded: TCP may merge or split segments, so sockets cannot show it)."""
    from hypercorn.app_wrappers import ASGIWrapper
    from hypercorn.events import RawData
    from hypercorn.trio.worker_context import WorkerContext

    from gateway.server.hypercorn.http11 import GatewayH11Protocol
    from gateway.server.hypercorn.task_group import GatewayTaskGroup

    writes: list[bytes] = []

    async def record(event: object) -> None:
        if isinstance(event, RawData):
            writes.append(bytes(event.data))

    group = GatewayTaskGroup(None)
    group._nursery = nursery
    config = Config()
    protocol = GatewayH11Protocol(
        ASGIWrapper(RecordingApp()), config, WorkerContext(None), group, {}, False, None, None, record
    )
    await protocol.handle(RawData(data=_encode(WHOLE)))
    with trio.fail_after(5):
        while not writes:
            await trio.sleep(0.01)
    assert len(writes) == 1
    assert writes[0].startswith(b"HTTP/1.1 200 ")
    assert writes[0].endswith(b"echo:" + BODY)
