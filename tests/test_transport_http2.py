"""The client pool over HTTP/2 against real backends on 127.0.0.1: multiplexing, flow control, GOAWAY."""

from __future__ import annotations

import dataclasses

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
import trio
import trio.testing
import trustme

from gateway.config.model import ClientConfig, ServiceReference
from gateway.errors import ResponseTooLarge, TransportError, TransportTimeout
from gateway.transport import ClientPool, Target, resolve_target
from tests.support.httpservers import BackendServer, server_context

CANCEL = 0x8  # h2 ErrorCodes.CANCEL


def target(url: str, ca_bundle: bytes = b"") -> Target:
    return resolve_target(ClientConfig(url=url, ca_bundle=ca_bundle), None)


async def start(nursery: trio.Nursery, **options: object) -> BackendServer:
    server: BackendServer = await nursery.start(BackendServer(h2c=True, **options).serve)  # type: ignore[arg-type]
    return server


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


async def _gated_calls(pool: ClientPool, server: BackendServer, count: int) -> list[int]:
    """Start ``count`` concurrent calls to /gate, wait until the server holds ``seen`` of them."""
    statuses: list[int] = []

    async def call() -> None:
        response = await pool.post(target(server.url("/gate")), body=b"{}", timeout_seconds=5)
        statuses.append(response.status)

    async with trio.open_nursery() as calls:
        for _ in range(count):
            calls.start_soon(call)
        await trio.testing.wait_all_tasks_blocked()
        server.gate.set()
    return statuses


async def test_streams_wait_for_the_peer_limit(nursery: trio.Nursery) -> None:
    """MAX_CONCURRENT_STREAMS=2 and one connection allowed: ten calls run two at a time on it."""
    server = await start(nursery, max_concurrent_streams=2)
    async with ClientPool(max_connections_per_origin=1, h2c_prior_knowledge=True) as pool:
        statuses: list[int] = []

        async def call() -> None:
            response = await pool.post(target(server.url("/gate")), body=b"{}", timeout_seconds=5)
            statuses.append(response.status)

        async with trio.open_nursery() as calls:
            for _ in range(10):
                calls.start_soon(call)
            await server.wait_until(lambda: len(server.requests) == 2)
            await trio.testing.wait_all_tasks_blocked()
            assert len(server.requests) == 2
            assert repr(pool) == (
                "<ClientPool origins=1 connections="
                f"[<HTTP2Connection 127.0.0.1:{server.port} ACTIVE streams=2 requests=2>]>"
            )
            server.gate.set()
        assert statuses == [200] * 10
        assert (server.connections, server.peak_streams) == (1, 2)
        assert repr(pool) == (
            "<ClientPool origins=1 connections="
            f"[<HTTP2Connection 127.0.0.1:{server.port} IDLE streams=0 requests=10>]>"
        )


async def test_saturated_connections_make_room_with_new_ones(nursery: trio.Nursery) -> None:
    """With MAX_CONCURRENT_STREAMS=2 and no tight bound, ten concurrent calls spread over five connections."""
    server = await start(nursery, max_concurrent_streams=2)
    async with ClientPool(h2c_prior_knowledge=True) as pool:
        statuses: list[int] = []

        async def call() -> None:
            response = await pool.post(target(server.url("/gate")), body=b"{}", timeout_seconds=5)
            statuses.append(response.status)

        async with trio.open_nursery() as calls:
            for _ in range(10):
                calls.start_soon(call)
            await server.wait_until(lambda: len(server.requests) == 10)
            server.gate.set()
        assert statuses == [200] * 10
        assert (server.connections, server.peak_streams) == (5, 2)
        assert sum(pool.open_connections().values()) == 5


async def test_goaway_resends_unprocessed_streams(nursery: trio.Nursery) -> None:
    """GOAWAY: streams above last_stream_id were not processed and go to a new connection; no new streams."""
    server = await start(nursery, goaway_after_streams=3)
    async with ClientPool(h2c_prior_knowledge=True) as pool:
        statuses: list[int] = []

        async def call() -> None:
            response = await pool.post(target(server.url("/x")), body=b"{}", timeout_seconds=5)
            statuses.append(response.status)

        async with trio.open_nursery() as calls:
            for _ in range(3):
                calls.start_soon(call)
    assert statuses == [200] * 3
    assert [(r.connection, r.stream_id) for r in server.requests] == [(0, 1), (0, 3), (0, 5), (1, 1), (1, 3)]


async def _cancel_when_seen(server: BackendServer, scope: trio.CancelScope) -> None:
    await server.wait_until(lambda: len(server.requests) == 1)
    scope.cancel()


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("timeout", id="FPT-05: a call whose deadline passes resets its stream with CANCEL"),
        pytest.param("caller gone", id="a call whose caller goes away resets its stream with CANCEL"),
    ],
)
async def test_cancelled_stream_is_reset(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """The server observes RST_STREAM(CANCEL); the connection stays and serves the next call."""
    server = await start(nursery)
    async with ClientPool(h2c_prior_knowledge=True) as pool:
        if how == "timeout":
            with pytest.raises(TransportTimeout):
                await pool.post(target(server.url("/hang")), body=b"{}", timeout_seconds=3)
        else:
            with trio.CancelScope() as scope:
                nursery.start_soon(_cancel_when_seen, server, scope)
                await pool.post(target(server.url("/hang")), body=b"{}", timeout_seconds=30)
            assert scope.cancelled_caught
        await server.wait_until(lambda: bool(server.resets))
        assert server.resets == [(1, CANCEL)]
        response = await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=3)
    assert (response.status, server.connections) == (200, 1)


async def test_flow_control_large_bodies(nursery: trio.Nursery) -> None:
    """Bodies larger than the initial windows flow both ways (send windows, acknowledged data)."""
    server = await start(nursery)
    body = b"y" * (1024 * 1024 + 17)
    async with ClientPool(h2c_prior_knowledge=True) as pool:
        response = await pool.post(target(server.url("/big/5000000")), body=body, timeout_seconds=30)
    assert (response.status, len(response.body), response.http_version) == (200, 5_000_000, "HTTP/2")
    assert server.requests[0].body == body


class _Wakeups(trio.abc.Instrument):
    """Counts how often each task named ``name`` is scheduled to run."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.name):
            self.count += 1


@pytest.mark.parametrize(
    "cancel_one",
    [
        pytest.param(
            False,
            id="calls waiting for the send window are woken once each, in turn, not all at every window update",
        ),
        pytest.param(
            True,
            id="a call cancelled while it waits for the send window is reset and the others still get their turn",
        ),
    ],
)
async def test_send_window_waiters_take_turns(nursery: trio.Nursery, cancel_one: bool) -> None:
    """40 calls with 32 KiB bodies on one connection whose window takes two: each waits its turn.

    Waking every waiter at every WINDOW_UPDATE (all but one park again) cost the gateway's loop a
    quarter of its CPU when a busy backend's window ran out under a burst: waiters x updates."""
    server = await start(nursery, hold_window=True)
    calls = 40
    wakeups = _Wakeups("window_call")
    trio.lowlevel.add_instrument(wakeups)
    statuses: list[int] = []
    try:
        async with ClientPool(max_connections_per_origin=1, h2c_prior_knowledge=True) as pool:

            async def window_call(index: int) -> None:
                body = b"%03d" % index + b"z" * (32 * 1024)
                response = await pool.post(target(server.url("/")), body=body, timeout_seconds=10)
                statuses.append(response.status)

            async with trio.open_nursery() as group:
                for index in range(calls):
                    group.start_soon(window_call, index)
                if cancel_one:
                    doomed = trio.CancelScope()

                    async def waiting_then_cancelled() -> None:
                        with doomed:
                            await pool.post(target(server.url("/")), body=b"c" * 65536, timeout_seconds=10)

                    group.start_soon(waiting_then_cancelled)
                    await trio.testing.wait_all_tasks_blocked()
                    doomed.cancel()
                await trio.testing.wait_all_tasks_blocked()
                server.gate.set()  # the backend acknowledges what it received: the window opens
    finally:
        trio.lowlevel.remove_instrument(wakeups)
    assert statuses == [200] * calls
    assert sorted(r.body[:3] for r in server.requests if not r.body.startswith(b"c")) == [
        b"%03d" % i for i in range(calls)
    ]
    assert not any(r.body.startswith(b"c") for r in server.requests)
    assert len(server.resets) == int(cancel_one)
    # A call that never waits for window is scheduled ~3 times (start, its stream, its reply); its
    # turn at the window adds one. Woken at every update to look for itself, it was ~25 (and grew
    # with the number waiting).
    assert wakeups.count <= 5 * calls, wakeups.count


async def test_calls_given_up_while_the_send_window_stays_shut_are_not_kept(nursery: trio.Nursery) -> None:
    """A backend that never opens its window: three waves of 20 calls wait for it and are given up
    (their deadline; each body is larger than the whole window). What the connection holds for its waiters stays bounded by the calls still
    waiting, not by every call ever given up (bound everything: a stuck backend is long-lived)."""
    server = await start(nursery, hold_window=True)  # its gate is never set: no WINDOW_UPDATE
    async with ClientPool(max_connections_per_origin=1, h2c_prior_knowledge=True) as pool:
        for _ in range(3):
            async with trio.open_nursery() as wave:
                for _ in range(20):
                    wave.start_soon(_given_up, pool, server)
            assert "waiting=" not in repr(pool), repr(pool)
        assert len(server.resets) >= 40  # each given-up call reset its stream


async def _given_up(pool: ClientPool, server: BackendServer) -> None:
    with pytest.raises(TransportTimeout):
        await pool.post(target(server.url("/")), body=b"w" * 70_000, timeout_seconds=0.2)


async def test_oversize_reply_resets_only_its_stream(nursery: trio.Nursery) -> None:
    """TRN-12: past max_response_bytes the stream is reset; the connection keeps serving."""
    server = await start(nursery)
    async with ClientPool(h2c_prior_knowledge=True, max_response_bytes=1000) as pool:
        with pytest.raises(ResponseTooLarge):
            await pool.post(target(server.url("/big/100000")), body=b"{}", timeout_seconds=5)
        await server.wait_until(lambda: bool(server.resets))
        response = await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=5)
    assert (response.status, server.connections, server.resets) == (200, 1, [(1, CANCEL)])


async def test_connection_failure_fails_every_stream(nursery: trio.Nursery) -> None:
    """A broken connection fails all its calls in flight, none of them resent (FPT-10)."""
    server = await start(nursery)
    causes: dict[str, str] = {}
    async with ClientPool(h2c_prior_knowledge=True) as pool:

        async def call(path: str) -> None:
            with pytest.raises(TransportError) as info:
                await pool.post(target(server.url(path)), body=b"{}", timeout_seconds=5)
            causes[path] = info.value.cause

        async with trio.open_nursery() as calls:
            calls.start_soon(call, "/hang")
            await server.wait_until(lambda: len(server.requests) == 1)
            calls.start_soon(call, "/close-now")
        assert repr(pool) == "<ClientPool origins=1 connections=[]>"
    assert causes == {"/hang": "unexpected EOF", "/close-now": "unexpected EOF"}
    assert len(server.requests) == 2


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        pytest.param(True, "HTTP/1.1", id="TRN-08: a service name is offered only http/1.1"),
        pytest.param(False, "HTTP/2", id="TRN-08: a loopback url negotiates h2 by ALPN"),
    ],
)
async def test_alpn_offers_h2_only_to_loopback(
    nursery: trio.Nursery, ca: trustme.CA, service: bool, expected: str
) -> None:
    """Over TLS, h2 is offered by ALPN only for loopback hosts; the server supports both."""
    context = server_context(ca, "hook.ns.svc", "localhost")
    server: BackendServer = await nursery.start(BackendServer(ssl_context=context).serve)
    bundle = ca.cert_pem.bytes()
    if service:
        config = ClientConfig(
            service=ServiceReference(namespace="ns", name="hook", path="/v"), ca_bundle=bundle
        )
        call_target = resolve_target(config, None)
    else:
        call_target = target(server.url("/v", host="localhost"), bundle)
    async with ClientPool(connect_override={"hook.ns.svc": ("127.0.0.1", server.port)}) as pool:
        response = await pool.post(call_target, body=b"{}", timeout_seconds=5)
    assert (response.status, response.http_version) == (200, expected)
    assert server.requests[0].alpn == ("http/1.1" if service else "h2")


async def test_idle_h2_connection_is_retired(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    """An HTTP/2 connection without streams past the idle timeout is closed (with GOAWAY) and forgotten."""
    server = await start(nursery)
    async with ClientPool(h2c_prior_knowledge=True, idle_timeout_seconds=10) as pool:
        await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=5)
        mock_clock.jump(15)
        await server.wait_until(lambda: server.closed_connections == 1)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.open_connections() == {}
        await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=5)
    assert server.connections == 2


HEADER_CASES = [
    pytest.param(
        b"Bearer tok-1",
        {"authorization": "Bearer tok-1", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
        id="TRN-05/11: credentials and traceparent arrive over HTTP/2 as sent",
    ),
    pytest.param(
        b" Bearer tok-2 ",
        {"authorization": "Bearer tok-2"},
        id="TRN-11: a credential value is trimmed over HTTP/2 (as h2's own normalisation did)",
    ),
]


@pytest.mark.parametrize(("auth", "expected"), HEADER_CASES)
async def test_outbound_headers_over_http2(
    nursery: trio.Nursery, auth: bytes, expected: dict[str, str]
) -> None:
    """The gateway's own header normalisation for HTTP/2 sends what h2's generic pass sent."""
    server = await start(nursery)
    trace = ((b"traceparent", expected["traceparent"].encode()),) if "traceparent" in expected else ()
    async with ClientPool(h2c_prior_knowledge=True) as pool:
        tgt = dataclasses.replace(target(server.url("/ok")), auth_headers=((b"authorization", auth),))
        for _ in range(3):  # later calls use the HPACK dynamic table
            response = await pool.post(tgt, body=b"{}", headers=trace, timeout_seconds=5)
            assert response.status == 200
    assert [r.http_version for r in server.requests] == ["HTTP/2"] * 3
    for seen in server.requests:
        assert {k: seen.headers[k] for k in expected} == expected
        assert seen.headers["content-type"] == "application/json"
        assert seen.headers["content-length"] == "2"


class ScriptedH2Backend:
    """An h2c backend that treats the first stream of its first connection per ``mode``, answers others 200.

    ``refuse``: RST_STREAM(REFUSED_STREAM) before reading the body; ``reset``: read the whole request,
    then RST_STREAM(INTERNAL_ERROR); ``goaway``: read the whole request, then GOAWAY naming that
    stream as the last one processed, and close without answering.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests: list[tuple[int, int, bool]] = []  # (connection, stream, whole request read)
        self.connections = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(int(listeners[0].socket.getsockname()[1]))
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        index = self.connections
        self.connections += 1
        connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        connection.initiate_connection()
        async with stream:
            await stream.send_all(connection.data_to_send())
            while data := await stream.receive_some(65536):
                for event in connection.receive_data(data):
                    first = index == 0 and event_stream(event) == 1
                    if isinstance(event, h2.events.RequestReceived) and first and self.mode == "refuse":
                        self.requests.append((index, event.stream_id, False))
                        connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                    elif first and self.mode == "refuse":
                        continue  # the rest of the refused stream is dropped
                    elif isinstance(event, h2.events.StreamEnded):
                        self.requests.append((index, event.stream_id, True))
                        if first and self.mode == "reset":
                            connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
                        elif first and self.mode == "goaway":
                            connection.close_connection(last_stream_id=event.stream_id)
                            await stream.send_all(connection.data_to_send())
                            return
                        else:
                            connection.send_headers(event.stream_id, [(":status", "200")], end_stream=True)
                    elif isinstance(event, h2.events.DataReceived):
                        connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                await stream.send_all(connection.data_to_send())


def event_stream(event: h2.events.Event) -> int:
    return int(getattr(event, "stream_id", 0) or 0)


@pytest.mark.parametrize(
    ("mode", "outcome", "requests"),
    [
        pytest.param(
            "refuse",
            200,
            [(0, 1, False), (0, 3, True)],
            id="FPT-10: REFUSED_STREAM was provably not processed: sent once more",
        ),
        pytest.param(
            "reset",
            "INTERNAL_ERROR",
            [(0, 1, True)],
            id="FPT-10: a stream reset after the backend read it is one failed call, never resent",
        ),
        pytest.param(
            "goaway",
            "unexpected EOF",
            [(0, 1, True)],
            id="FPT-10: GOAWAY whose last stream id includes the call is one failed call, never resent",
        ),
    ],
)
async def test_only_unprocessed_streams_are_resent(
    nursery: trio.Nursery, mode: str, outcome: object, requests: list[tuple[int, int, bool]]
) -> None:
    backend = ScriptedH2Backend(mode)
    port = await nursery.start(backend.serve)
    async with ClientPool(h2c_prior_knowledge=True) as pool:
        call = pool.post(target(f"http://127.0.0.1:{port}/x"), body=b"{}", timeout_seconds=5)
        if isinstance(outcome, int):
            assert (await call).status == outcome
        else:
            with pytest.raises(TransportError) as info:
                await call
            assert str(outcome) in info.value.cause, info.value.cause
    assert backend.requests == requests


async def test_a_long_lived_connection_remembers_no_closed_streams(
    nursery: trio.Nursery,
) -> None:
    """h2 remembered how each closed stream ended (by default for 2**16 streams per connection,
    ~11.5 MB once a kept-alive backend connection had carried that many calls; the gateway kept
    1,024). The gateway's own framer forgets a stream when it ends: late frames for it are
    recognised by id (at most the highest opened) and dropped."""
    server = await start(nursery)
    async with ClientPool(max_connections_per_origin=1, h2c_prior_knowledge=True) as pool:
        for _ in range(1_500):
            response = await pool.post(target(server.url("/")), body=b"{}", timeout_seconds=5)
            assert response.status == 200
        (connection,) = [c for group in pool._origins.values() for c in group.connections()]
        remembered = len(connection._core.streams)  # the framer's open streams, per connection
        last = connection._core.last_stream_id
    assert server.connections == 1
    assert (remembered, last) == (0, 2 * 1_500 - 1)
