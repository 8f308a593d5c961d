"""``LineSink``: log lines leave the event loop through memory; one thread writes them out in batches.

Why: stdout of a gateway in a cluster is a pipe to the container runtime. A pipe holds 64 KiB; when
its reader is slow or stalls, a blocking ``write()`` on the event loop stops every review in flight
(the gateway is one thread). And one ``write()`` per line is one syscall per review.

How: ``write(line)`` copies the line and its newline to the end of a ``bytearray`` under a lock (no
syscall; the lock is only ever contended for the moment the writer swaps the buffer out). Copying
(rather than keeping the line object in a list) frees each line where it was made, so the allocator
hands the same warm memory to the next one; measured, this saves more than the copy costs, and the
writer needs no ``join``. A single daemon thread takes everything pending once ``BATCH_BYTES`` are
pending or ``LINGER_SECONDS`` after the first line arrived, whichever comes first, and writes it to
the file descriptor with blocking ``os.write`` calls (the GIL is released during the syscall, so a
stuck pipe stops only that thread). Each wake-up of the writer takes the GIL from the event loop for
a moment, so it wakes once per batch.

Why a thread and not a trio task with non-blocking I/O: lines are also written outside trio (start-up,
the ``--workers`` supervisor, threads), and non-blocking I/O needs ``O_NONBLOCK`` on the file
description, which the supervisor, its workers and the parent shell share: their own blocking writes
would start failing with ``EAGAIN``.

Bounded: lines accepted but not yet written (in the buffer or being written) take at most
``LIMIT_BYTES``: 8 MiB, about two minutes of lines at 100 reviews/s and a few seconds at full load
(enough to ride out a log agent's restart), and small next to the manifests' 256 MiB memory limit
even with ``--workers``. The bound is in bytes, not lines: with ``--log-bodies`` a line can be as
large as a review.
Beyond it new lines are dropped and counted (``dropped``, and whatever ``count_drops`` was given:
``webhook_gateway_log_lines_dropped_total``); the first line accepted after a gap is preceded by one
notice line saying how many were dropped (rendered then, by the thread that logs: once per gap), and
``close`` writes one for a gap at the end, so nothing is lost silently.

Whole lines, in order: lines are written in the order ``write`` accepted them, and every
``write()`` syscall holds whole lines only (it ends at a newline; a console-format record with a
multi-line traceback counts as several lines). How many: up to ``max_write`` bytes. A process that is
the only writer of its stdout (``serve`` without ``--workers``) writes up to ``BATCH_BYTES`` at once.
When several processes share one stdout (the ``--workers`` supervisor and its workers), each
``write()`` holds at most ``PIPE_BUF`` (4,096) bytes: POSIX makes such a pipe write atomic, so their
lines never interleave inside a line, even when the pipe is full (a larger write is split wherever
the pipe fills, and another process's write can land in between: a torn line). A single line longer
than ``PIPE_BUF`` is written alone, whole unless another process writes into the same full pipe at
that moment (as before batching). Why not always ``PIPE_BUF``: the writer thread takes the GIL
back after every ``write()``; measured with a busy logging thread (``benchmarks/bench_observability.py
--pipe``), the output costs about 1.0 µs of process CPU per line with 4 KiB writes against 0.75 µs
with 64 KiB ones (1.6 µs when each line is written at once).

Errors: ``EAGAIN`` (someone made the descriptor non-blocking) waits for the descriptor to become
writable; any other error (``EPIPE``: the reader is gone; ``EBADF``) drops the lines of that write,
counts them, says so once on stderr, and the writer carries on with the next batch (at most one
batch per ``LINGER_SECONDS``: it never spins). Nothing propagates to the code that logs.

Shutdown: ``close`` waits at most ``CLOSE_TIMEOUT`` seconds for everything accepted to be written;
when stdout is stuck it says so on stderr and returns, so that the process can exit.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final

PIPE_BUF: Final = select.PIPE_BUF  # 4,096 on Linux: the largest atomic pipe write
BATCH_BYTES: Final = 64 * 1024  # a pipe's capacity: write as soon as this much is pending
LINGER_SECONDS: Final = 0.05  # otherwise this long after the first pending line
LIMIT_BYTES: Final = 8 * 1024 * 1024  # accepted and not yet written; beyond it lines are dropped
CLOSE_TIMEOUT: Final = 2.0  # the most ``close`` waits for a stuck reader

Notice = Callable[[int, dict[str, Any]], bytes]
"""Renders the line saying ``count`` lines were dropped (with the logging context at the gap)."""


def _no_context() -> dict[str, Any]:
    return {}


class LineSink:
    """A bounded buffer of lines in front of a file descriptor, written out by one thread.

    ``write(line)`` never blocks on the descriptor (``line`` without its newline). ``flush`` and
    ``close`` wait, with a bound, until what was accepted before them is written.
    """

    def __init__(
        self,
        fd: int,
        *,
        notice: Notice,
        context: Callable[[], dict[str, Any]] = _no_context,
        limit_bytes: int = LIMIT_BYTES,
        batch_bytes: int = BATCH_BYTES,
        linger: float = LINGER_SECONDS,
        max_write: int = PIPE_BUF,
        write: Callable[[int, Any], int] = os.write,
        stderr: Callable[[str], object] | None = None,
    ) -> None:
        self.fd = fd
        self._notice = notice
        self._context = context
        self._limit = limit_bytes
        self._batch = batch_bytes
        self._linger = linger
        self._max_write = max_write
        self._os_write = write
        self._stderr = stderr if stderr is not None else _to_stderr
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._buf = bytearray()  # accepted lines, each with its newline
        self._notes: list[tuple[int, int]] = []  # (end offset in _buf, dropped lines it reports)
        self._in = 0  # bytes ever accepted ...
        self._out = 0  # ... and done with (written, or dropped after a write error)
        self._gap = 0  # lines dropped since the last accepted one
        self._urgent = False  # flush: write now, without lingering
        self._idle = False  # the writer sleeps until the next line
        self._stopping = False
        self._stuck = False  # a close timed out: the reader does not read
        self.dropped = 0  # lines dropped, ever (buffer full or write error)
        self.writes = 0  # write() syscalls made
        self._on_drop: Callable[[int], object] | None = None
        self._failed = False  # a write error was reported on stderr
        self._thread = threading.Thread(target=self._run, name="webhook-gateway-log-writer", daemon=True)
        self._thread.start()

    # --- the hot path ------------------------------------------------------------------------------

    def write(self, line: bytes) -> None:
        """Queue ``line`` (no trailing newline); drop it and count it when the buffer is full."""
        size = len(line) + 1
        with self._lock:
            if self._in - self._out + size > self._limit:  # also every line after close (limit -1)
                if not self._stopping:
                    self._drop(1)
                    return
                late = not self._stuck
                if not late:
                    self._drop(1)  # counted; the close already said that output is stuck
            else:
                buf = self._buf
                first = not buf
                if self._gap:  # the first line after dropped ones: the notice goes before it
                    self._add_notice()
                buf += line
                buf.append(10)  # b"\n"
                self._in += size
                pending = len(buf)
                # Wake the writer at the first line if it sleeps (it lingers for more), and when a
                # batch is full.
                if (first and self._idle) or (pending >= self._batch and pending - size < self._batch):
                    self._cond.notify()
                return
        if late:  # after a clean close (exit): written at once, in the caller's thread
            self._write_out(line + b"\n", [])

    def _drop(self, count: int) -> None:
        """With the lock held."""
        self.dropped += count
        self._gap += count
        if self._on_drop is not None:
            self._on_drop(count)

    def _add_notice(self) -> None:
        """With the lock held: the line saying ``_gap`` lines were dropped, at the end of the buffer."""
        count, self._gap = self._gap, 0
        try:
            text = self._notice(count, self._context())
        except Exception:  # noqa: BLE001 - the notice must not break logging; say it plainly
            text = f"webhook-gateway: {count} log lines dropped".encode()
        self._buf += text
        self._buf.append(10)
        self._in += len(text) + 1
        self._notes.append((len(self._buf), count))

    def count_drops(self, add: Callable[[int], object]) -> None:
        """Call ``add(n)`` for every ``n`` lines dropped from now on, and once now for those before."""
        with self._lock:
            self._on_drop = add
            if self.dropped:
                add(self.dropped)

    # --- waiting for it ------------------------------------------------------------------------------

    def flush(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Wait until every line accepted so far is written (or dropped); False after ``timeout``."""
        if threading.current_thread() is self._thread:
            return False
        with self._cond:
            target = self._in
            self._urgent = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._out >= target, timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Flush (at most ``timeout`` seconds) and stop the writer thread; True if all was written.

        Otherwise (stdout not read) says so on stderr and leaves the writer blocked (a daemon thread:
        it does not keep the process alive). Lines written after a close are written at once by the
        caller if the close succeeded, else dropped and counted: nothing may block an exit.
        """
        with self._lock:
            if self._stopping:
                return not self._stuck
            if self._gap:  # dropped lines no later line announced: the notice is the last line
                self._add_notice()
        flushed = self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._limit = -1  # every later write takes the slow branch of write()
            self._stuck = not flushed
            pending = self._in - self._out
            self._cond.notify_all()
        if flushed:
            self._thread.join(timeout)
        else:
            self._stderr(
                f"webhook-gateway: log output (fd {self.fd}) is not being read: {pending} bytes of log "
                f"lines not written after {timeout:g} s; exiting without them\n"
            )
        return flushed

    # --- the writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        # It wakes once per batch: when the linger period ends or a batch is full (notified by
        # write()). Only after a whole linger period without lines does it sleep until write() wakes
        # it (_idle), so that an idle gateway does not wake 20 times a second.
        cond = self._cond
        while True:
            with cond:
                # Linger: let a batch build up (fewer, larger writes) unless it is full or wanted now.
                deadline = time.monotonic() + self._linger
                while len(self._buf) < self._batch and not self._urgent and not self._stopping:
                    left = deadline - time.monotonic()
                    if left > 0:
                        cond.wait(left)
                    elif self._buf:
                        break
                    else:  # nothing came for a whole linger period: sleep until the first line
                        self._idle = True
                        cond.wait()
                        self._idle = False
                        deadline = time.monotonic() + self._linger
                if self._stopping and not self._buf:
                    return
                data, self._buf = self._buf, bytearray()
                notes, self._notes = self._notes, []
                self._urgent = False
            try:
                self._write_out(data, notes)
            except Exception as exc:  # noqa: BLE001 - (MemoryError...) the writer must keep going
                self._lost(data.count(b"\n"), 0, exc)
            with cond:
                self._out += len(data)
                cond.notify_all()

    def _write_out(self, data: bytes | bytearray, notes: list[tuple[int, int]]) -> None:
        """Write ``data`` (whole lines) in ``write()`` calls that each end at a newline and hold at
        most ``max_write`` bytes, or one line when it is longer."""
        view = memoryview(data)
        limit = self._max_write
        start, size = 0, len(data)
        while start < size:
            end = start + limit
            if end >= size:
                end = size
            else:
                cut = data.rfind(b"\n", start, end)
                if cut < 0:  # one line longer than max_write: alone, whole
                    cut = data.find(b"\n", end)
                end = cut + 1
            error = self._write_chunk(view[start:end])
            if error is not None:
                noted = [count for offset, count in notes if start < offset <= end]
                self._lost(data.count(b"\n", start, end) - len(noted), sum(noted), error)
            start = end

    def _write_chunk(self, chunk: memoryview) -> OSError | None:
        """All of ``chunk`` (partial writes continue); the error that stopped it, if one did."""
        write = self._os_write
        while chunk:
            try:
                written = write(self.fd, chunk)
            except BlockingIOError:  # O_NONBLOCK set by someone sharing the file description
                self._wait_writable()
                continue
            except OSError as exc:  # EPIPE (reader gone), EBADF (closed), EIO, ENOSPC ...
                return exc
            finally:
                self.writes += 1
            chunk = chunk[written:]
        return None

    def _wait_writable(self) -> None:
        try:
            poller = select.poll()
            poller.register(self.fd, select.POLLOUT)
            poller.poll(100)
        except (OSError, ValueError):
            time.sleep(0.1)

    def _lost(self, lines: int, noted: int, exc: BaseException) -> None:
        """A write failed: its ``lines`` are dropped; the ``noted`` drops its notices reported are not
        reported yet (the next notice counts them again)."""
        with self._lock:
            self._drop(lines)
            self._gap += noted
            report = not self._failed
            self._failed = True
        if report:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._stderr(
                f"webhook-gateway: writing log lines to fd {self.fd} failed ({reason}); lines that "
                "cannot be written are counted in webhook_gateway_log_lines_dropped_total\n"
            )


def _to_stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
