"""Inbound connection limits: what one client may cost the gateway, and the bookkeeping behind them.

kube-apiserver opens, reuses and drops many keep-alive connections, and anything in the cluster
network can reach the serving port. These limits keep one client (or ordinary churn) from taking
the admission path away from everybody else:

- deadlines for reading a request head, a request body, and for an idle keep-alive connection;
- a write deadline for a response the client does not take (TCP or HTTP/2 flow control);
- a bound on open inbound connections, derived from the memory the process may use and from the
  file-descriptor limit (``connection_bounds``), and a smaller one, with its own deadline, on
  connections that have not finished their TLS handshake;
- a per-connection budget for what frames cost beyond the requests they carry (``FrameBudget``):
  HTTP/2 control frames, small DATA frames, resets the server has to send; HTTP/1.1 small chunks.

``InboundRuntime`` is the shared state of one listener: the open connections, draining/terminating,
and the sink its events (connections closed or rejected, by reason) are counted in. docs/inbound.md
documents every option, its default and why.
"""

from __future__ import annotations

import errno
import itertools
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import structlog

log = structlog.get_logger("gateway.server")

# Why these (docs/inbound.md): a request head is a few hundred bytes, a review body at most a few
# MiB on a cluster network; the apiserver's own idle-connection timeout is 90 s.
DEFAULT_HEADER_TIMEOUT: Final = 10.0
DEFAULT_BODY_TIMEOUT: Final = 10.0
DEFAULT_IDLE_TIMEOUT: Final = 120.0
DEFAULT_WRITE_TIMEOUT: Final = 10.0
DEFAULT_HANDSHAKE_TIMEOUT: Final = 5.0
DEFAULT_FD_RESERVE: Final = 512
# How far from the oldest pending connection eviction looks for one that still waits on its client:
# those waiting on the gateway are the handshakes under way and at most ``accept_room`` at the gate.
_EVICTION_LOOK: Final = 64
# A server handshake's crypto is ~250 µs (ECDSA P-256; ~450 µs RSA 2048): one between two idle
# moments of the event loop, or one per 50 ms when it is never idle. Driven by the kube-apiserver's
# own client at 80 % of capacity, 1 beside 8 answered 23 % more with a third of the dials and a
# quarter of the failed reviews (docs/inbound.md, "Connections that are not established yet").
DEFAULT_HANDSHAKE_BURST: Final = 1
# TLS handshakes a second, on average, for stale dials (their client has a connection idle at the
# gateway, so none of its reviews waits for them), whatever the loop's idle moments say (a bucket of
# one second's worth: as many at once after a quiet second); 0: no such bound. After a burst
# client-go has thousands of dials open whose reviews were served on connections that came back,
# and handshaking them at every idle moment kept p99 up for the rest of the phase; 20 cut those
# handshakes 5-8x (docs/inbound.md, "Dials left over from a burst"). Off by default: two connection
# pools behind one address (an apiserver's two registrations, or apiservers behind one proxy) look
# like one client, so the idle one's connections would hold the other's needed dials to the rate
# when a slow backend makes it open many at once.
DEFAULT_HANDSHAKE_RATE: Final = 0.0
# TLS handshakes waiting for the event loop at which the listener stops accepting (0: never stops).
DEFAULT_MAX_WAITING_HANDSHAKES: Final = 16

# What connections may cost (docs/inbound.md, "Memory"; measured by `python -m loadtests.abuse
# stalled` and tests/test_server_memory.py): the bounds keep the process under MEMORY_TARGET of its
# memory limit with every connection at its most expensive, giving connections CONNECTION_SHARE of
# what is left after start-up (the rest is for the reviews in flight: bodies, decoded objects,
# backend connections).
MEMORY_TARGET: Final = 0.8
CONNECTION_SHARE: Final = 0.5
# An established TLS connection at its most expensive: OpenSSL's state with both record buffers, a
# request head of 15 KB half read, its protocol and tasks (measured 43 KB; idle 15-21 KB).
CONNECTION_COST: Final = 64 * 1024
# A connection in its TLS handshake (ClientHello in, the client's Finished awaited): measured 44 KB.
# Before its ClientHello is whole it costs ~4 KB (its socket and one task).
HANDSHAKE_COST: Final = 48 * 1024
# Connections in their handshake may use at most this share of the connections' memory.
PENDING_SHARE: Final = 0.25

# The frame budget (docs/inbound.md): like nghttp2's "glitch" rate limit, a bucket of 1,000 tokens
# refilled at 100 per second; and at most 32 entries in one SETTINGS frame (nghttp2's bound).
DEFAULT_H2_CONTROL_BURST: Final = 1000
DEFAULT_H2_CONTROL_RATE: Final = 100.0
DEFAULT_H2_MAX_SETTINGS: Final = 32
# Client addresses whose frame budget is remembered after a flood (``InboundRuntime.budget_for``).
MAX_FLOODERS: Final = 4096

# Why a connection was closed by the gateway, or refused (metric label values: a closed set).
CLOSE_REASONS: Final = (
    "header_timeout",
    "body_timeout",
    "idle_timeout",
    "write_timeout",
    "h2_flood",
    "h1_flood",
    "stream_limit",
    "handshake_timeout",
    "handshake_evicted",
    "shutdown",
)
REJECT_REASONS: Final = ("limit", "accept_error")

ACCEPT_CAPACITY_ERRNOS: Final = frozenset(
    e for e in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS) if e is not None
)


@dataclass(frozen=True, slots=True)
class InboundLimits:
    """Every inbound limit, in seconds / counts (CLI options in gateway/cli.py)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    max_connections: int = 0  # 0: derived from memory and RLIMIT_NOFILE (``connection_bounds``)
    max_pending: int = 0  # connections not established yet; 0: derived (``connection_bounds``)
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    # TLS handshakes computed between two idle moments of the event loop (0: no gate).
    handshake_burst: int = DEFAULT_HANDSHAKE_BURST
    # ...and stale dials at most this many a second on average (``HandshakeGate``; 0: no bound).
    handshake_rate: float = DEFAULT_HANDSHAKE_RATE
    # Handshakes waiting at that gate at which accepting pauses: further dials wait in the kernel's
    # accept queue (0: accept regardless; at most half the pending bound, ``InboundRuntime.accept_room``).
    max_waiting_handshakes: int = DEFAULT_MAX_WAITING_HANDSHAKES
    h2_control_burst: int = DEFAULT_H2_CONTROL_BURST
    h2_control_rate: float = DEFAULT_H2_CONTROL_RATE
    h2_max_settings: int = DEFAULT_H2_MAX_SETTINGS


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as Go programs do at start); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard not in (resource.RLIM_INFINITY, soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a sandbox may refuse; keep what we have
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass(frozen=True, slots=True)
class ConnectionBounds:
    """How many inbound connections one gateway process may hold, and what decided it."""

    connections: int  # open connections, pending ones included
    pending: int  # connections that have not finished their TLS handshake
    fds: int  # the bound the file-descriptor limit allows
    memory: int | None  # the bound memory allows (None: not derived from memory)


def connection_bounds(
    limits: InboundLimits,
    *,
    nofile: int,
    reserve: int = DEFAULT_FD_RESERVE,
    memory_limit: int | None,
    resident: int,
    processes: int = 1,
) -> ConnectionBounds:
    """The inbound connection bounds: configured ones, else derived from descriptors and memory.

    Descriptors: the fd limit minus a reserve for the backend connection pools, configuration and
    certificate files and the listeners (with a small fd limit at most half of it goes to the
    reserve). Memory: ``memory_limit`` (the cgroup's, shared by ``processes`` gateway processes)
    times ``MEMORY_TARGET``, minus what this process holds already (``resident``), of which
    connections get ``CONNECTION_SHARE``: as many as fit at ``CONNECTION_COST`` each, and of those
    as many pending ones as fit in ``PENDING_SHARE`` of it at ``HANDSHAKE_COST`` each. The pending
    bound is at most a quarter of the connection bound.
    """
    fds = max(1, nofile - min(reserve, nofile // 2))
    memory = pending_memory = None
    if memory_limit is not None:
        usable = max(0.0, memory_limit * MEMORY_TARGET / max(1, processes) - resident) * CONNECTION_SHARE
        memory = max(1, int(usable / CONNECTION_COST))
        pending_memory = max(1, int(usable * PENDING_SHARE / HANDSHAKE_COST))
    connections = limits.max_connections if limits.max_connections > 0 else min(fds, memory or fds)
    pending = limits.max_pending
    if pending <= 0:
        pending = max(1, connections // 4)
        if pending_memory is not None:
            pending = min(pending, pending_memory)
    return ConnectionBounds(connections, min(pending, connections), fds, memory)


class InboundEvents(Protocol):
    """Where connection events are counted (``Observability`` implements it)."""

    def connection_closed(self, reason: str) -> None: ...

    def connection_rejected(self, reason: str) -> None: ...

    def h2_goaway(self, reason: str) -> None: ...

    def handshake_abandoned(self, where: str) -> None: ...

    def handshake_failed(self, reason: str) -> None: ...

    def connection_unused(self) -> None: ...

    def accept_paused(self, seconds: float) -> None: ...


class NullEvents:
    def connection_closed(self, reason: str) -> None:
        pass

    def connection_rejected(self, reason: str) -> None:
        pass

    def h2_goaway(self, reason: str) -> None:
        pass

    def handshake_abandoned(self, where: str) -> None:
        pass

    def handshake_failed(self, reason: str) -> None:
        pass

    def connection_unused(self) -> None:
        pass

    def accept_paused(self, seconds: float) -> None:
        pass


class Connection(Protocol):
    """What the runtime needs from one open connection (``gateway.server.hypercorn.tcp_server``)."""

    def poke(self) -> None: ...


class Pending(Protocol):
    """A connection not established yet, as the pending bound sees it (``handshake.PendingConnection``)."""

    waits_on_us: bool  # its ClientHello is in: it waits on the gateway, not on its client

    def evict(self) -> None: ...

    def poke(self) -> None: ...


AtOnce = Callable[
    [bytes, bytes, list[tuple[bytes, bytes]], bytes], "tuple[int, list[tuple[bytes, bytes]], bytes] | None"
]


@dataclass(eq=False)
class InboundRuntime:
    """The state one listener's connections share: limits, open connections, draining, events."""

    limits: InboundLimits = field(default_factory=InboundLimits)
    events: InboundEvents = field(default_factory=NullEvents)
    max_connections: int = 1 << 20
    max_pending: int = 1 << 20  # connections not established yet (``PendingConnection``)
    # The CPUs this process may use (``gateway.server.cgroup.cpu_share``), or what says it when asked
    # (``CpuBudget``, read again while serving): what the handshake gate measures the process's CPU
    # against (``CpuShare``).
    cpu_budget: float | Callable[[], float] = 1.0
    draining: bool = False
    terminating: bool = False
    connections: set[Any] = field(default_factory=set)
    # Not established yet (TLS handshake under way), oldest first: the first to go when full.
    pending: dict[Pending, None] = field(default_factory=dict)
    # Called with the number of open connections when one closes (``memory.HeapTrimmer``).
    on_closed: Callable[[int], object] | None = None
    # The frame budgets of client addresses whose connection was ended for going over it, oldest
    # first (``flooded``, ``budget_for``): their next connection starts where the last one ended.
    flooders: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Requests whose app has been started and not yet ended, on every connection of the listener:
    # zero means the gateway is otherwise idle (the HTTP/1.1 protocol runs the next app inline then).
    requests_in_flight: int = 0
    last_request_at: float = -math.inf  # trio time the last plain HTTP/1.1 request was read
    # Where the connections' header and idle deadlines are kept (the listener's ``Deadlines``).
    deadlines: Any = None
    # What admits TLS handshakes behind established connections (the listener's ``HandshakeGate``).
    handshakes: Any = None
    # The application's answer to a request it decides at once, where the server read it (a review
    # the overload gate sheds: ``GatewayApp.answer_at_once``), given (method, target, headers,
    # body) of a plain HTTP/1.1 request whose body came whole; None: the ASGI path as usual.
    answer_at_once: AtOnce | None = None
    # True while the overload gate sheds: a request whose body comes in several reads is then
    # gathered whole where it is read and given to ``answer_at_once`` (``GatewayH11Protocol``).
    sheds_now: Callable[[], bool] | None = None
    # Per client host, its established connections that wait for a request, and since when (trio
    # time): a client with one idle has no review waiting for a dial (``idle_for``).
    idle: dict[str, dict[Any, float]] = field(default_factory=dict)
    _accept_log_at: float = -math.inf

    def connection_idle(self, host: str, connection: Any, now: float) -> None:
        """``connection`` from ``host`` waits for a request from ``now`` on."""
        idle = self.idle.setdefault(host, {})
        idle.pop(connection, None)
        idle[connection] = now  # last: a client's connections stay in the order they went idle

    def connection_busy(self, host: str, connection: Any) -> None:
        """``connection`` from ``host`` has a request (or closed)."""
        idle = self.idle.get(host)
        if idle is not None and idle.pop(connection, None) is not None and not idle:
            del self.idle[host]

    def idle_for(self, host: str, now: float) -> float:
        """How long ``host``'s longest-idle established connection has waited for a request (0: none).

        A client-go client hands an idle connection to a review that waits for one at once, so a
        connection idle for more than a moment says that none of that client's reviews waits for a
        dial: its dials still open were made for reviews served meanwhile."""
        idle = self.idle.get(host)
        return now - next(iter(idle.values())) if idle else 0.0  # the first went idle first

    @property
    def open_connections(self) -> int:
        return len(self.connections) + len(self.pending)

    @property
    def accept_room(self) -> int:
        """Handshakes waiting for the event loop at which the listener stops accepting (0: never).

        At most half the pending bound, so that accepting never has to evict a connection that only
        waits for the event loop's time."""
        room = self.limits.max_waiting_handshakes
        return min(room, max(1, self.max_pending // 2)) if room > 0 else 0

    def admit(self) -> bool:
        """True if one more connection may open; otherwise it is counted as rejected."""
        if len(self.connections) + len(self.pending) < self.max_connections:
            return True
        self.events.connection_rejected("limit")
        return False

    def budget_for(self, address: str, now: float) -> FrameBudget:
        """A new connection's frame budget: full, unless its address flooded the gateway recently.

        A budget per connection alone would let a client that was cut off for flooding reconnect and
        flood again with a full bucket, as often as it can open connections; its next connection
        starts with the bucket its last one left, refilled since at the budget's rate. The memory of
        such addresses is bounded (``MAX_FLOODERS``, the oldest forgotten first), and an address is
        forgotten once its bucket would be full again. Ordinary clients never get here.
        """
        limits = self.limits
        tokens = float(limits.h2_control_burst)
        saved = self.flooders.get(address)
        if saved is not None:
            tokens = min(tokens, saved[0] + (now - saved[1]) * limits.h2_control_rate)
            if tokens >= limits.h2_control_burst:
                del self.flooders[address]
                saved = None
        budget = FrameBudget(
            limits.h2_control_burst, limits.h2_control_rate, limits.h2_max_settings, now=now, tokens=tokens
        )
        budget.probation = saved is not None
        return budget

    def flooded(self, address: str, budget: FrameBudget, now: float) -> None:
        """A connection from ``address`` went over its frame budget: remember where it ended."""
        self.flooders.pop(address, None)
        # Not below zero: how far over it went says nothing about the next connection, which
        # starts empty and refills at the rate (a flooder gets `rate` frames a second at most).
        self.flooders[address] = (max(0.0, budget.tokens(now)), now)
        while len(self.flooders) > MAX_FLOODERS:
            del self.flooders[next(iter(self.flooders))]

    def begin_pending(self, connection: Pending) -> Pending | None:
        """Register a connection that is not established yet; the one to evict, if full: the oldest
        that still waits on its client (no whole ClientHello yet: a stalled connection), else the
        oldest. Those that wait on the gateway are at most the handshakes under way and the few
        waiting at the gate (``accept_room``), so a bounded look from the oldest finds one."""
        evicted = None
        if len(self.pending) >= self.max_pending:
            oldest = itertools.islice(self.pending, _EVICTION_LOOK)
            evicted = next((c for c in oldest if not c.waits_on_us), None) or next(iter(self.pending))
            del self.pending[evicted]
        self.pending[connection] = None
        return evicted

    def end_pending(self, connection: Pending) -> None:
        """It is established (and registers in ``connections``), or gone."""
        self.pending.pop(connection, None)

    def closed(self) -> None:
        """An established connection has closed."""
        if self.on_closed is not None:
            self.on_closed(len(self.connections) + len(self.pending))

    def start_draining(self) -> None:
        """Keep serving, but tell callers to move away (Connection: close / GOAWAY)."""
        self.draining = True
        for connection in list(self.connections):
            connection.poke()

    def terminate(self) -> None:
        """Stop: idle connections close at once, busy ones once their requests are answered."""
        self.draining = self.terminating = True
        for connection in [*self.connections, *self.pending]:
            connection.poke()

    def accept_failed(self, exc: OSError, *, now: Callable[[], float] = time.monotonic) -> None:
        """accept() ran out of descriptors or memory: count it; log at most once every 10 s."""
        self.events.connection_rejected("accept_error")
        t = now()
        if t - self._accept_log_at >= 10.0:
            self._accept_log_at = t
            log.error(
                "accepting connections failed; backing off (existing connections are still served)",
                error=exc.strerror or str(exc),
                open_connections=len(self.connections),
            )


class FrameBudget:
    """What one connection's frames cost the server beyond the requests they carry, as a token bucket.

    Frames, not bytes, are what cost a Python server: each is parsed, becomes an event and goes
    through the protocol and often the app's queue, whatever its size. A request and its body in
    frames of ordinary size are free; everything else takes tokens from a bucket of ``burst``
    tokens refilled at ``rate`` per second, and a connection whose bucket runs dry is over budget
    (HTTP/2: GOAWAY ENHANCE_YOUR_CALM; HTTP/1.1: closed). The costs (docs/inbound.md, "Frame budget"):

    - 1: SETTINGS, PING, RST_STREAM, WINDOW_UPDATE, PRIORITY, CONTINUATION, GOAWAY, PUSH_PROMISE,
      frames of unknown types, and HEADERS on a stream already open (trailers);
    - a DATA frame that does not end its stream: ``(SMALL - size) / SMALL`` when it carries less than
      ``SMALL`` (4 KiB) — 1 for an empty one, ~1 for a one-byte one, nothing from 4 KiB up (a real
      client fills frames up to 16 KiB); the frame that ends a stream is free;
    - ``RESET_COST`` (10) for every RST_STREAM the *server* sends (``charge``): a stream the client
      made the server reset (DATA after END_STREAM — "MadeYouReset", CVE-2025-8671 —, a refused
      stream, a malformed request) starts and cancels work, and nghttp2, Go and Envoy count them;
    - HTTP/1.1: a chunk of a chunked body, as a DATA frame (``charge``);
    - 1 for a HEADERS frame opening a stream while the client's address is on probation: one of its
      connections went over budget, and its bucket carries over (``InboundRuntime.budget_for``).

    A SETTINGS frame with more than ``max_settings`` entries is over budget by itself. The scanner
    reads only the 9-byte frame headers of the raw byte stream (after the 24-byte connection
    preface), so it costs almost nothing for ordinary traffic. The shape follows nghttp2's
    per-connection "glitch" rate limit.
    """

    __slots__ = (
        "_at",
        "_header",
        "_highest",
        "_max_settings",
        "_preface",
        "_rate",
        "_skip",
        "_tokens",
        "burst",
        "probation",
    )

    # Frame types (RFC 9113 §6).
    _DATA, _HEADERS, _PRIORITY, _RST, _SETTINGS, _PUSH, _PING, _GOAWAY, _WINDOW, _CONT = range(10)
    SMALL: Final = 4096
    RESET_COST: Final = 10.0

    def __init__(
        self,
        burst: int,
        rate: float,
        max_settings: int,
        *,
        now: float = 0.0,
        preface: int = 24,
        tokens: float | None = None,
    ) -> None:
        self.burst = burst
        self._rate = rate
        self._max_settings = max_settings
        self._tokens = float(burst) if tokens is None else tokens
        self._at = now
        self._preface = preface
        self._header = b""
        self._skip = 0
        self._highest = 0  # the highest stream id a HEADERS frame opened
        # The address flooded recently (``InboundRuntime.budget_for``): opening a stream costs too.
        self.probation = False

    @property
    def preface_done(self) -> bool:
        return self._preface == 0

    def tokens(self, now: float) -> float:
        """The tokens left at ``now`` (negative once over budget)."""
        return min(self.burst, self._tokens + (now - self._at) * self._rate)

    def for_chunks(self) -> FrameBudget:
        """The same bucket for an HTTP/1.1 connection: no preface, no SETTINGS to bound."""
        self._preface = 0
        return self

    def charge(self, cost: float, now: float) -> bool:
        """Take ``cost`` tokens at ``now``; False once the connection is over budget."""
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self._rate) - cost
        self._at = now
        return self._tokens >= 0

    def small(self, size: int, now: float) -> bool:
        """A DATA frame (or chunk) of ``size`` bytes that does not end its body; False when over."""
        if size >= self.SMALL:
            return True
        return self.charge((self.SMALL - size) / self.SMALL, now)

    def feed(self, data: bytes, now: float) -> bool:
        """Account for the HTTP/2 ``data`` received at ``now``; False once the client is over budget."""
        pos, end = 0, len(data)
        if self._preface:
            taken = min(self._preface, end)
            self._preface -= taken
            pos = taken
        cost = 0.0
        small = self.SMALL
        while pos < end:
            if self._skip:
                step = min(self._skip, end - pos)
                self._skip -= step
                pos += step
                continue
            need = 9 - len(self._header)
            chunk = data[pos : pos + need]
            pos += len(chunk)
            if len(chunk) < need:
                self._header += chunk
                break
            header = self._header + chunk if self._header else chunk
            self._header = b""
            length = int.from_bytes(header[0:3], "big")
            kind, flags = header[3], header[4]
            self._skip = length
            if kind == self._DATA:
                if not flags & 0x1 and length < small:
                    cost += (small - length) / small
                continue
            if kind == self._HEADERS:
                stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
                if stream > self._highest:  # opens a stream: a request
                    self._highest = stream
                    if not self.probation:
                        continue
            elif kind == self._SETTINGS and length // 6 > self._max_settings:
                return False
            cost += 1
        if cost:
            return self.charge(cost, now)
        return True
