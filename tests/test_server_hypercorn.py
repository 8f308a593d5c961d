"""hypercorn's trio worker with the gateway's adjustments (server/hypercorn_fixes.py), over real sockets.

The keep-alive idle timer, the request queue that reports the caller going away, and HTTP/1.1
responses whose head and body are written together must keep hypercorn's observable behaviour.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
import pytest
import trio

from gateway.server import hypercorn_fixes
from tests.support.inbound import serve_asgi

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class App:
    """Answers ``POST /sleep/<ms>`` after sleeping; remembers what each request's queue reported."""

    def __init__(self) -> None:
        self.disconnected: list[bool] = []
        self.cancelled = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        queue = getattr(receive, "__self__", None)
        assert isinstance(queue, hypercorn_fixes.RequestQueue)
        ms = int(scope["path"].rsplit("/", 1)[1])
        with trio.CancelScope() as cancel:
            queue.on_disconnect = cancel.cancel
            await trio.sleep(ms / 1000)
        queue.on_disconnect = None
        self.cancelled += cancel.cancelled_caught
        self.disconnected.append(queue.disconnected)
        if scope["path"].startswith("/nobody"):
            await send({"type": "http.response.start", "status": 204, "headers": []})
            return
        reply = b"slept " + body
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(reply)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": reply})


async def _request(stream: trio.SocketStream, conn: h11.Connection, path: str) -> tuple[int, bytes]:
    body = b"x" * 100
    data = conn.send(
        h11.Request(method="POST", target=path, headers=[("host", "t"), ("content-length", "100")])
    )
    await stream.send_all(data + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
    status, reply = 0, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            reply += event.data
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            return status, reply


async def _close_mid_request(stream: trio.SocketStream, conn: h11.Connection) -> None:
    """Send a whole request the app takes 5 s to answer, and close the connection 0.2 s later."""
    data = conn.send(
        h11.Request(method="POST", target="/sleep/5000", headers=[("host", "t"), ("content-length", "1")])
    )
    await stream.send_all(data + conn.send(h11.Data(data=b"x")) + conn.send(h11.EndOfMessage()))
    await trio.sleep(0.2)
    await stream.aclose()


async def _closed_by_server(stream: trio.SocketStream, within: float) -> bool:
    with trio.move_on_after(within):
        return await stream.receive_some(1) == b""
    return False


IDLE_CASES = [
    pytest.param(
        ["/sleep/0"], 0.3, 0.8, True, id="keep-alive: an idle connection is closed after keep_alive_timeout"
    ),
    pytest.param(
        ["/sleep/0"], 5.0, 0.5, False, id="keep-alive: an idle connection stays open before the timeout"
    ),
    pytest.param(
        ["/sleep/600", "/sleep/0"],
        0.3,
        0.8,
        True,
        id="keep-alive: a request longer than the timeout is answered; the connection closes once idle",
    ),
    pytest.param(
        ["/sleep/0", "/sleep/0", "/sleep/0"],
        0.3,
        0.8,
        True,
        id="keep-alive: several requests on one connection, then the idle timeout",
    ),
]


@pytest.mark.parametrize(("paths", "keep_alive", "wait", "closed"), IDLE_CASES)
async def test_keep_alive_idle_timeout(
    nursery: trio.Nursery, paths: list[str], keep_alive: float, wait: float, closed: bool
) -> None:
    """The idle timer closes idle connections only, and never one with a request in flight."""
    app = App()
    port, stop = await serve_asgi(nursery, app, keep_alive_timeout=keep_alive)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    for path in paths:
        assert await _request(stream, conn, path) == (200, b"slept " + b"x" * 100)
    assert await _closed_by_server(stream, wait) is closed
    await stream.aclose()
    stop.set()


async def test_keep_alive_idle_timer_counts_from_the_last_request_not_the_first(
    nursery: trio.Nursery,
) -> None:
    """keep-alive: a connection in steady use outlives many idle periods; it closes one period after its last request."""
    app = App()
    port, stop = await serve_asgi(nursery, app, keep_alive_timeout=0.3)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    for _ in range(8):  # 1.2 s of use, never idle for 0.3 s
        await trio.sleep(0.15)
        assert await _request(stream, conn, "/sleep/0") == (200, b"slept " + b"x" * 100)
    last = trio.current_time()
    assert await _closed_by_server(stream, 1.0)
    assert 0.2 <= trio.current_time() - last <= 0.9
    await stream.aclose()
    stop.set()


async def test_shutdown_closes_idle_connections(nursery: trio.Nursery) -> None:
    """A terminating server closes an idle keep-alive connection at once, not after the timeout."""
    app = App()
    port, stop = await serve_asgi(nursery, app, keep_alive_timeout=60.0)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    assert (await _request(stream, conn, "/sleep/0"))[0] == 200
    stop.set()
    assert await _closed_by_server(stream, 3.0)
    await stream.aclose()


async def test_caller_going_away_is_reported_to_the_queue(nursery: trio.Nursery) -> None:
    """A caller that disconnects mid-request triggers ``on_disconnect`` without the app reading."""
    app = App()
    port, stop = await serve_asgi(nursery, app, keep_alive_timeout=5.0)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await _close_mid_request(stream, h11.Connection(h11.CLIENT))
    with trio.fail_after(2):
        while not app.disconnected:
            await trio.sleep(0.02)
    assert app.cancelled == 1
    assert app.disconnected == [True]
    stop.set()


async def test_head_without_body_is_still_sent(nursery: trio.Nursery) -> None:
    """An app that sends a response head and no body still gets its head written (204)."""
    app = App()
    port, stop = await serve_asgi(nursery, app, keep_alive_timeout=5.0)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    assert await _request(stream, conn, "/nobody/0") == (204, b"")
    await stream.aclose()
    stop.set()


async def test_shutdown_waits_for_the_request_in_flight(nursery: trio.Nursery) -> None:
    """A server that starts terminating during a request answers it, then closes the connection."""
    app = App()
    port, stop = await serve_asgi(nursery, app, keep_alive_timeout=60.0)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    async with trio.open_nursery() as inner:

        async def terminate_soon() -> None:
            await trio.sleep(0.2)
            stop.set()

        inner.start_soon(terminate_soon)
        assert await _request(stream, conn, "/sleep/600") == (200, b"slept " + b"x" * 100)
    assert await _closed_by_server(stream, 3.0)
    await stream.aclose()


class _TaskStarts(trio.abc.Instrument):
    """Counts the tasks trio starts."""

    def __init__(self) -> None:
        self.started = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.started += 1


async def test_keep_alive_requests_start_no_task_each(nursery: trio.Nursery) -> None:
    """speed: on an otherwise idle gateway a plain request's app runs in the task that read it; reading moves to one spare task, reused for every later request, and a caller going away is still noticed."""
    app = App()
    port, stop = await serve_asgi(nursery, app, keep_alive_timeout=5.0)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    assert await _request(stream, conn, "/sleep/0") == (200, b"slept " + b"x" * 100)  # the spare starts

    # Two requests at once on two more connections: the second finds the first in flight and gets a
    # task of its own; once both are answered the gateway counts as idle again.
    async def one_more() -> None:
        other = await trio.open_tcp_stream("127.0.0.1", port)
        assert await _request(other, h11.Connection(h11.CLIENT), "/sleep/50") == (200, b"slept " + b"x" * 100)
        await other.aclose()

    async with trio.open_nursery() as pair:
        pair.start_soon(one_more)
        pair.start_soon(one_more)
    starts = _TaskStarts()
    trio.lowlevel.add_instrument(starts)
    try:
        for _ in range(20):
            await trio.sleep(0.005)  # one request at a time, not back to back (a busy gateway batches)
            assert await _request(stream, conn, "/sleep/1") == (200, b"slept " + b"x" * 100)
    finally:
        trio.lowlevel.remove_instrument(starts)
    assert starts.started == 0
    # The spare reads while the app runs: closing mid-request still cancels the request.
    await _close_mid_request(stream, conn)
    with trio.fail_after(2):
        while len(app.disconnected) < 24:  # 1 + 2 + 20 answered, and the one cancelled
            await trio.sleep(0.02)
    assert app.cancelled == 1
    stop.set()
