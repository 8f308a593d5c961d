"""The client pool over HTTP/1.1 against real backends on 127.0.0.1 (TRN-05/12, FPT-05/06/10/11, ERR-06)."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from gateway.config.model import ClientConfig
from gateway.errors import ResponseTooLarge, TransportError, TransportTimeout
from gateway.transport import ClientPool, Target, resolve_target
from tests.support.httpservers import BackendServer


def target(url: str) -> Target:
    return resolve_target(ClientConfig(url=url), None)


async def start(nursery: trio.Nursery, **options: object) -> BackendServer:
    server: BackendServer = await nursery.start(BackendServer(**options).serve)  # type: ignore[arg-type]
    return server


async def test_request_line_and_headers(nursery: trio.Nursery) -> None:
    """TRN-05/FPT-06: a POST of the body to path?timeout=, with JSON, user-agent, host and extra headers."""
    server = await start(nursery)
    async with ClientPool() as pool:
        response = await pool.post(
            target(server.url("/hooks/validate/")),
            body=b'{"kind":"AdmissionReview"}',
            headers=[(b"X-Trace", b"abc")],
            timeout_seconds=9.5,
        )
    assert (response.status, response.body, response.http_version) == (200, b"{}", "HTTP/1.1")
    assert response.header(b"content-type") == b"application/json"
    [seen] = server.requests
    assert (seen.method, seen.target, seen.body) == (
        "POST",
        "/hooks/validate?timeout=10s",
        b'{"kind":"AdmissionReview"}',
    )
    assert seen.headers == {
        "host": f"127.0.0.1:{server.port}",
        "content-type": "application/json",
        "accept": "application/json, */*",
        "user-agent": "webhook-gateway/0.1.0",
        "content-length": "26",
        "x-trace": "abc",
    }


async def test_keep_alive_reuses_one_connection(nursery: trio.Nursery) -> None:
    """TRN-08: sequential calls to one origin share one kept-alive connection."""
    server = await start(nursery)
    async with ClientPool() as pool:
        for _ in range(3):
            await pool.post(target(server.url("/a")), body=b"{}", timeout_seconds=5)
        assert server.connections == 1
        assert repr(pool) == (
            f"<ClientPool origins=1 connections=[<HTTP11Connection 127.0.0.1:{server.port} IDLE requests=3>]>"
        )
        assert {str(origin): n for origin, n in pool.open_connections().items()} == {
            f"http://127.0.0.1:{server.port}": 1
        }


async def test_connection_close_is_honoured(nursery: trio.Nursery) -> None:
    """A reply with Connection: close retires its connection; the next call opens a new one."""
    server = await start(nursery)
    async with ClientPool() as pool:
        for _ in range(2):
            response = await pool.post(target(server.url("/connection-close")), body=b"{}", timeout_seconds=5)
            assert response.status == 200
        assert server.connections == 2
        assert repr(pool) == "<ClientPool origins=1 connections=[]>"


async def test_connection_count_per_origin_is_bounded(nursery: trio.Nursery) -> None:
    """With a bound of 2, five concurrent calls use two connections; the others wait for a free one."""
    server = await start(nursery)
    results: list[int] = []
    async with ClientPool(max_connections_per_origin=2) as pool:

        async def call() -> None:
            response = await pool.post(target(server.url("/gate")), body=b"{}", timeout_seconds=5)
            results.append(response.status)

        async with trio.open_nursery() as calls:
            for _ in range(5):
                calls.start_soon(call)
            await server.wait_until(lambda: len(server.requests) == 2)
            await trio.testing.wait_all_tasks_blocked()
            assert (server.connections, len(server.requests)) == (2, 2)
            server.gate.set()
        assert results == [200] * 5
        assert server.connections == 2
        assert {r.connection for r in server.requests} == {0, 1}
        assert len(server.requests) == 5


async def test_idle_connections_are_retired(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    """A connection idle past the idle timeout is closed by the pool; the next call dials again."""
    server = await start(nursery)
    async with ClientPool(idle_timeout_seconds=10) as pool:
        await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=5)
        mock_clock.jump(9)
        await trio.testing.wait_all_tasks_blocked()
        assert server.closed_connections == 0
        mock_clock.jump(6)
        await server.wait_until(lambda: server.closed_connections == 1)
        assert repr(pool) == "<ClientPool origins=0 connections=[]>"
        await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=5)
        assert server.connections == 2


async def test_peer_closed_idle_connection(nursery: trio.Nursery) -> None:
    """A connection the peer closed while idle is seen before writing: the call goes on a fresh one."""
    server = await start(nursery)
    async with ClientPool() as pool:
        await pool.post(target(server.url("/close-after")), body=b"{}", timeout_seconds=5)
        await server.wait_until(lambda: server.closed_connections == 1)
        response = await pool.post(target(server.url("/second")), body=b"{}", timeout_seconds=5)
    assert response.status == 200
    assert [(r.connection, r.path) for r in server.requests] == [(0, "/close-after"), (1, "/second")]


@pytest.mark.parametrize(
    ("first", "cause"),
    [
        # Closing with the rest of the request unread may reach us as a reset instead of an EOF.
        pytest.param(
            "/close-on-next", ("EOF", "read tcp"), id="FPT-10: EOF after the request was written: not resent"
        ),
        pytest.param(
            "/reset-on-next", ("read tcp",), id="FPT-10: a reset after the request was written: not resent"
        ),
    ],
)
async def test_written_request_is_never_resent(
    nursery: trio.Nursery, first: str, cause: tuple[str, ...]
) -> None:
    """A reused connection that breaks once the request is on the wire: one failed call (FPT-10).

    The backend may have read and processed the request, so it is not sent again.
    """
    server = await start(nursery)
    async with ClientPool() as pool:
        await pool.post(target(server.url(first)), body=b"{}", timeout_seconds=5)
        with pytest.raises(TransportError) as info:
            await pool.post(target(server.url("/second")), body=b"{}", timeout_seconds=5)
        assert info.value.cause.startswith(cause), info.value.cause
        response = await pool.post(target(server.url("/third")), body=b"{}", timeout_seconds=5)
    assert response.status == 200
    assert [(r.connection, r.path) for r in server.requests] == [(0, first), (1, "/third")]


@pytest.mark.parametrize(
    ("path", "cause"),
    [
        pytest.param("/close-mid", "unexpected EOF", id="ERR-06: the peer closes mid-body"),
        pytest.param("/close-now", "EOF", id="ERR-06: the peer closes a fresh connection without a reply"),
    ],
)
async def test_peer_closes_during_call(nursery: trio.Nursery, path: str, cause: str) -> None:
    """A connection that breaks during a call is a transport error and is never resent (FPT-10)."""
    server = await start(nursery)
    async with ClientPool() as pool:
        with pytest.raises(TransportError) as info:
            await pool.post(target(server.url(path)), body=b"{}", timeout_seconds=5)
        assert repr(pool) == "<ClientPool origins=1 connections=[]>"
    assert info.value.cause == cause
    assert len(server.requests) == 1


async def _silent_listener(nursery: trio.Nursery) -> int:
    """A TCP listener that accepts connections and never sends a byte; returns its port."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def hold(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    nursery.start_soon(trio.serve_listeners, hold, listeners)
    return int(listeners[0].socket.getsockname()[1])


@pytest.mark.parametrize(
    "phase",
    [
        pytest.param("/hang", id="FPT-05: waiting for the reply headers is bounded"),
        pytest.param("/stall-body", id="FPT-05: reading the reply body is bounded"),
        pytest.param("tls-handshake", id="FPT-05: a TLS handshake that never completes is bounded"),
    ],
)
async def test_timeout_bounds_the_whole_call(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, phase: str
) -> None:
    """The call ends exactly at its deadline with `context deadline exceeded`; its connection is closed."""
    if phase == "tls-handshake":
        port = await _silent_listener(nursery)
        call_target = target(f"https://127.0.0.1:{port}/")
    else:
        server = await start(nursery)
        call_target = target(server.url(phase))
    async with ClientPool() as pool:
        started = trio.current_time()
        with pytest.raises(TransportTimeout) as info:
            await pool.post(call_target, body=b"{}", timeout_seconds=7)
        assert trio.current_time() - started == 7
        assert info.value.cause == "context deadline exceeded"
        assert repr(pool) == "<ClientPool origins=1 connections=[]>"


async def test_no_time_left_means_no_call(nursery: trio.Nursery) -> None:
    """FPT-06: with nothing left the backend is not called at all."""
    server = await start(nursery)
    async with ClientPool() as pool:
        with pytest.raises(TransportTimeout):
            await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=0)
    assert server.connections == 0


async def test_cancelled_call_closes_its_connection(nursery: trio.Nursery) -> None:
    """When the caller goes away mid-call the connection is closed, never reused."""
    server = await start(nursery)
    async with ClientPool() as pool:
        with trio.CancelScope() as scope:
            nursery.start_soon(_cancel_when, server, scope)
            await pool.post(target(server.url("/hang")), body=b"{}", timeout_seconds=30)
        assert scope.cancelled_caught
        assert repr(pool) == "<ClientPool origins=1 connections=[]>"
        await server.wait_until(lambda: server.closed_connections == 1)


async def _cancel_when(server: BackendServer, scope: trio.CancelScope) -> None:
    await server.wait_until(lambda: len(server.requests) == 1)
    scope.cancel()


@pytest.mark.parametrize(
    ("path", "outcome"),
    [
        pytest.param("/big/1000", 200, id="TRN-12: a body of exactly the limit is read"),
        pytest.param("/big/1001", "too large", id="TRN-12: a Content-Length past the limit fails at once"),
        pytest.param("/chunked/5000", "too large", id="TRN-12: a chunked body is cut off past the limit"),
    ],
)
async def test_response_size_limit(nursery: trio.Nursery, path: str, outcome: object) -> None:
    """Replies larger than max_response_bytes are a call error; the connection is not reused."""
    server = await start(nursery)
    async with ClientPool(max_response_bytes=1000) as pool:
        if outcome == 200:
            response = await pool.post(target(server.url(path)), body=b"{}", timeout_seconds=5)
            assert (response.status, len(response.body)) == (200, 1000)
        else:
            with pytest.raises(ResponseTooLarge) as info:
                await pool.post(target(server.url(path)), body=b"{}", timeout_seconds=5)
            assert info.value.cause == "response body exceeds 1000 bytes"
            assert repr(pool) == "<ClientPool origins=1 connections=[]>"


@pytest.mark.parametrize(
    "status",
    [
        pytest.param(302, id="FPT-11: a 302 is returned, not followed"),
        pytest.param(307, id="FPT-11: a 307 is returned, not followed"),
        pytest.param(500, id="REV-09: a 500 is returned as a value"),
    ],
)
async def test_statuses_are_returned_not_followed(nursery: trio.Nursery, status: int) -> None:
    """Any final status comes back to the caller; redirects are never followed."""
    server = await start(nursery)
    async with ClientPool() as pool:
        response = await pool.post(target(server.url(f"/status/{status}")), body=b"{}", timeout_seconds=5)
    assert response.status == status
    assert [r.path for r in server.requests] == [f"/status/{status}"]


async def test_connection_refused() -> None:
    """ERR-06: a closed port fails with Go's `connect: connection refused` text."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with ClientPool() as pool:
        with pytest.raises(TransportError) as info:
            await pool.post(target(f"http://127.0.0.1:{port}/"), body=b"{}", timeout_seconds=5)
    assert info.value.cause == f"dial tcp 127.0.0.1:{port}: connect: connection refused"


async def test_unknown_host() -> None:
    """ERR-06: a name that does not resolve fails with `no such host`."""
    async with ClientPool() as pool:
        with pytest.raises(TransportError) as info:
            await pool.post(target("https://x.invalid/hook"), body=b"{}", timeout_seconds=5)
    assert info.value.cause == "dial tcp: lookup x.invalid: no such host"


async def test_pool_exit_closes_connections(nursery: trio.Nursery) -> None:
    """Leaving the pool closes every connection it holds."""
    server = await start(nursery)
    async with ClientPool() as pool:
        await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=5)
    await server.wait_until(lambda: server.closed_connections == 1)
    with pytest.raises(TransportError, match="client pool is closed"):
        await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=5)
