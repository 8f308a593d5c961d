"""TLS handshakes wait behind the established connections' work (``HandshakeGate``, ``--handshake-burst``).

docs/inbound.md, "Connections that are not established yet". The gate's discipline is checked on the
gate itself, driven by trio's own idle detection (no clock, no timing); what a caller sees is
checked through the real gateway over real TLS sockets.
"""

from __future__ import annotations

import socket
import ssl
import struct
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from gateway.devtools.backends import serve_backend
from gateway.server.cgroup import CpuShare
from gateway.server.hypercorn.handshake import BUSY_CPU_SHARE, HandshakeGate
from loadtests.abuse import client_hello
from tests.support.inbound import Gateway, read_response, review_request, start


async def test_waiting_handshakes_are_admitted_oldest_first() -> None:
    """With its tokens used up, the gate admits one handshake per idle moment of the event loop, the
    one that came first first: the queue is short (accepting pauses behind it), so first come, first
    served bounds every wait at that many admissions; newest first starved the oldest past their
    deadline while new ones kept arriving."""
    gate = HandshakeGate(burst=1, max_delay=60.0)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        await gate.admit()  # the one token
        names = ["oldest", "middle", "newest"]
        for name in names:
            nursery.start_soon(lambda n=name: _admit(gate, n, order))
            await trio.testing.wait_all_tasks_blocked()
        assert gate.waiting == 3
        nursery.start_soon(gate.run)
        await _until(lambda: len(order) == 3)
        nursery.cancel_scope.cancel()
    assert order == ["oldest", "middle", "newest"]


async def _until(done: object) -> None:
    """Until ``done()``, letting the event loop go idle in between (no clock involved)."""
    assert callable(done)
    while not done():
        await trio.testing.wait_all_tasks_blocked()


async def _admit(gate: HandshakeGate, name: str, order: list[str]) -> None:
    await gate.admit()
    order.append(name)
    await trio.testing.wait_all_tasks_blocked()  # the next one is admitted at the next idle moment


async def test_tokens_come_back_only_when_the_event_loop_has_nothing_else_to_run() -> None:
    """burst=2: two handshakes go at once; the third waits while other work is runnable (a task
    that keeps the loop busy for a while), and is admitted once that work is done."""
    gate = HandshakeGate(burst=2, max_delay=60.0)
    events: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.run)
        await gate.admit()
        await gate.admit()

        async def busy() -> None:
            for _ in range(200):
                await trio.lowlevel.checkpoint()
            events.append("established work done")

        async def handshake() -> None:
            await gate.admit()
            events.append("third handshake admitted")

        nursery.start_soon(busy)
        nursery.start_soon(handshake)
        await _until(lambda: len(events) == 2)
        nursery.cancel_scope.cancel()
    assert events == ["established work done", "third handshake admitted"]


async def test_a_waiting_handshake_cut_by_its_deadline_leaves_the_queue() -> None:
    """A connection whose deadline passes while it waits (--handshake-timeout) leaves the queue; the
    token it would have had goes to the next one."""
    gate = HandshakeGate(burst=1, max_delay=60.0)
    await gate.admit()
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _admit(gate, "kept", order))
        await trio.testing.wait_all_tasks_blocked()
        scope = trio.CancelScope()
        nursery.start_soon(lambda: _cut(gate, scope))
        await trio.testing.wait_all_tasks_blocked()
        assert gate.waiting == 2
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert gate.waiting == 1
        nursery.start_soon(gate.run)
        await _until(lambda: order == ["kept"])
        nursery.cancel_scope.cancel()
    assert order == ["kept"]


async def _cut(gate: HandshakeGate, scope: trio.CancelScope) -> None:
    with scope:
        await gate.admit()
        raise AssertionError("admitted after its deadline")


async def _tls_gateway(nursery: trio.Nursery, tmp_path: Path, *args: str) -> tuple[Gateway, ssl.SSLContext]:
    ca = trustme.CA()
    ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(tmp_path / "tls.pem")
    pem = str(tmp_path / "tls.pem")
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    backend = f"http://127.0.0.1:{server.port}/allow"
    gw = await start(nursery, tmp_path, backend, "--certfile", pem, "--keyfile", pem, *args)
    context = ssl.create_default_context()
    ca.configure_trust(context)
    context.set_alpn_protocols(["http/1.1"])
    return gw, context


async def _tls_reviews(gw: Gateway, context: ssl.SSLContext, count: int) -> list[int]:
    """``count`` reviews, each on a new TLS connection, all at once; their status codes."""
    statuses: list[int] = []

    async def one() -> None:
        stream = trio.SSLStream(
            await trio.open_tcp_stream("127.0.0.1", gw.port), context, server_hostname="localhost"
        )
        try:
            with trio.fail_after(20):
                await stream.send_all(review_request())
                reply = await read_response(stream)  # type: ignore[arg-type]
        except trio.BrokenResourceError:  # reset: the gateway cut the connection
            reply = b""
        await trio.aclose_forcefully(stream)
        statuses.append(int(reply.split(b" ", 2)[1]) if reply else 0)

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return statuses


GATE_CASES = [
    pytest.param(
        ["--handshake-burst", "1"],
        False,
        id="--handshake-burst 1: a burst of new TLS connections all get answers",
    ),
    pytest.param(
        ["--handshake-burst", "1"],
        True,
        id="--handshake-burst 1 while the event loop never goes idle: handshakes still go through, --handshake-burst per 50 ms",
    ),
    pytest.param(["--handshake-burst", "0"], False, id="--handshake-burst 0: no gate"),
]


@pytest.mark.parametrize(("args", "keep_busy"), GATE_CASES)
async def test_new_tls_connections_get_through_the_gate(
    nursery: trio.Nursery, tmp_path: Path, args: list[str], keep_busy: bool
) -> None:
    gw, context = await _tls_gateway(nursery, tmp_path, *args)
    busy = _keep_the_loop_busy(nursery) if keep_busy else trio.CancelScope()
    assert await _tls_reviews(gw, context, 12) == [200] * 12
    busy.cancel()
    assert gw.counter("inbound_closed", "handshake_timeout") == 0


RATE_CASES = [
    pytest.param(
        ["--handshake-rate", "5"],
        True,
        (5, 11),
        id="--handshake-rate 5, 20 dials at once from a client with a connection idle: 5 handshaken at once "
        "and 5 a second after that; every review is answered",
    ),
    pytest.param(
        ["--handshake-rate", "5"],
        False,
        (20, 20),
        id="--handshake-rate 5, 20 dials at once from a client with no connection idle: all in the first second",
    ),
    pytest.param(
        ["--handshake-rate", "0"],
        True,
        (20, 20),
        id="--handshake-rate 0, a connection idle: all 20 in the first second",
    ),
]


@pytest.mark.parametrize(("args", "one_idle", "in_the_first_second"), RATE_CASES)
async def test_dials_of_a_client_with_a_connection_idle_are_admitted_at_the_handshake_rate(
    nursery: trio.Nursery,
    tmp_path: Path,
    args: list[str],
    one_idle: bool,
    in_the_first_second: tuple[int, int],
) -> None:
    """An idle moment of the loop is not a reason to handshake every dial waiting: after a burst,
    client-go has thousands of dials open whose reviews were served on connections that came back,
    and handshaking them at each idle moment kept p99 up long after it (docs/performance.md, "after
    a 2 s burst"). While a client has a connection idle at the gateway, none of its reviews waits for
    a dial (client-go gives a waiting review an idle connection at once), and its dials go at the
    rate; a client whose connections are all busy may need each dial, and they go at once."""
    gw, context = await _tls_gateway(nursery, tmp_path, *args)
    if one_idle:  # a kept-alive connection, its review answered, idle for longer than 0.1 s
        kept = trio.SSLStream(
            await trio.open_tcp_stream("127.0.0.1", gw.port), context, server_hostname="localhost"
        )
        await kept.send_all(review_request())
        assert (await read_response(kept)).split(b" ", 2)[1] == b"200"  # type: ignore[arg-type]
        await trio.sleep(0.2)
    start = trio.current_time()
    handshaken: list[float] = []

    async def one() -> None:
        stream = trio.SSLStream(
            await trio.open_tcp_stream("127.0.0.1", gw.port), context, server_hostname="localhost"
        )
        with trio.fail_after(10):
            await stream.do_handshake()
            handshaken.append(trio.current_time() - start)
            await stream.send_all(review_request())
            reply = await read_response(stream)  # type: ignore[arg-type]
        await trio.aclose_forcefully(stream)
        assert reply.split(b" ", 2)[1] == b"200"

    async with trio.open_nursery() as clients:
        for _ in range(20):
            clients.start_soon(one)
    low, high = in_the_first_second
    assert low <= sum(1 for at in handshaken if at < 1.0) <= high
    assert len(handshaken) == 20
    assert gw.counter("inbound_closed", "handshake_timeout") == 0


def _keep_the_loop_busy(nursery: trio.Nursery) -> trio.CancelScope:
    """A task that always has work, so that the event loop never goes idle, until the scope it
    returns is cancelled."""
    busy = trio.CancelScope()

    async def spin() -> None:
        with busy:
            while True:
                await trio.lowlevel.checkpoint()

    nursery.start_soon(spin)
    return busy


# --- Accepting behind the gate: dials the loop has no time for wait in the kernel, not here ------


BACKPRESSURE_CASES = [
    pytest.param(
        [],
        True,
        id="150 dials at once while the event loop never goes idle: accept waits while 16 handshakes queue at "
        "the gate, so no dial waits there past --handshake-timeout and every review is answered",
    ),
    pytest.param(
        ["--max-waiting-handshakes", "2"],
        True,
        id="the same with --max-waiting-handshakes 2: every review is answered",
    ),
    pytest.param(
        ["--max-waiting-handshakes", "0"],
        False,
        id="the same with --max-waiting-handshakes 0 (accept regardless): the dials queued at the gate past "
        "--handshake-timeout are reset",
    ),
]


@pytest.mark.parametrize(("args", "waits"), BACKPRESSURE_CASES)
async def test_dials_beyond_the_waiting_handshakes_stay_in_the_kernels_accept_queue(
    nursery: trio.Nursery, tmp_path: Path, args: list[str], waits: bool
) -> None:
    """Handshakes are admitted one per 50 ms here (the loop is never idle): 150 dials queued at the
    gate at once would wait up to 7.5 s, and the last ones would be reset at --handshake-timeout 5.
    (The clients share the busy loop, so their ClientHellos come late and more than 16 reach the
    gate at times: up to ~3 s there, measured.)"""
    gw, context = await _tls_gateway(
        nursery, tmp_path, "--handshake-burst", "1", "--handshake-timeout", "5", *args
    )
    busy = _keep_the_loop_busy(nursery)
    statuses = await _tls_reviews(gw, context, 150)
    busy.cancel()
    if waits:
        assert statuses == [200] * 150
        assert gw.counter("inbound_closed", "handshake_timeout") == 0
        assert gw.counter("accept_paused") > 0  # it did wait
    else:
        assert 0 < statuses.count(0) == gw.counter("inbound_closed", "handshake_timeout")
        assert gw.counter("accept_paused") == 0


async def test_a_dial_its_client_closed_while_it_waited_at_the_gate_costs_no_handshake(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A client that gives up on a dial (Go's transport does at its TLS handshake timeout) closes
    the connection after its ClientHello. When the gate admits it, the gateway sees the FIN and drops
    it without the handshake's crypto: counted as abandoned, not as a limit reached."""
    gw, _ = await _tls_gateway(nursery, tmp_path, "--handshake-burst", "1")
    busy = _keep_the_loop_busy(nursery)
    hello = client_hello()
    count = 10
    for _ in range(count):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", gw.port))
        await sock.send(hello)
        sock.close()  # FIN: nothing unread on this side
    with trio.fail_after(20):
        while (
            gw.counter("handshakes_abandoned", "gate") + gw.counter("handshakes_abandoned", "accept_queue")
            < count - 1
        ):
            await trio.sleep(0.01)
    busy.cancel()
    assert gw.counter("inbound_closed", "handshake_timeout") == 0


async def test_dials_given_up_in_the_kernels_queue_are_dropped_at_accept_not_queued_at_the_gate(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """While accepting is paused, client-go gives up dials it no longer needs, in the kernel's accept
    queue (first in, first out). Each would take the place at the gate and an admission (10 ms here:
    the loop is never idle), ahead of the live dials behind it; instead accept finds the client's FIN
    and drops it at once, counted at ``accept_queue``. Ten live dials (their handshakes never
    finish) keep accepting paused for ~100 ms before the given-up ones are reached."""
    gw, _ = await _tls_gateway(nursery, tmp_path, "--handshake-burst", "1", "--max-waiting-handshakes", "1")
    busy = _keep_the_loop_busy(nursery)
    hello = client_hello()
    live = []
    for _ in range(10):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", gw.port))
        await sock.send(hello)
        live.append(sock)
    count = 20
    for _ in range(count):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", gw.port))
        await sock.send(hello)
        sock.close()  # given up: FIN, while it waits in the kernel's queue
    with trio.fail_after(20):
        while (
            gw.counter("handshakes_abandoned", "accept_queue") + gw.counter("handshakes_abandoned", "gate")
            < count
        ):
            await trio.sleep(0.01)
    busy.cancel()
    for sock in live:
        sock.close()
    assert gw.counter("handshakes_abandoned", "accept_queue") == count


async def _reset_after_the_servers_flight(port: int) -> None:
    """A ClientHello, the gateway's answer to it read (its part of the crypto is spent), then a reset:
    a dial its caller gave up while the handshake was under way."""
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    await sock.send(client_hello())
    assert await sock.recv(65536), "the gateway answered the ClientHello"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def _plaintext_to_the_tls_port(port: int) -> None:
    """An HTTP request where a ClientHello belongs: TLS refuses it (and says so before closing)."""
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    await sock.send(b"POST /validate HTTP/1.1\r\nhost: gateway\r\ncontent-length: 0\r\n\r\n")
    while await sock.recv(65536):
        pass
    sock.close()


@pytest.mark.parametrize(
    ("client", "reason"),
    [
        pytest.param(_reset_after_the_servers_flight, "client_gone", id="a client that resets after the gateway computed its part of the handshake is counted as client_gone"),
        pytest.param(_plaintext_to_the_tls_port, "refused", id="a client that speaks no TLS is refused by TLS and counted as refused"),
    ],
)  # fmt: skip
async def test_a_handshake_begun_that_does_not_complete_is_counted_by_why(
    nursery: trio.Nursery, tmp_path: Path, client: object, reason: str
) -> None:
    """``webhook_gateway_inbound_handshakes_failed_total{reason}``: the crypto a dial storm wastes
    on dials their caller gave up too late, apart from handshakes TLS refused."""
    gw, context = await _tls_gateway(nursery, tmp_path)
    assert callable(client)
    for _ in range(3):
        await client(gw.port)
    with trio.fail_after(20):  # a deadline for a broken count, not a measurement
        while gw.counter("handshakes_failed", reason) < 3:
            await trio.sleep(0.01)
    assert await _tls_reviews(gw, context, 2) == [200, 200]  # completed handshakes count nothing
    other = "refused" if reason == "client_gone" else "client_gone"
    assert (gw.counter("handshakes_failed", reason), gw.counter("handshakes_failed", other)) == (3, 0)


@pytest.mark.parametrize(
    "burst",
    [
        pytest.param(1, id="--handshake-burst 1 while the event loop never goes idle: one handshake per 50 ms, 20 in a second"),
        pytest.param(3, id="--handshake-burst 3 while the event loop never goes idle: three per 50 ms, 60 in a second"),
    ],
)  # fmt: skip
async def test_a_loop_that_never_goes_idle_admits_burst_handshakes_per_50_ms(
    burst: int, mock_clock: trio.testing.MockClock
) -> None:
    """Behind, the gateway gives handshakes a small share of its time: each admitted dial brings
    another review onto a loop that has no time for the ones it has (driven by the apiserver's
    client, 1 per 10 ms kept a burst's backlog growing for 10 s after it; docs/performance.md). The
    clock is trio's mock clock (pytest-trio's ``mock_clock``), moved 1 ms by every step of a task
    that never blocks."""
    admitted = await _admitted_in_a_second(HandshakeGate(burst=burst), burst, mock_clock, idle=False)
    assert 19 * burst <= admitted <= 20 * burst


async def _admitted_in_a_second(
    gate: HandshakeGate, burst: int, mock_clock: trio.testing.MockClock, *, idle: bool, stale: bool = False
) -> int:
    """How many of 200 waiting handshakes ``gate`` admits in a second of trio's mock clock, moved
    1 ms by every step of a task that lets the loop go idle between steps (``idle``) or never.
    ``stale``: each dial's client has a connection idle (no review of its waits for the dial)."""
    admitted = 0

    async def one() -> None:
        nonlocal admitted
        await gate.admit(lambda: stale)
        admitted += 1

    async with trio.open_nursery() as nursery:
        for _ in range(burst):
            await gate.admit()  # the tokens, used up
        for _ in range(200):
            nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(gate.run)
        start = trio.current_time()
        while trio.current_time() - start < 1.0:
            mock_clock.jump(0.001)
            if idle:
                await trio.testing.wait_all_tasks_blocked()  # an idle moment of the loop
            else:
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    return admitted


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        pytest.param(1.0, (19, 21), id="the process at its whole CPU budget, its loop idle between reviews (a CFS quota): one handshake per 50 ms, 20 in a second"),
        pytest.param(0.9, (19, 21), id="the process at 90 % of its CPU budget (over 85 %): one handshake per 50 ms"),
        pytest.param(0.5, (200, 200), id="the process at half its CPU budget: a handshake at each idle moment of the loop, all 200 in a second"),
    ],
)  # fmt: skip
async def test_a_process_without_cpu_to_spare_admits_burst_handshakes_per_50_ms(
    share: float, expected: tuple[int, int], mock_clock: trio.testing.MockClock
) -> None:
    """An idle moment of the loop is not spare CPU: on half a CPU (a pod's limit) the loop goes idle
    between reviews while the process uses its whole quota, and a handshake admitted at each such
    moment took the established connections' time (docs/performance.md, "Overload"). The process's
    CPU clock here runs at ``share`` of a 0.5-CPU budget; the loop goes idle every 1 ms of trio's
    mock clock."""
    budget = 0.5
    share_of = CpuShare(budget, cpu=lambda: trio.current_time() * budget * share)
    mock_clock.jump(0.1)  # the process has been running so for a window already
    admitted = await _admitted_in_a_second(
        HandshakeGate(burst=1, busy=lambda: share_of.share() >= BUSY_CPU_SHARE), 1, mock_clock, idle=True
    )
    low, high = expected
    assert low <= admitted <= high


@pytest.mark.parametrize(
    ("rate", "stale", "expected"),
    [
        pytest.param(20.0, True, (39, 40), id="--handshake-rate 20, dials whose client has a connection idle, the loop idle between steps: a second's worth at once (20), then one per 50 ms, 40 in a second"),
        pytest.param(5.0, True, (9, 10), id="--handshake-rate 5, the same dials: 5 at once, then one per 200 ms, 10 in a second"),
        pytest.param(20.0, False, (200, 200), id="--handshake-rate 20, dials whose client has no connection idle (a review may wait for each): one at each idle moment, all 200 in a second"),
        pytest.param(0.0, True, (200, 200), id="--handshake-rate 0: a handshake at each idle moment of the loop, all 200 in a second"),
    ],
)  # fmt: skip
async def test_an_idle_loop_admits_stale_dials_at_most_at_the_handshake_rate(
    rate: float, stale: bool, expected: tuple[int, int], mock_clock: trio.testing.MockClock
) -> None:
    """The loop goes idle every 1 ms of trio's mock clock and the process has CPU to spare: without a
    rate every idle moment admits one; with one, the bucket bounds the dials no review waits for."""
    gate = HandshakeGate(burst=1, rate=rate)
    admitted = await _admitted_in_a_second(gate, 1, mock_clock, idle=True, stale=stale)
    low, high = expected
    assert low <= admitted <= high


async def test_a_dial_some_review_waits_for_goes_before_stale_ones_at_a_slow_rate(
    mock_clock: trio.testing.MockClock,
) -> None:
    """--handshake-rate 0.5, stale dials waiting for the bucket: a dial whose client has no connection
    idle, queued behind them, is admitted within the gate's 50 ms, not at the rate's 2 s."""
    gate = HandshakeGate(burst=1, rate=0.5)
    admitted: dict[str, float] = {}

    async def dial(name: str, stale: bool) -> None:
        await gate.admit(lambda: stale)
        admitted[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.run)
        for n in range(3):  # the bucket starts with half a handshake: none of them goes yet
            nursery.start_soon(dial, f"stale {n}", True)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        nursery.start_soon(dial, "live", False)
        while "live" not in admitted:
            mock_clock.jump(0.01)
            await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert admitted["live"] - start < 0.1  # the gate's 50 ms and the test's 10 ms steps; not 2 s
    assert not any(name.startswith("stale ") for name in admitted)


async def _handshake_then_close(gw: Gateway, context: ssl.SSLContext) -> None:
    """A dial client-go did not need: the handshake completes, then the client closes it unused
    (its idle pool already held 25 connections)."""
    stream = trio.SSLStream(
        await trio.open_tcp_stream("127.0.0.1", gw.port), context, server_hostname="localhost"
    )
    await stream.do_handshake()
    await trio.aclose_forcefully(stream)


async def _one_review_then_close(gw: Gateway, context: ssl.SSLContext) -> None:
    stream = trio.SSLStream(
        await trio.open_tcp_stream("127.0.0.1", gw.port), context, server_hostname="localhost"
    )
    await stream.send_all(review_request())
    assert (await read_response(stream)).startswith(b"HTTP/1.1 200")  # type: ignore[arg-type]
    await trio.aclose_forcefully(stream)


@pytest.mark.parametrize(
    ("client", "unused"),
    [
        pytest.param(_handshake_then_close, 3, id="a connection its client closes after the handshake, before any request, is counted as unused"),
        pytest.param(_one_review_then_close, 0, id="a connection that carried a review is not counted as unused"),
    ],
)  # fmt: skip
async def test_connections_closed_by_their_client_before_any_request_are_counted(
    nursery: trio.Nursery, tmp_path: Path, client: object, unused: int
) -> None:
    """``webhook_gateway_inbound_connections_unused_total``: a handshake spent on a dial its client
    did not need (client-go closes a new connection at once when its idle pool is full: the dials of
    a stall that completed after it), the waste behind a slow recovery from a burst."""
    gw, context = await _tls_gateway(nursery, tmp_path)
    assert callable(client)
    for _ in range(3):
        await client(gw, context)
    with trio.fail_after(20):  # a deadline for a broken count, not a measurement
        while gw.open_connections > 0:
            await trio.sleep(0.01)
    assert gw.counter("connections_unused") == unused
