"""How the generator holds its HTTP/1.1 connections: the kube-apiserver's policy, or one of two others.

``client-go`` (the default) is what the kube-apiserver's webhook client does: Go's ``http.Transport``
as client-go configures it (``k8s.io/client-go/transport/cache.go``, ``utilnet.SetTransportDefaults``):

- keep-alive connections in an idle pool, most recently used first (Go's ``getIdleConn``);
- at most ``MaxIdleConnsPerHost`` = 25 idle connections: one released while 25 are idle is closed;
- a request that finds no idle connection starts a new dial, with no upper bound on connections
  (``MaxConnsPerHost`` = 0), and takes whichever comes first: its own dial, or a connection another
  request releases meanwhile ("late binding"); a dial that lost that race still completes and its
  connection goes to the next waiting request or the idle pool (Go 1.23 and later no longer cancel a
  dial when its request is cancelled);
- a full TLS handshake per connection (no session cache: Go's ``ClientSessionCache`` is nil);
- idle connections expire after 90 s (``IdleConnTimeout``); one the server closed while idle is
  dropped, not used (Go's read loop notices the EOF);
- a request is abandoned at its deadline (the review's ``?timeout=``, counted from its scheduled
  arrival), and its connection, if it had one, is closed, as Go closes a connection whose request
  was cancelled mid-way.

``fixed`` is this tool's earlier model: one connection per worker (closed-loop client, or open-loop
connection), opened before the measurement and reopened only when it breaks or its review is
abandoned. A gateway that stalls never sees a new connection from it, so it hides the apiserver's
connection churn; it stays for comparisons with earlier figures.

``per-review`` dials a new connection for every review and closes it after the answer: connect,
full handshake, one review, close. Its CPU per review is the cost of a new TLS connection.

The generator's own side of a handshake costs it ~0.8 ms of CPU (Python's ``ssl`` on OpenSSL 3.0,
measured against nginx on the 2-core VM); handing it to a worker thread (``ssl`` releases the GIL
during ``SSL_do_handshake``) cost ~1.3 ms in all, so it runs inline. The report shows the generator's
CPU and how late its own timers fire, so a generator that set the pace is seen.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import select
import socket
import ssl
from collections import deque
from dataclasses import dataclass, field
from typing import Final

import trio

from gateway.wire.tls_stream import TLSSocketStream
from loadtests.client import ConnectionLostError, Endpoint, Http1Connection

POLICIES: Final = ("client-go", "fixed", "per-review")
MAX_IDLE_PER_HOST: Final = 25  # client-go: k8s.io/apimachinery/pkg/util/net.SetOldTransportDefaults
IDLE_TIMEOUT: Final = 90.0  # client-go: IdleConnTimeout
HANDSHAKE_TIMEOUT: Final = 10.0  # client-go: TLSHandshakeTimeout
DIAL_TIMEOUT: Final = 30.0  # client-go: net.Dialer{Timeout: 30 s}


class AbandonedError(Exception):
    """The review's deadline passed before its answer: the caller gave up (and closed the connection)."""


class DialError(Exception):
    """A new connection could not be opened (TCP connect or TLS handshake failed)."""


@dataclass
class ConnectionStats:
    """What the generator did with connections during a phase (only the measured part counts)."""

    dials: int = 0  # new connections started
    opened: int = 0  # ... that completed their TLS handshake (or TCP connect, in plaintext)
    dial_errors: int = 0
    reused: int = 0  # requests sent on a connection taken from the idle pool
    closed_surplus: int = 0  # released while max_idle were idle: closed (client-go)
    closed_abandoned: int = 0  # closed because their review's deadline passed mid-request
    closed_by_server: int = 0  # broken, or not reusable after the answer, or found closed while idle
    open: int = 0
    peak_open: int = 0
    dial_seconds_total: float = 0.0  # connect + handshake, summed over completed dials
    opened_at: list[float] = field(default_factory=list)  # when each dial completed (trio clock)
    # Counters this generator cannot see (the Go caller: Go's transport closes surplus idle
    # connections and notices a server's close itself): reported as "-", not as 0.
    unmeasured: tuple[str, ...] = ()

    def reset(self) -> None:
        """Start counting afresh (the measured phase after its warm-up); ``open`` stays true."""
        fresh = ConnectionStats(open=self.open, peak_open=self.open)
        self.__dict__.update(fresh.__dict__)

    def dial_offsets(self, started: float) -> list[float]:
        """When each new connection was ready, in seconds from ``started``."""
        return [t - started for t in self.opened_at]

    def summary(self, seconds: float, reviews: int) -> dict[str, float]:
        """The counters, with new connections per second and per review (handshakes per review)."""
        out: dict[str, float] = {
            name: math.nan if name in self.unmeasured else float(getattr(self, name))
            for name in self.__dataclass_fields__
            if name not in ("opened_at", "unmeasured")
        }
        out["new_per_s"] = self.opened / seconds if seconds > 0 else math.nan
        out["per_review"] = self.opened / reviews if reviews else math.nan
        out["dial_ms_mean"] = 1000 * self.dial_seconds_total / self.opened if self.opened else math.nan
        return out


async def _connect(host: str, port: int) -> trio.SocketStream:
    """TCP connect; to an IP address without ``open_tcp_stream``'s name resolution and happy-eyeballs
    machinery (half the generator's CPU for a connect: 70 instead of 150 µs)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return await trio.open_tcp_stream(host, port)
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def dial(endpoint: Endpoint, stats: ConnectionStats) -> Http1Connection:
    """A new HTTP/1.1 connection: TCP connect, then a full TLS handshake."""
    stats.dials += 1
    started = trio.current_time()
    try:
        with trio.fail_after(DIAL_TIMEOUT):
            tcp = await _connect(endpoint.host, endpoint.port)
        stream: trio.abc.Stream = tcp
        try:
            if endpoint.ssl_context is not None:
                stream = TLSSocketStream(tcp, endpoint.ssl_context, server_hostname=endpoint.host)
                with trio.fail_after(HANDSHAKE_TIMEOUT):
                    await stream.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        conn = Http1Connection(stream, endpoint.authority)
    except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
        stats.dial_errors += 1
        raise DialError(str(exc) or type(exc).__name__) from exc
    stats.opened += 1
    stats.open += 1
    stats.peak_open = max(stats.peak_open, stats.open)
    now = trio.current_time()
    stats.dial_seconds_total += now - started
    stats.opened_at.append(now)
    return conn


def _close(conn: Http1Connection, stats: ConnectionStats) -> None:
    """Close at once (no close_notify, nothing awaited), as Go closes a connection. Only for a
    connection no task is using: the stream object is dropped with it."""
    stats.open -= 1
    sock = getattr(conn.stream, "socket", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            trio.lowlevel.notify_closing(sock)
            sock.close()


def _closed_while_idle(conn: Http1Connection) -> bool:
    """Whether the server closed an idle connection (or wrote to it out of turn), as Go's read loop
    notices. TLS 1.3 session tickets arriving after the handshake make a live one readable too: for
    TLS the readable bytes are read, and only application data or an end counts."""
    stream = conn.stream
    sock = getattr(stream, "socket", None)
    if sock is None:
        return False
    try:
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    if not ready:
        return False
    if not isinstance(stream, TLSSocketStream):
        return True
    try:
        stream.socket.recv(1)
    except ssl.SSLWantReadError:
        return False  # only TLS records (session tickets): still a live connection
    except (ssl.SSLError, OSError):
        return True
    return True  # application data or EOF while idle


class _Waiter:
    __slots__ = ("conn", "done", "error", "event")

    def __init__(self) -> None:
        self.conn: Http1Connection | None = None
        self.error: DialError | None = None
        self.done = False
        self.event = trio.Event()

    def deliver(self, conn: Http1Connection | None, error: DialError | None = None) -> None:
        self.conn, self.error, self.done = conn, error, True
        self.event.set()


class Policy:
    """A connection policy: ``round_trip`` sends one request by its rules and honours its deadline."""

    name: str = ""

    def __init__(self, endpoint: Endpoint, nursery: trio.Nursery) -> None:
        self.endpoint = endpoint
        self.nursery = nursery
        self.stats = ConnectionStats()

    async def prepare(self, workers: int) -> None:
        """Before a measured phase: open what the policy keeps open from the start (``fixed``)."""

    async def acquire(self, worker: int, deadline: float) -> Http1Connection:
        """A connection for ``worker``'s next request; ``AbandonedError`` if none is there by
        ``deadline``, ``DialError`` if the dial for it failed."""
        raise NotImplementedError

    def release(self, worker: int, conn: Http1Connection) -> None:
        """The answer was read and the connection may be reused."""
        raise NotImplementedError

    def discard(self, worker: int, conn: Http1Connection) -> None:
        """The connection is closed (broken, not reusable, or its request abandoned)."""
        _close(conn, self.stats)

    async def round_trip(self, worker: int, path: bytes, body: bytes, deadline: float) -> tuple[int, bytes]:
        """POST ``body`` to ``path``: (status, body). Raises ``AbandonedError`` at ``deadline`` (the
        connection, if any, closed), ``DialError`` or ``ConnectionLostError``."""
        if trio.current_time() >= deadline:
            raise AbandonedError  # never put on the wire
        conn = await self.acquire(worker, deadline)
        try:
            with trio.fail_at(deadline):
                status, answer = await conn.request(path, body)
        except trio.TooSlowError:
            self.stats.closed_abandoned += 1
            self.discard(worker, conn)
            raise AbandonedError from None
        except ConnectionLostError:
            # Not retried: Go retries a POST only when nothing of it was written, and it notices an
            # idle connection the server closed before reusing it (as acquire does here).
            self.stats.closed_by_server += 1
            self.discard(worker, conn)
            raise
        if conn.reusable:
            self.release(worker, conn)
        else:
            self.stats.closed_by_server += 1
            self.discard(worker, conn)
        return status, answer

    def close_all(self) -> None:
        """At the end of a phase: close every connection the policy holds."""


class ClientGoPool(Policy):
    """client-go's keep-alive pool (see the module docstring)."""

    name = "client-go"

    def __init__(
        self, endpoint: Endpoint, nursery: trio.Nursery, *, max_idle: int = MAX_IDLE_PER_HOST
    ) -> None:
        super().__init__(endpoint, nursery)
        self.max_idle = max_idle
        self.idle: list[tuple[Http1Connection, float]] = []  # most recently used last
        self.waiters: deque[_Waiter] = deque()

    async def acquire(self, worker: int, deadline: float) -> Http1Connection:
        now = trio.current_time()
        while self.idle:
            conn, since = self.idle.pop()
            if now - since > IDLE_TIMEOUT or _closed_while_idle(conn):
                self.stats.closed_by_server += now - since <= IDLE_TIMEOUT
                _close(conn, self.stats)
                continue
            self.stats.reused += 1
            return conn
        waiter = _Waiter()
        self.waiters.append(waiter)
        self.nursery.start_soon(self._dial_for, waiter)
        with trio.move_on_at(deadline):
            await waiter.event.wait()
        if not waiter.done:
            waiter.done = True  # the dial (or a release) hands its connection to someone else
            raise AbandonedError
        if waiter.error is not None:
            raise waiter.error
        assert waiter.conn is not None
        return waiter.conn

    async def _dial_for(self, waiter: _Waiter) -> None:
        try:
            conn = await dial(self.endpoint, self.stats)
        except DialError as exc:
            if not waiter.done:
                waiter.deliver(None, exc)
            return
        if not waiter.done:
            waiter.deliver(conn)
        else:
            self.release(-1, conn)  # Go: putOrCloseIdleConn

    def release(self, worker: int, conn: Http1Connection) -> None:
        while self.waiters:  # late binding: a request waiting for its dial takes this one first
            waiter = self.waiters.popleft()
            if not waiter.done:
                waiter.deliver(conn)
                return
        if len(self.idle) >= self.max_idle:
            self.stats.closed_surplus += 1
            _close(conn, self.stats)
            return
        self.idle.append((conn, trio.current_time()))

    def close_all(self) -> None:
        for conn, _ in self.idle:
            _close(conn, self.stats)
        self.idle.clear()


class FixedConnections(Policy):
    """One connection per worker, opened before the measurement (not the apiserver's policy)."""

    name = "fixed"

    def __init__(self, endpoint: Endpoint, nursery: trio.Nursery) -> None:
        super().__init__(endpoint, nursery)
        self.conns: dict[int, Http1Connection] = {}

    async def prepare(self, workers: int) -> None:
        async def one(worker: int) -> None:
            if worker not in self.conns:
                with contextlib.suppress(DialError):
                    self.conns[worker] = await dial(self.endpoint, self.stats)

        async with trio.open_nursery() as nursery:
            for worker in range(workers):
                nursery.start_soon(one, worker)

    async def acquire(self, worker: int, deadline: float) -> Http1Connection:
        conn = self.conns.pop(worker, None)
        if conn is not None:
            self.stats.reused += 1
            return conn
        with trio.move_on_at(deadline):
            return await dial(self.endpoint, self.stats)
        raise AbandonedError

    def release(self, worker: int, conn: Http1Connection) -> None:
        self.conns[worker] = conn

    def close_all(self) -> None:
        for conn in self.conns.values():
            _close(conn, self.stats)
        self.conns.clear()


class ConnectionPerReview(Policy):
    """A new connection for every review, closed after its answer: the cost of a new TLS connection."""

    name = "per-review"

    async def acquire(self, worker: int, deadline: float) -> Http1Connection:
        with trio.move_on_at(deadline):
            return await dial(self.endpoint, self.stats)
        raise AbandonedError

    def release(self, worker: int, conn: Http1Connection) -> None:
        _close(conn, self.stats)


def make_policy(name: str, endpoint: Endpoint, nursery: trio.Nursery, *, max_idle: int) -> Policy:
    if name == "client-go":
        return ClientGoPool(endpoint, nursery, max_idle=max_idle)
    if name == "fixed":
        return FixedConnections(endpoint, nursery)
    if name == "per-review":
        return ConnectionPerReview(endpoint, nursery)
    raise ValueError(f"unknown connection policy {name!r} (known: {', '.join(POLICIES)})")
