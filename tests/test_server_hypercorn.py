"""The gateway's server (``gateway.server.hypercorn``) and its seam with the application, over real sockets.

The keep-alive idle timer, the request queue that reports the caller going away (the
``webhook-gateway.disconnect`` scope extension, on every protocol path), and HTTP/1.1 responses whose
head and body are written together must keep hypercorn's observable behaviour. The seam itself:
only verified hypercorn and h11 releases run, h11's private modules are imported in one place, and
nothing finds the server's objects through ``__self__``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import h11
import pytest
import trio

from gateway.server.extensions import disconnect_signal
from tests.support.inbound import H2Client, autojump_over_sockets, serve_asgi

REPO = Path(__file__).resolve().parent.parent

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class App:
    """Answers ``POST /sleep/<ms>`` after sleeping; remembers what each request's queue reported."""

    def __init__(self) -> None:
        self.disconnected: list[bool] = []
        self.cancelled = 0
        self.sleeping = 0  # requests whose body is in and whose sleep began

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
        queue = disconnect_signal(scope)
        assert queue is not None
        ms = int(scope["path"].rsplit("/", 1)[1])
        with trio.CancelScope() as cancel:
            queue.on_disconnect = cancel.cancel
            self.sleeping += 1
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
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:  # not Connection: close
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


@pytest.fixture
def virtual_time() -> trio.testing.MockClock:
    """Time is the point of the keep-alive tests: they run on trio's autojump clock (real sockets)."""
    return autojump_over_sockets()


@pytest.mark.parametrize(("paths", "keep_alive", "wait", "closed"), IDLE_CASES)
async def test_keep_alive_idle_timeout(
    nursery: trio.Nursery,
    virtual_time: trio.testing.MockClock,
    paths: list[str],
    keep_alive: float,
    wait: float,
    closed: bool,
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
    nursery: trio.Nursery, virtual_time: trio.testing.MockClock
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
    # Virtual time: the request's own I/O takes none, so the close comes exactly one period later.
    assert trio.current_time() - last == pytest.approx(0.3)
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


# --- the seam: the disconnect signal on every protocol path ------------------------------------------


def _h11_head(*extra: str) -> bytes:
    return (
        "POST /sleep/5000 HTTP/1.1\r\nhost: t\r\ncontent-length: 1\r\n" + "".join(extra) + "\r\n"
    ).encode()


async def _h11_call_then_close(port: int, head: bytes, app: App) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(head + b"x")
    while not app.sleeping:
        await trio.sleep(0.01)
    await stream.aclose()


async def _h2_call_then_reset(port: int, app: App) -> None:
    client = await H2Client.open(port)
    sid = await client.post(b"x", path="/sleep/5000")
    while not app.sleeping:
        await trio.sleep(0.01)
    client.conn.reset_stream(sid)
    await client.flush()
    while not app.disconnected:  # the connection stays open: only the stream went away
        await trio.sleep(0.01)
    await client.stream.aclose()


SEAM_PATHS = [
    pytest.param(
        lambda port, app: _h11_call_then_close(port, _h11_head(), app),
        id="HTTP/1.1 fast path: a caller closing its connection fires on_disconnect",
    ),
    pytest.param(
        lambda port, app: _h11_call_then_close(port, _h11_head("expect: 100-continue\r\n"), app),
        id="HTTP/1.1 through h11 (GatewayHTTPStream): a caller closing its connection fires on_disconnect",
    ),
    pytest.param(
        _h2_call_then_reset,
        id="HTTP/2: a caller resetting its stream fires on_disconnect for that stream",
    ),
]


@pytest.mark.parametrize("call", SEAM_PATHS)
async def test_every_request_carries_the_disconnect_extension(
    nursery: trio.Nursery, call: Callable[[int, App], Awaitable[None]]
) -> None:
    """The app learns its caller went away from ``scope["extensions"]["webhook-gateway.disconnect"]``
    (gateway.server.extensions), whichever protocol class started the request, without reading."""
    app = App()
    port, stop = await serve_asgi(nursery, app, keep_alive_timeout=30.0)
    with trio.fail_after(5):
        await call(port, app)
        while not app.disconnected:
            await trio.sleep(0.01)
    assert (app.cancelled, app.disconnected) == (1, [True])
    stop.set()


# --- the seam: verified releases only ------------------------------------------------------------------

VERSION_CASES = [
    pytest.param(
        {"hypercorn": "0.17.3"},
        "hypercorn 0.17.3 is not supported (verified: 0.18.0)",
        id="an unverified hypercorn is refused with one line naming the versions",
    ),
    pytest.param(
        {"h11": "0.15.0"},
        "h11 0.15.0 is not supported (verified: 0.16.0)",
        id="an unverified h11 (its private modules are used) is refused with one line naming the versions",
    ),
]


@pytest.mark.parametrize(("versions", "message"), VERSION_CASES)
@pytest.mark.parametrize(
    "workers", ["1", "2"], ids=["one process", "--workers 2 (the supervisor checks first)"]
)
def test_unverified_releases_are_refused_at_start_up(
    tmp_path: Path, versions: dict[str, str], message: str, workers: str
) -> None:
    code = (
        "import importlib.metadata as m; real = m.version; "
        f"fake = {versions!r}; "
        "m.version = lambda name: fake.get(name) or real(name); "
        "from gateway.__main__ import main; "
        f"raise SystemExit(main(['--config', {str(tmp_path)!r}, '--bind', '127.0.0.1:0', '--workers', {workers!r}]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60, check=False
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"webhook-gateway: {message}; install a verified version"]


def _gateway_sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted((REPO / "gateway").rglob("*.py"))]


def test_h11_private_modules_are_imported_in_one_place_only() -> None:
    """h11's private modules are imported by gateway/wire/h11_private.py alone, after its version check."""
    importers = set()
    for path, tree in _gateway_sources():
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(name.startswith("h11._") for name in names):
                importers.add(path.relative_to(REPO).as_posix())
    assert importers == {"gateway/wire/h11_private.py"}


def test_nothing_finds_the_server_through_bound_methods() -> None:
    """No ``__self__`` introspection: what the app and the task group need is passed to them."""
    found = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path, tree in _gateway_sources()
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr == "__self__")
        or (isinstance(node, ast.Constant) and node.value == "__self__")
    ]
    assert found == []
