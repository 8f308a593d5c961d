"""One HTTP/2 connection to a backend: many calls multiplexed over ``h2wire.ClientConnection``.

Calls only change the framer's state (synchronously: whole frames into its output) and wait; the
socket belongs to two tasks that live in the pool's nursery: a reader (bytes in → framer → calls
woken) and a writer (drains the framer's output). So a cancelled call can never leave a
half-written frame on the wire: it just queues RST_STREAM(CANCEL) (trio: cancellation at any
checkpoint; the framer: sans-IO).

Waiting is done with trio's low-level park/reschedule on the call's own task rather than an Event
per call (the call is parked for its reply, or for a send window): one task, one reason at a time.
A call given a ``deadline`` is bounded by the connection's own timer task (``_deadline_loop``)
instead of a cancel scope of its own: a trio cancel scope costs ~8 µs to enter and leave, the
timer's heap entry well under one.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence

import trio

from gateway.errors import TransportError, TransportErrorKind, TransportTimeout
from gateway.transport import h2wire
from gateway.transport.h2wire import LiteralEncoder as _LiteralEncoder  # noqa: F401 - tests know this name
from gateway.transport.wire import Header, HTTPResponse, RetryableError
from gateway.wire.errors import socket_peer, stream_error
from gateway.wire.tls_stream import TLSSocketStream

RECEIVE_BYTES = 65536
STREAM_WINDOW = 4 * 1024 * 1024  # what each call may receive before we acknowledge it
CONNECTION_WINDOW = 16 * 1024 * 1024
PROTOCOL_ERROR_GRACE_SECONDS = 1.0  # to write GOAWAY(code) after a peer's protocol error
_MAX_STREAM_ID = h2wire.MAX_STREAM_ID
_current_task = trio.lowlevel.current_task
_reschedule = trio.lowlevel.reschedule
_wait_task_rescheduled = trio.lowlevel.wait_task_rescheduled


class _Call(h2wire.Stream):
    """One call's stream, the task parked on it (if any), and the body the send windows have not
    taken yet (while it waits its turn in the connection's ``_window_waiters``)."""

    __slots__ = ("task", "unsent")

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.task: trio.lowlevel.Task | None = None
        self.unsent: memoryview | None = None

    def forget(self, _: object) -> trio.lowlevel.Abort:
        """The abort of a parked call (cancelled): it just forgets the task."""
        self.task = None
        return trio.lowlevel.Abort.SUCCEEDED


def _wake(call: _Call) -> None:
    task = call.task
    if task is not None:
        call.task = None
        _reschedule(task)


async def _park(call: _Call) -> None:
    """Sleep until ``_wake(call)``; cancellable (the abort just forgets the task).

    ``request`` inlines these two lines for the reply's wait (one coroutine fewer per call).
    """
    call.task = _current_task()
    await _wait_task_rescheduled(call.forget)


class HTTP2Connection:
    """An HTTP/2 client connection; the pool reserves a stream slot before each ``request``."""

    def __init__(self, stream: trio.abc.Stream, label: str, on_change: Callable[[], None]) -> None:
        self._stream = stream
        self._peer = socket_peer(stream)
        self._on_change = on_change
        self._core = h2wire.ClientConnection(stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW)
        self._writer: trio.lowlevel.Task | None = None  # the writer task while it waits for output
        # TLS streams can write without waiting (``_flush_now``); other streams always use the writer.
        self._send_now = stream.send_now if isinstance(stream, TLSSocketStream) else None
        # Calls whose body waits for send window, first come first served: the reader frames their
        # rest itself when a WINDOW_UPDATE arrives (``_send_waiting``) and wakes each once it is all
        # queued. Calls given up while waiting stay until they reach the front, or until they are
        # half of the queue (``_given_up``): a window that never opens cannot make it grow.
        self._window_waiters: deque[_Call] = deque()
        self._window_given_up = 0  # calls in ``_window_waiters`` that no longer wait
        # Calls with a deadline, earliest first (calls that ended stay until they reach the top,
        # or until the heap is compacted in ``_bound``); the timer sleeps in ``_deadline_scope``.
        self._deadlines: list[tuple[float, int, _Call]] = []
        self._deadline_count = 0
        self._deadline_scope: trio.CancelScope | None = None
        self._ready = trio.Event()
        self._scope = trio.CancelScope()
        self._closing = False
        self._failure: str | None = None
        self._failure_kind: TransportErrorKind = "transport"
        self.label = label
        self.reserved = 0  # stream slots handed out by the pool and not yet released
        self.requests = 0
        self.goaway = False
        self.closed = False
        self.idle_since = trio.current_time()

    def __repr__(self) -> str:
        if self.closed:
            state = "CLOSED"
        elif self.goaway or self._closing:
            state = "GOAWAY"
        else:
            state = "ACTIVE" if self.reserved else "IDLE"
        waiting = f" waiting={len(self._window_waiters)}" if self._window_waiters else ""  # for window
        counts = f"streams={self.reserved} requests={self.requests}{waiting}"
        return f"<HTTP2Connection {self.label} {state} {counts}>"

    # --- what the pool asks -------------------------------------------------------------------

    @property
    def max_streams(self) -> int:
        """The peer's MAX_CONCURRENT_STREAMS (its SETTINGS arrive before the connection is used)."""
        return self._core.peer_max_concurrent_streams

    @property
    def ready(self) -> bool:
        """The peer's SETTINGS arrived (or the connection failed): the pool may use or drop it."""
        return self._ready.is_set()

    def can_open_stream(self) -> bool:
        """True when a new call may be multiplexed onto this connection now."""
        return (
            self._ready.is_set()
            and not (self.closed or self.goaway or self._closing)
            and self.reserved < self.max_streams
            and self._core.last_stream_id + 2 * (self.reserved + 1) <= _MAX_STREAM_ID
        )

    async def wait_ready(self) -> None:
        """Wait for the peer's first SETTINGS; ``TransportError`` if the connection fails first."""
        await self._ready.wait()
        if self._failure is not None:
            raise TransportError(self._failure, self._failure_kind)

    def close_gracefully(self) -> None:
        """Send GOAWAY, then close once it is written; calls in flight fail."""
        if not self.closed and not self._closing:
            self._closing = True
            self._core.close()
            self._flush()

    def abort(self) -> None:
        """Close at once: the reader and writer stop, every call in flight fails."""
        self._fail("http2: client connection force closed")
        self._scope.cancel()

    # --- the tasks in the pool's nursery ------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read and write until the connection ends; always closes the stream."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_loop, nursery.cancel_scope)
                    nursery.start_soon(self._deadline_loop)
                    task_status.started()
                    await self._read_loop()
                    if self._closing:  # a protocol error: let the writer send our GOAWAY first
                        nursery.cancel_scope.deadline = trio.current_time() + PROTOCOL_ERROR_GRACE_SECONDS
                    else:
                        nursery.cancel_scope.cancel()
        finally:
            self._fail(self._failure or "http2: client connection lost")
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self._stream)

    async def _read_loop(self) -> None:
        core = self._core
        stream = self._stream
        tls = stream if type(stream) is TLSSocketStream else None
        while True:
            data: bytes | bytearray | None
            try:
                if tls is not None:  # speed: one wait per wake-up, not receive_some's layers
                    data = tls.receive_now(RECEIVE_BYTES)
                    if data is None:
                        await tls.wait_readable()
                        continue
                else:
                    data = await stream.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._fail(*_cause_and_kind(stream_error(exc, "read", self._peer)))
                return
            if not data:
                self._fail("unexpected EOF")
                return
            try:
                events = core.receive(bytes(data) if type(data) is not bytes else data)
            except h2wire.ProtocolError as exc:
                self._fail(f"http2: peer protocol error: {exc}")
                self._closing = True  # the framer queued GOAWAY with the error's code
                self._flush()
                return
            for event in events:
                if isinstance(event, _Call):
                    _wake(event)
                elif event is h2wire.WINDOW_OPENED:
                    if self._window_waiters:
                        self._send_waiting()
                elif event is h2wire.SETTINGS_CHANGED:
                    self._ready.set()
                    self._on_change()
                elif isinstance(event, h2wire.GoAway):
                    self._on_goaway()
            self._flush()

    async def _write_loop(self, scope: trio.CancelScope) -> None:
        core = self._core
        try:
            while True:
                if core.output:
                    await self._stream.send_all(core.data_to_send())
                    continue
                if self._closing:
                    break
                self._writer = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._forget_writer)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(*_cause_and_kind(stream_error(exc, "write", self._peer)))
        scope.cancel()

    async def _deadline_loop(self) -> None:
        """Fail each call whose deadline passed (``TransportTimeout``) and wake it."""
        heap = self._deadlines
        while True:
            now = trio.current_time()
            while heap and (heap[0][2].done or heap[0][0] <= now):
                call = heapq.heappop(heap)[2]
                if call.fail(TransportTimeout()):
                    _wake(call)
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as scope:
                self._deadline_scope = scope
                await trio.sleep_forever()
            self._deadline_scope = None

    def _bound(self, call: _Call, deadline: float) -> None:
        """Put ``call`` under the timer: it fails with ``TransportTimeout`` at ``deadline``."""
        heap = self._deadlines
        if len(heap) > 2 * self.reserved + 64:  # mostly calls that ended: drop them
            heap[:] = [entry for entry in heap if not entry[2].done]
            heapq.heapify(heap)
        self._deadline_count += 1
        heapq.heappush(heap, (deadline, self._deadline_count, call))
        scope = self._deadline_scope
        # Only an earlier deadline moves the timer; a later one is found when it wakes.
        if scope is not None and deadline < scope.deadline:
            scope.deadline = deadline

    def _forget_writer(self, _: object) -> trio.lowlevel.Abort:
        self._writer = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _flush(self) -> None:
        """Wake the writer if it waits and there is output (or it should stop)."""
        writer = self._writer
        if writer is not None and (self._core.output or self._closing):
            self._writer = None
            trio.lowlevel.reschedule(writer)

    def _flush_now(self) -> None:
        """A call's frames: written by the calling task itself when the writer is idle and the
        socket takes them at once; else handed to the writer.

        Speed: waking the writer is a task switch on the path of every call (~10 µs, and latency);
        a non-blocking write that either completes or leaves the bytes queued cannot be
        interrupted, so a cancelled call still never leaves half a frame on the wire. What the
        socket does not take goes back to the front of the output: TLS must be given the same
        bytes again (``TLSSocketStream.send_now``), and the writer's next write starts with them.
        """
        core = self._core
        send_now = self._send_now
        # Also with other calls in flight on the connection (concurrent reviews): leaving their
        # frames to the writer, for one write to carry several, cost more than it saved. Measured
        # in interleaved A/B (docs/performance.md, sixth session): fanout5 862 -> 825 µs per review
        # (7 rounds of 7 lower), mutating3 737 -> 720, passthrough unchanged: too few calls shared a
        # pass of the run loop with another call to the same backend for the shared write to pay.
        if send_now is None or self._writer is None or self._closing or not core.output:
            self._flush()
            return
        data = core.data_to_send()
        try:
            sent = send_now(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            sent = 0  # the writer's own write meets the same error and fails the connection
        if sent < len(data):
            core.output.insert(0, memoryview(data)[sent:] if sent else data)
            self._flush()

    def _fail(self, cause: str, kind: TransportErrorKind = "transport") -> None:
        if self.closed:
            return
        self.closed = True
        self._failure = cause
        self._failure_kind = kind
        for call in self._core.streams.values():
            if isinstance(call, _Call) and call.fail(TransportError(cause, kind)):
                _wake(call)
        self._ready.set()
        self._wake_window_waiters()
        self._on_change()

    def _wake_window_waiters(self) -> None:
        waiters, self._window_waiters = self._window_waiters, deque()
        self._window_given_up = 0
        for call in waiters:
            _wake(call)

    def _given_up(self) -> None:
        """A call left ``_window_waiters`` without its turn (cancelled, or answered or failed
        first): once such calls are half of the queue, drop them all (amortised O(1) each)."""
        self._window_given_up += 1
        if 2 * self._window_given_up > len(self._window_waiters):
            self._window_waiters = deque(call for call in self._window_waiters if call.unsent is not None)
            self._window_given_up = 0

    def _send_waiting(self) -> None:
        """The send windows opened: frame the waiting bodies in turn while the connection window
        lasts, waking each call whose body is all queued.

        Speed: waking every waiter at each WINDOW_UPDATE to look at the window for itself cost
        waiters × updates task switches, a quarter of the loop's CPU once a busy backend's window
        ran out under a burst (tests/test_transport_http2.py counts the wake-ups)."""
        waiters = self._window_waiters
        core = self._core
        for _ in range(len(waiters)):
            if core.send_window <= 0:
                return
            call = waiters[0]
            unsent = call.unsent
            if unsent is None:  # given up while it waited (``_given_up`` counted it)
                waiters.popleft()
                self._window_given_up -= 1
                continue
            if call.done:  # answered or failed while it waited: nothing more to send
                call.unsent = None
                waiters.popleft()
                _wake(call)
                continue
            sent = core.send_data(call, unsent, end_stream=True)
            # All of it queued; or none although its stream had room: the stream was reset.
            if sent == len(unsent) or (sent == 0 and call.send_window > 0):
                call.unsent = None
                waiters.popleft()
                _wake(call)
            else:  # its own stream's window ran out (or the connection's): the next one's turn
                call.unsent = unsent[sent:]
                waiters.rotate(-1)

    def _on_goaway(self) -> None:
        # The framer already failed the streams above last_stream_id (RetryableError: they were
        # never processed and may be resent elsewhere); those at or below it keep receiving.
        self.goaway = True
        self._ready.set()
        if not self._core.streams:
            self.close_gracefully()
        self._on_change()

    # --- one call -----------------------------------------------------------------------------

    async def request(
        self,
        headers: Sequence[Header],
        body: bytes,
        *,
        max_response_bytes: int,
        deadline: float = math.inf,
    ) -> HTTPResponse:
        """Send one call on a new stream and wait for the whole reply.

        On cancellation (the caller's deadline or the caller going away) the stream is reset with
        CANCEL; so it is when ``deadline`` passes first, and ``TransportTimeout`` is raised.
        ``RetryableError`` marks a stream the peer refused or dropped unprocessed (GOAWAY).
        """
        if self.closed or self.goaway or self._closing:
            raise RetryableError(self._failure or "http2: client connection lost")
        core = self._core
        call = _Call(max_response_bytes)
        try:
            core.open_stream(call, headers, end_stream=not body)
        except h2wire.NoStreamAvailableError as exc:
            raise RetryableError("http2: no stream available on this connection") from exc
        self.requests += 1
        if deadline != math.inf:
            self._bound(call, deadline)
        try:
            # Queued before anything is written: HEADERS and (usually) the whole body go out in
            # one write. Speed: a body the send windows take at once needs no coroutine of its own.
            if body:
                sent = core.send_data(call, memoryview(body), end_stream=True)
                if sent < len(body):
                    await self._send_body(call, body, sent)
            self._flush_now()
            while not call.done:  # ``_park``, inlined
                call.task = _current_task()
                await _wait_task_rescheduled(call.forget)
        finally:
            if not self.closed:
                core.reset(call)  # only if still open: cancelled, or answered before the body was sent
                self._flush()
        if call.error is not None:
            raise call.error
        return HTTPResponse(call.status, call.headers, call.response_body(), "HTTP/2")

    async def _send_body(self, call: _Call, body: bytes, offset: int) -> None:
        """The rest of a body the send windows did not take at once (``request`` queued ``offset``):
        it waits its turn behind the calls already waiting, and the reader frames it."""
        call.unsent = memoryview(body)[offset:]
        self._window_waiters.append(call)
        self._flush()
        try:
            while call.unsent is not None and not call.done:  # answered or failed early: stop
                await _park(call)
        finally:
            if call.unsent is not None:  # still listed: cancelled, or answered or failed first
                call.unsent = None
                if not self.closed:
                    self._given_up()


def _cause_and_kind(error: TransportError) -> tuple[str, TransportErrorKind]:
    return error.cause, error.kind
