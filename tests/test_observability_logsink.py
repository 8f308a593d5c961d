"""``LineSink`` on real pipes: batching, whole lines in order, the memory bound, flush and close, errors.

Every sink writes to an ``os.pipe``; a test reads the other end itself (a thread drains it, or the
test reads it when it chooses). ``write()`` calls are counted with a wrapper around ``os.write``.
Waiting is done on conditions with generous bounds, never on how fast something was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.observability.logsink import BATCH_BYTES, PIPE_BUF, LineSink


class Writes:
    """``os.write`` that records the size of every call, and what it wrote."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.chunks: list[bytes] = []

    def __call__(self, fd: int, data: Any) -> int:
        written = os.write(fd, data)
        self.sizes.append(written)
        self.chunks.append(bytes(data[:written]))
        return written


def notice(count: int, context: dict[str, Any]) -> bytes:
    return f"NOTICE dropped={count}".encode()


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_end, write_end = os.pipe()
    yield read_end, write_end
    for fd in (read_end, write_end):
        with contextlib.suppress(OSError):
            os.close(fd)


class Drain:
    """A thread reading the pipe to EOF (or until stopped) into ``data``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while chunk := os.read(self.fd, 1 << 20):
            self.data += chunk

    def wait_for(self, end: bytes, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.data.endswith(end):
            assert time.monotonic() < deadline, f"{end!r} never arrived"
            time.sleep(0.01)


def read_available(fd: int) -> bytes:
    """Everything in the pipe now (the read end is made non-blocking for good)."""
    os.set_blocking(fd, False)
    data = bytearray()
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return bytes(data)
        if not chunk:
            return bytes(data)
        data += chunk


def read_until(fd: int, done: Callable[[bytes], bool], timeout: float = 20.0) -> bytes:
    os.set_blocking(fd, False)
    data = bytearray()
    deadline = time.monotonic() + timeout
    while not done(bytes(data)):
        assert time.monotonic() < deadline, f"gave up waiting; read {len(data)} bytes"
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        data += chunk
    return bytes(data)


def lines_of(count: int, size: int = 100) -> list[bytes]:
    return [f"{i:08d}".encode().ljust(size, b".") for i in range(count)]


@pytest.mark.parametrize(
    ("max_write", "size"),
    [
        pytest.param(PIPE_BUF, 100, id="shared output: every write is whole lines of at most PIPE_BUF bytes"),
        pytest.param(BATCH_BYTES, 100, id="one writer: writes of whole lines up to a batch"),
        pytest.param(PIPE_BUF, 3000, id="lines close to PIPE_BUF: one line per write, never split"),
        pytest.param(PIPE_BUF, 10_000, id="a line longer than PIPE_BUF is written alone and whole"),
    ],
)
def test_lines_are_batched_into_fewer_writes_of_whole_lines_in_order(
    pipe: tuple[int, int], max_write: int, size: int
) -> None:
    read_end, write_end = pipe
    writes = Writes()
    drain = Drain(read_end)
    sink = LineSink(write_end, notice=notice, write=writes, max_write=max_write)
    sent = lines_of(500, size)
    for line in sent:
        sink.write(line)
    assert sink.flush(30)
    sink.close()
    os.close(write_end)
    drain.thread.join(30)
    assert bytes(drain.data) == b"".join(line + b"\n" for line in sent)
    assert sink.dropped == 0
    if 2 * (size + 1) <= max_write:  # several lines fit in one write
        assert len(writes.sizes) < len(sent) / 2
    for chunk in writes.chunks:
        assert chunk.endswith(b"\n")  # whole lines only: every write ends where a line ends
        assert len(chunk) <= max(max_write, size + 1)
        if len(chunk) > max_write:
            assert chunk.count(b"\n") == 1  # only a single overlong line exceeds the size


def fill(fd: int) -> int:
    """Fill the pipe with whole lines, as a reader that stopped reading would leave it; bytes written."""
    os.set_blocking(fd, False)
    filled = 0
    try:
        while True:
            filled += os.write(fd, b"f" * 99 + b"\n")  # at most PIPE_BUF: all or nothing
    except BlockingIOError:
        pass
    os.set_blocking(fd, True)
    return filled


def test_a_full_buffer_drops_new_lines_counts_them_and_says_so_before_the_next_line(
    pipe: tuple[int, int],
) -> None:
    read_end, write_end = pipe
    filled = fill(write_end)  # nobody reads: the first write the sink makes blocks
    counted: list[int] = []
    sink = LineSink(write_end, notice=notice, limit_bytes=32 * 1024)
    sink.count_drops(counted.append)
    sent = lines_of(1000, 100)  # 100 KB against a bound of 32 KiB
    for line in sent:
        sink.write(line)
    assert sink.dropped > 0
    assert sum(counted) == sink.dropped
    dropped = sink.dropped
    # The reader comes back: what was accepted comes out, then the notice, then the next line.
    drain = Drain(read_end)
    assert sink.flush(30)
    sink.write(b"after the gap")  # wakes the idle writer by itself (no flush)
    drain.wait_for(b"after the gap\n")
    assert sink.close()
    os.close(write_end)
    drain.thread.join(30)
    lines = bytes(drain.data[filled:]).split(b"\n")[:-1]
    kept = len(sent) - dropped
    assert lines == [*sent[:kept], f"NOTICE dropped={dropped}".encode(), b"after the gap"]


def test_drops_counted_before_a_counter_is_attached_are_given_to_it_at_once(pipe: tuple[int, int]) -> None:
    _, write_end = pipe
    sink = LineSink(write_end, notice=notice, limit_bytes=10)
    for line in lines_of(5):
        sink.write(line)
    counted: list[int] = []
    sink.count_drops(counted.append)
    sink.write(b"x" * 100)
    assert counted == [5, 1]
    sink.close(0.1)


def test_close_writes_everything_it_accepted(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    drain = Drain(read_end)
    sink = LineSink(write_end, notice=notice, linger=10.0)  # would wait 10 s for more lines
    sent = lines_of(50)
    for line in sent:
        sink.write(line)
    assert sink.close()
    sink.write(b"written after close")  # late lines (atexit) are written at once
    os.close(write_end)
    drain.thread.join(30)
    assert bytes(drain.data) == b"".join(line + b"\n" for line in sent) + b"written after close\n"


def test_close_gives_up_on_a_stuck_reader_and_says_so(pipe: tuple[int, int]) -> None:
    _, write_end = pipe
    said: list[str] = []
    sink = LineSink(write_end, notice=notice, stderr=said.append)
    for line in lines_of(2000, 100):  # 200 KB: more than the pipe holds
        sink.write(line)
    assert sink.close(timeout=0.2) is False
    assert len(said) == 1
    assert "is not being read" in said[0]
    assert "exiting without them" in said[0]
    sink.write(b"late")  # the output is stuck: dropped and counted, never blocking
    assert sink.dropped == 1


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("reader closed", id="EPIPE: the reader is gone"),
        pytest.param("fd closed", id="EBADF: the descriptor was closed under the sink"),
    ],
)
def test_write_errors_drop_and_count_the_lines_once_on_stderr_without_spinning(
    pipe: tuple[int, int], how: str
) -> None:
    read_end, write_end = pipe
    if how == "reader closed":
        os.close(read_end)
        fd = write_end
    else:
        fd = 999  # a number no open() in this process will reuse while the test runs
        os.dup2(write_end, fd)
        os.close(fd)
    said: list[str] = []
    counted: list[int] = []
    calls: list[int] = []

    def write(fd: int, data: Any) -> int:
        calls.append(len(data))
        return os.write(fd, data)

    sink = LineSink(fd, notice=notice, stderr=said.append, write=write)
    sink.count_drops(counted.append)
    for line in lines_of(100):
        sink.write(line)
    assert sink.flush(30)
    assert sink.dropped == 100 == sum(counted)
    made = len(calls)
    time.sleep(0.3)  # six linger periods with nothing to write
    assert len(calls) == made  # no retries, no spinning
    for line in lines_of(100):
        sink.write(line)
    assert sink.flush(30)
    assert sink.dropped == 200
    assert len(said) == 1
    expected = os.strerror(errno.EPIPE if how == "reader closed" else errno.EBADF)
    assert expected in said[0]
    sink.close(0.5)


def test_a_non_blocking_descriptor_is_waited_on_not_dropped(pipe: tuple[int, int]) -> None:
    """Someone sharing the file description made it non-blocking: EAGAIN waits for room."""
    read_end, write_end = pipe
    os.set_blocking(write_end, False)
    sink = LineSink(write_end, notice=notice)
    sent = lines_of(2000)  # 200 KB: more than the pipe holds
    for line in sent:
        sink.write(line)
    time.sleep(0.2)  # the writer meets a full pipe (EAGAIN)
    expected = b"".join(line + b"\n" for line in sent)
    got = read_until(read_end, lambda data: len(data) >= len(expected))
    assert got == expected
    assert sink.dropped == 0
    sink.close()


def test_lines_from_several_threads_are_each_whole_and_in_each_threads_order(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    drain = Drain(read_end)
    sink = LineSink(write_end, notice=notice)

    def produce(name: str) -> None:
        for i in range(2000):
            sink.write(f"{name} {i:06d} ".encode().ljust(80, b"-"))

    threads = [threading.Thread(target=produce, args=(f"t{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sink.close()
    os.close(write_end)
    drain.thread.join(30)
    seen: dict[str, list[int]] = {}
    for line in bytes(drain.data).split(b"\n")[:-1]:
        name, number, rest = line.split(b" ")
        assert len(line) == 80 and set(rest) == {ord("-")}
        seen.setdefault(name.decode(), []).append(int(number))
    assert seen == {f"t{n}": list(range(2000)) for n in range(4)}


def test_lines_dropped_at_the_end_are_announced_by_close(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    filled = fill(write_end)
    sink = LineSink(write_end, notice=notice, limit_bytes=1000)
    for line in lines_of(20):
        sink.write(line)
    dropped = sink.dropped
    assert dropped > 0
    drain = Drain(read_end)
    assert sink.close()
    os.close(write_end)
    drain.thread.join(30)
    lines = bytes(drain.data[filled:]).split(b"\n")[:-1]
    assert lines == [*lines_of(20)[: 20 - dropped], f"NOTICE dropped={dropped}".encode()]
