"""``PendingConnection`` replaces the TLS handshake at the start of hypercorn's ``TCPServer.run``:
a connection from accept until it is established — its TLS handshake done (plaintext: its first
bytes arrived) — when the per-connection server (``GatewayTCPServer``) takes over.

Reasons (limits; docs/inbound.md, "Connections that are not established yet"):

- **Cheap while nothing happens.** Anyone who can reach the port can open connections that send
  nothing, or half a ClientHello. Such a connection holds its socket and one task here: no SSL
  object (9 KB), no OpenSSL record buffers (33 KB, allocated by the first handshake step that
  finds nothing to read), no protocol, nursery or timer task. The SSL object is made once the
  whole first TLS record (the ClientHello) is in the socket's receive buffer: the kernel wakes
  the task only then (``SO_RCVLOWAT``), not at every byte, and holds the bytes meanwhile. Measured
  in docs/inbound.md ("Memory"): 46 KB per stalled connection before, a few KB now.
- **A bound of its own** (``InboundRuntime.max_pending``, ``--max-pending-connections``). When it
  is full, the *oldest* pending connection that still waits on its client (no whole ClientHello)
  is reset to make room for the new one: a well-behaved client sends its ClientHello at once, so
  an attacker who keeps the bound full only ever evicts his own connections, where refusing new
  ones would refuse everybody's; one whose ClientHello is in waits on the gateway instead.
- **A deadline of its own** (``--handshake-timeout``), and a reset (no FIN, no TIME_WAIT) for a
  connection cut here: it never said anything worth a graceful close. A handshake that TLS
  refuses is the exception: its alert is what tells the client why, so it gets a FIN after it.

- **Established connections first** (``HandshakeGate``, ``--handshake-burst``): a handshake's
  crypto waits for a token, and tokens come back when the event loop has run everything else, or
  at a fixed small rate while the process uses most of its CPU (``cgroup.CpuShare``); waiting
  handshakes go oldest first. While ``--max-waiting-handshakes`` wait, the listener stops accepting
  (``HandshakeGate.room``): further dials wait in the kernel's accept queue.
- **A stale dial waits for the rate** (``--handshake-rate``): a dial whose client has a connection
  idle at the gateway for ``STALE_DIAL_IDLE`` has no review waiting for it (client-go gives a
  waiting review an idle connection at once); after a burst the apiserver's client has thousands
  of such dials open. They are admitted at most ``rate`` a second, whatever the loop's idle moments
  say; a dial whose client has no connection idle may be some review's only hope and goes as before.
  Off by default: an address can hold several connection pools (docs/inbound.md).
- **A dial its client gave up is not computed.** A TLS connection is checked for its client's FIN
  or reset when it is accepted (the listener) and again after it waited at the gate
  (``client_gone``; Go's transport gives a dial up at its TLS handshake timeout, 10 s under
  client-go from the TCP connect, or when it closes its idle connections): ~0.3 ms of crypto saved
  per dial given up, counted as abandoned.

Byte-level tests: tests/test_server_inbound.py (stalled connections, the bound and its eviction,
the deadline, over real sockets) and tests/test_server_memory.py (their cost, through a real
gateway process).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket as stdlib_socket
import ssl
import struct
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import trio
import trio.testing

from gateway.server.limits import InboundLimits
from gateway.wire.tls_stream import TLSSocketStream

__all__ = [
    "ABANDONED",
    "BUSY_CPU_SHARE",
    "HANDSHAKE_FAILURES",
    "STALE_DIAL_IDLE",
    "HandshakeGate",
    "PendingConnection",
    "client_gone",
    "reset",
]

# ``PendingConnection.establish``'s reason for a connection whose client closed it while its
# handshake waited at the gate (not a limit reached: counted apart).
ABANDONED: Final = "abandoned"
# A handshake begun (the gateway's part of the crypto computed) that did not complete: the client
# closed or reset the connection meanwhile, or TLS refused it.
CLIENT_GONE: Final = "client_gone"
REFUSED: Final = "refused"
HANDSHAKE_FAILURES: Final = frozenset({CLIENT_GONE, REFUSED})

# A TLS record header: content type (22: handshake), version (2 bytes), length (2 bytes).
_RECORD_HEADER: Final = 5
_HANDSHAKE: Final = 0x16
# The largest record a ClientHello may come in (RFC 8446 §5.1: 2^14 bytes of plaintext; §5.2 allows
# 256 more for a protected record). Anything larger is OpenSSL's to refuse, without waiting for it.
_MAX_RECORD: Final = _RECORD_HEADER + (1 << 14) + 256
_LINGER_RESET: Final = struct.pack("ii", 1, 0)

# While the event loop never goes idle (it is behind), ``HandshakeGate`` admits ``--handshake-burst``
# handshakes per this many seconds: ~0.5 ms of crypto in every 50 ms, 1 % of the loop. Each dial
# admitted then brings another review onto a loop that has no time for the ones it has (client-go
# hands it to a review waiting for a connection), so the share is small. Measured with the
# apiserver's own client (docs/performance.md, "after a 2 s burst"): at 10 ms, a burst's backlog
# kept growing for the 10 s after it (p50 1.1 s); at 50 ms, p50 5 ms and p99 back at 15-50 ms
# 1-4 s after it.
BUSY_ADMISSION_INTERVAL: Final = 0.05

# A dial counts as stale (``HandshakeGate.admit``) while a connection of its client's has waited this
# long for a request at the gateway: client-go hands an idle connection to a review that waits at
# once, so none of that client's reviews waits for the dial (a fresh connection counts from when it
# was established; a request the busy loop has not read yet can make one look idle for a moment).
STALE_DIAL_IDLE: Final = 0.1

# The process counts as busy when it used this share of the CPU it may use over at least the last
# 100 ms (``gateway.server.cgroup.CpuShare``); the gate then admits handshakes as when the loop is
# never idle.
BUSY_CPU_SHARE: Final = 0.85


class PendingConnection:
    """One accepted connection that is not established yet (registered in ``InboundRuntime.pending``)."""

    __slots__ = ("_scope", "evicted", "opened", "peer", "sock", "stream", "waits_on_us")

    def __init__(self, sock: stdlib_socket.socket, opened: float, peer: Any = None) -> None:
        self.sock = sock  # non-blocking, as accept() returned it (no trio socket object around it)
        self.opened = opened  # when it was accepted (its first request's head deadline counts from here)
        self.peer = peer  # the client's address, as accept() returned it
        self.stream: Any = None
        self.evicted = False
        # Its ClientHello (or, without TLS, its first bytes) is in: what it waits for now is the
        # gateway (the gate, the crypto), not its client. The pending bound evicts such a
        # connection only when every other one does too (``InboundRuntime.begin_pending``).
        self.waits_on_us = False
        self._scope: trio.CancelScope | None = None

    def evict(self) -> None:
        """Reset it now: the pending bound is full and this is the oldest."""
        self.evicted = True
        self.poke()

    def poke(self) -> None:
        """The listener terminates (or evicts): stop waiting."""
        if self._scope is not None:
            self._scope.cancel()
        else:  # its task has not started yet
            self._scope = trio.CancelScope()
            self._scope.cancel()

    async def establish(
        self,
        tls_context: Callable[[], ssl.SSLContext] | None,
        limits: InboundLimits,
        gate: HandshakeGate | None = None,
        stale: Callable[[], bool] | None = None,
    ) -> tuple[Any, str]:
        """The connection's stream once established, or None and why not (a close reason, or "").

        Its deadline is ``--handshake-timeout`` after accept, or ``--header-read-timeout`` when that
        is shorter (the first request's head counts from accept as well).
        """
        timeout, late = limits.handshake_timeout, "handshake_timeout"
        if limits.header_timeout < timeout:
            timeout, late = limits.header_timeout, "header_timeout"
        scope = self._scope if self._scope is not None else trio.CancelScope()
        self._scope = scope
        scope.deadline = self.opened + timeout
        with scope:
            try:
                if tls_context is None:
                    await trio.lowlevel.wait_readable(self.sock)  # the first bytes of a request
                    return trio.SocketStream(trio.socket.from_stdlib_socket(self.sock)), ""
                await _client_hello(self.sock)
                self.waits_on_us = True
                if gate is not None and await gate.admit(stale) and client_gone(self.sock):
                    self._reset()  # behind the established connections' work, too long for its client
                    return None, ABANDONED
                self.stream = TLSSocketStream(self.sock, tls_context(), server_side=True)
                await self.stream.do_handshake()
                return self.stream, ""
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if self.stream is None:  # before the handshake: no crypto spent, nothing to count
                    self._reset()
                    return None, ""
                cause = exc.__cause__
                if isinstance(cause, ssl.SSLError):
                    await self._close_after_alert()  # refused by TLS: the client must see why
                    return None, CLIENT_GONE if isinstance(cause, ssl.SSLEOFError) else REFUSED
                self._reset()  # the client went away (reset) during the handshake
                return None, CLIENT_GONE
        self._reset()
        if self.evicted:
            return None, "handshake_evicted"
        return None, late if trio.current_time() >= scope.deadline else ""

    async def _close_after_alert(self) -> None:
        """A handshake TLS refused (no client certificate under ``--client-ca``, one it cannot verify,
        no common version or cipher): OpenSSL has written its alert. A reset would overtake it —
        the client's kernel drops the unread alert when the RST arrives, and the client (the
        kube-apiserver) reports ``connection reset by peer`` instead of ``tls: certificate
        required``. So: FIN after the alert, then the client's bytes read and dropped until it
        closes (a TLS 1.3 client sends its request before it reads the alert, and unread bytes at
        close would make the kernel reset too), within the connection's deadline and at most 1 s.
        """
        assert self.stream is not None
        sock = self.stream.socket
        with contextlib.suppress(OSError):
            sock.shutdown(stdlib_socket.SHUT_WR)  # SSLSocket: drops the SSL object, a plain FIN
            with trio.move_on_after(1.0):
                while True:
                    await trio.lowlevel.wait_readable(sock)
                    if not os.read(sock.fileno(), 65536):
                        break
        sock.close()

    def _reset(self) -> None:
        reset(self.stream.socket if self.stream is not None else self.sock)


def reset(sock: stdlib_socket.socket) -> None:
    """Close with a reset (no FIN, no TIME_WAIT): the connection never said anything worth more."""
    with contextlib.suppress(OSError):
        sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_LINGER, _LINGER_RESET)
    sock.close()


def client_gone(sock: stdlib_socket.socket) -> bool:
    """True if the client has closed its side (FIN or reset): ``POLLRDHUP`` without reading.

    Asked of a dial that waited (at the gate, or in the kernel's accept queue while accepting was
    paused): Go's transport gives a dial up at its TLS handshake timeout, or when it closes its
    idle connections."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)
    return bool(poller.poll(0))


async def _client_hello(sock: stdlib_socket.socket) -> None:
    """Wait until the first TLS record is whole in the receive buffer (or the client is gone).

    ``SO_RCVLOWAT`` makes the socket readable only once that many bytes are buffered, so the task
    wakes twice (for the record header, then for the record) however the client splits its bytes.
    What is not a TLS handshake record is left to OpenSSL, which refuses it at once.

    Speed: a client usually sends its ClientHello in one segment right after connecting, so by the
    time the connection's task runs the record is often whole already; a peek finds it and
    nothing is set or waited for (docs/inbound.md, "What a new connection costs").
    """
    if _whole_record(sock):
        return
    sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_RCVLOWAT, _RECORD_HEADER)
    try:
        await trio.lowlevel.wait_readable(sock)
        need = _record_size(sock)
        if need:
            sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_RCVLOWAT, need)
            await trio.lowlevel.wait_readable(sock)
    finally:
        with contextlib.suppress(OSError):
            sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_RCVLOWAT, 1)


# Where the first record is peeked at (one buffer: the event loop runs one peek at a time).
_PEEK: Final = bytearray(_MAX_RECORD)


def _peek(sock: stdlib_socket.socket) -> int:
    """How many bytes of the first record are buffered (0: nothing yet; the client's EOF raises)."""
    try:
        n = sock.recv_into(_PEEK, _MAX_RECORD, stdlib_socket.MSG_PEEK | stdlib_socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return 0
    if n == 0:
        raise trio.BrokenResourceError("the client closed the connection before its ClientHello")
    return n


def _record_size(sock: stdlib_socket.socket) -> int:
    """The first record's size once its header is in, if it is a handshake record still incomplete
    (0: whole, or not for us to wait for)."""
    n = _peek(sock)
    if n < _RECORD_HEADER or _PEEK[0] != _HANDSHAKE:
        return 0
    need = _RECORD_HEADER + int.from_bytes(_PEEK[3:5], "big")
    return need if n < need <= _MAX_RECORD else 0


def _whole_record(sock: stdlib_socket.socket) -> bool:
    """True if the first record (or anything OpenSSL can refuse at once) is already buffered."""
    n = _peek(sock)
    if n < _RECORD_HEADER:
        return False
    if _PEEK[0] != _HANDSHAKE:
        return True
    need = _RECORD_HEADER + int.from_bytes(_PEEK[3:5], "big")
    return n >= need or need > _MAX_RECORD


class HandshakeGate:
    """Admits TLS handshakes behind the established connections' work, the oldest first.

    A server handshake's first step (the ClientHello in, the server's flight out) costs ~250 µs of
    CPU on the event loop, more than a review. Run as soon as each ClientHello is in, a burst of new
    connections delays every established connection's reviews by the whole burst's crypto, the
    client (client-go) dials more connections for the reviews that now wait, and the stall feeds
    itself (docs/performance.md, "Driven as the kube-apiserver drives it"). Here a handshake first
    takes one of ``burst`` tokens; the tokens come back only when the event loop has nothing else
    to run (``trio.testing.wait_all_tasks_blocked``: every established connection's runnable work
    is done), or ``max_delay`` seconds after they ran out when it never gets there. So at most
    ``burst`` handshakes run between two idle moments of the loop, and when it is never idle (it is
    behind, or its CPU is taken by others) at most ``burst`` per ``max_delay``: by default 1 per
    50 ms (``BUSY_ADMISSION_INTERVAL``). Driven by the kube-apiserver's own client, fewer
    handshakes while behind collapsed less: 1 beside 8 at 80 % of capacity answered 23 % more, and
    at 1 per 50 ms p99 was back at 15-50 ms 1-4 s after a burst, where at 1 per 10 ms it stayed at
    1-2.5 s for the 10 s after it (docs/inbound.md).

    The queue is short: while ``--max-waiting-handshakes`` wait, the listener accepts nothing
    (``room``). A dial the loop has no time for then waits in the kernel's accept queue, where it
    costs the gateway nothing and its client may still give it up, instead of being accepted,
    queued here, and reset at its deadline: a reset dial fails the caller's review when no other
    connection frees up for it, a dial left waiting does not (docs/inbound.md). Being short, it is
    served first come, first served, so no handshake waits longer than that many admissions.

    An idle moment of the loop is not spare CPU, though: under a CPU limit (a pod's, a CFS quota)
    the loop goes idle between reviews while the process uses its whole quota, and handshakes
    admitted at each such moment take the time the established connections needed. So while
    ``busy()`` says the process used most of the CPU it may use (``cgroup.CpuShare``), the tokens
    come back every ``max_delay`` seconds as when the loop is never idle. Measured with the apiserver's own
    client, one backend at 3× the capacity on half a CPU, ``--shed-max-in-flight 8``: reviews in time
    median 46 % against 17 %, better in 8 of 9 alternated pairs (docs/performance.md, "Overload").

    Nor is an idle moment a reason to handshake a dial nobody waits for. ``admit``'s ``stale`` says
    that the dial's client has a connection idle (so none of its reviews waits for this dial);
    with ``rate``, such dials take a token from a bucket of one second's handshakes as well, and
    while it is empty the oldest dial that is not stale goes first. After a 2 s burst to 150 % the
    apiserver's own client left 9,000-15,000 dials, and handshaking them at every idle moment kept
    p99 at 10-44 ms for the rest of the phase (docs/inbound.md, "Dials left over from a burst").
    """

    __slots__ = (
        "_allowance",
        "_allowance_at",
        "_burst",
        "_busy",
        "_max_delay",
        "_rate",
        "_room",
        "_tokens",
        "_waiters",
        "_wake",
        "running",
    )

    def __init__(
        self,
        burst: int,
        max_delay: float = BUSY_ADMISSION_INTERVAL,
        busy: Callable[[], bool] | None = None,
        rate: float = 0.0,
    ) -> None:
        self._burst = max(1, burst)
        self._max_delay = max_delay
        self._busy = busy
        # Stale dials (``admit``): at most ``rate`` handshakes a second on average, ``rate`` at once
        # after a quiet second (a token bucket of one second's handshakes; 0: no such bound).
        self._rate = rate
        self._allowance = rate
        self._allowance_at = trio.current_time()
        self._tokens = self._burst
        # Waiting handshakes, oldest first, each with what says whether its client has no review
        # waiting for it (``admit``'s ``stale``).
        self._waiters: deque[tuple[trio.Event, Callable[[], bool] | None]] = deque()
        self._wake = trio.Event()
        self._room: trio.Event | None = None  # set when a waiting handshake leaves the queue
        self.running = False

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def room(self, limit: int) -> None:
        """Return once fewer than ``limit`` handshakes wait (the listener's accept backpressure)."""
        while len(self._waiters) >= limit:
            if self._room is None:
                self._room = trio.Event()
            await self._room.wait()

    def _left(self) -> None:
        if self._room is not None:
            self._room.set()
            self._room = None

    async def admit(self, stale: Callable[[], bool] | None = None) -> bool:
        """Wait for this connection's turn to compute its handshake (cancellable: its deadline).

        ``stale``: True while its client has a connection idle, so that no review of its waits for
        this dial; such a dial waits for the rate (``rate``) while others go at idle moments.
        True if it had to wait (its client may have given up meanwhile)."""
        if self._tokens and not self._waiters and not (self._rate and stale is not None and stale()):
            self._tokens -= 1
            if not self._tokens:
                self._wake.set()
            return False
        turn = trio.Event()
        entry = (turn, stale)
        self._waiters.append(entry)
        self._wake.set()
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # admitted and cancelled at once: the token goes to the next one
                self._tokens += 1
                self._wake.set()
            else:
                self._waiters.remove(entry)
                self._left()
            raise
        return True

    async def run(self) -> None:
        """Give the tokens back at the loop's idle moments, to the oldest waiting handshakes first."""
        self.running = True
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if self._busy is not None and self._busy():
                await trio.sleep(self._max_delay)  # no CPU to spare: idle moments do not count
            else:
                with trio.move_on_after(self._max_delay):
                    await trio.testing.wait_all_tasks_blocked()
            self._tokens = self._burst
            waiters = self._waiters
            while self._tokens and waiters:
                turn = self._next()
                if turn is None:  # only stale dials wait, and this second's allowance is spent
                    # Until the next comes back, or a dial some review waits for comes meanwhile.
                    await trio.sleep(min(1 / self._rate, self._max_delay))
                    continue
                self._tokens -= 1
                turn.set()
            self._left()
            if waiters:
                self._wake.set()  # more to admit at the next idle moment

    def _next(self) -> trio.Event | None:
        """The waiting handshake to admit now: the oldest, unless it is a stale dial (``admit``) and
        the one-second bucket is empty; then the oldest dial some review may wait for, if any."""
        waiters = self._waiters
        if not self._rate:
            return waiters.popleft()[0]
        for entry in waiters:
            turn, stale = entry
            if stale is None or not stale() or self._take_allowance():
                waiters.remove(entry)
                return turn
        return None

    def _take_allowance(self) -> bool:
        """One handshake from the one-second bucket, if it has one."""
        now = trio.current_time()
        allowance = min(self._rate, self._allowance + (now - self._allowance_at) * self._rate)
        self._allowance_at = now
        if allowance >= 1:
            self._allowance = allowance - 1
            return True
        self._allowance = allowance
        return False
