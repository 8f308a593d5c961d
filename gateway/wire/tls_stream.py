"""TLS on a non-blocking ``ssl.SSLSocket``: the gateway's own TLS connections, inbound and to backends.

``trio.SSLStream`` runs OpenSSL over memory BIOs: every read goes socket → Python bytes → incoming
BIO → ``SSLObject.read``, through an exception on each "want read", a trio lock and up to two
checkpoints, and every write the same way back. Here OpenSSL reads from and writes to the socket
itself, in one C call, and Python only waits for readiness when a call would block. Measured on a
request/response loop of an 8 KB request over TLS 1.3 (docs/performance.md): ~70 µs of server CPU
per round trip with ``trio.SSLStream``, ~30–40 µs with this stream. The gateway makes two such round
trips per review (the caller's, and each backend call).

Behaviour kept from how the gateway used ``trio.SSLStream`` (``https_compatible=True``): an EOF
without ``close_notify`` reads as a plain EOF, and closing sends no ``close_notify`` and waits for
nothing, so that a peer that stops reading cannot hold a close. Failures raise
``trio.BrokenResourceError`` with the ``ssl.SSLError``/``OSError`` as ``__cause__`` (what
``gateway.wire.errors`` reads), use after ``aclose`` raises ``trio.ClosedResourceError``, and two tasks
receiving (or sending, or waiting to send) at once raise ``trio.BusyResourceError``. One task may
receive while another sends: HTTP/2 connections have a reader and a writer task. It passes trio's
own stream conformance checks (``trio.testing.check_two_way_stream``, in
tests/test_wire_tls_stream.py) when built with ``schedule_every=1``; by default it batches the
schedule points of operations that did not have to wait (``_schedule_point``), which those checks
do not allow. TLS without ``close_notify`` has no half-close, so ``send_eof`` is not offered.
"""

from __future__ import annotations

import operator
import select
import socket as stdlib_socket
import ssl
from typing import Final

import trio

__all__ = ["TLSSocketStream", "stream_socket"]

# OpenSSL hands back at most one TLS record (16 KiB of plaintext) per read. After a full record
# another read is worth trying at once. After a shorter one it is worth trying only if the socket
# already holds more bytes, which a zero-timeout ``poll`` tells for ~0.3 µs where a read that finds
# nothing costs ~2 µs (a system call and OpenSSL's "want read" exception): a message written in
# several records (Go's HTTP client writes a request through a 4 KiB buffer, and Go's TLS starts
# every connection with ~1 KiB records) then comes in one ``receive_some``, not one per record with
# a pass of trio's run loop between them.
_RECORD: Final = 16_384
_DEFAULT_RECEIVE: Final = 65_536
# An operation that completes without waiting yields to the scheduler only every this many times
# (see TLSSocketStream._schedule_point).
_SCHEDULE_EVERY: Final = 4


class TLSSocketStream(trio.abc.Stream):
    """A client or server TLS connection over a connected TCP socket (taken from ``tcp``: a trio
    ``SocketStream``, or a plain non-blocking socket the caller hands over)."""

    __slots__ = (
        "_closed",
        "_drained",
        "_eof",
        "_handshook",
        "_poller",
        "_read_wants_write",
        "_readable_waiters",
        "_receiving",
        "_schedule_every",
        "_sending",
        "_unyielded",
        "_waiting",
        "_writable_waiters",
        "socket",
    )

    def __init__(
        self,
        tcp: trio.SocketStream | stdlib_socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
        schedule_every: int = _SCHEDULE_EVERY,
    ) -> None:
        """``schedule_every``: an operation that did not have to wait yields to the scheduler every
        this many times (``_schedule_point``); 1 yields every time, as trio's own streams do (what
        ``trio.testing``'s conformance checks expect)."""
        if schedule_every < 1:
            raise ValueError("schedule_every must be >= 1")
        self._schedule_every = schedule_every
        if isinstance(tcp, stdlib_socket.socket):
            raw = tcp  # a connected non-blocking socket, taken as it is (the inbound listener's)
        else:
            # The TCP options trio set (TCP_NODELAY) stay with the descriptor.
            raw = stdlib_socket.socket(fileno=tcp.socket.detach())
            raw.setblocking(False)
        try:
            self.socket: ssl.SSLSocket = context.wrap_socket(
                raw,
                server_side=server_side,
                server_hostname=server_hostname,
                do_handshake_on_connect=False,
                suppress_ragged_eofs=True,
            )
        except BaseException:
            raw.close()
            raise
        self._handshook = False
        self._closed = False
        self._eof = False
        self._receiving = False
        self._sending = False
        self._unyielded = 0
        self._drained = False  # the last read that could wait (_recv) got less than a full record
        self._read_wants_write = False  # TLS needs to write before it can read (rare)
        self._poller: select.poll | None = None  # made at the first short record (_readable_now)
        # Which directions a task of this stream waits on the socket for (bit 1: readable, bit 2:
        # writable), and the other tasks that wait for the same direction meanwhile (see _wait).
        self._waiting = 0
        self._readable_waiters: trio.lowlevel.ParkingLot | None = None
        self._writable_waiters: trio.lowlevel.ParkingLot | None = None

    # --- what callers read after the handshake ----------------------------------------------------

    def selected_alpn_protocol(self) -> str | None:
        return self.socket.selected_alpn_protocol()

    def getpeercert(self, binary_form: bool = False) -> object:
        return self.socket.getpeercert(binary_form)

    # --- the handshake ----------------------------------------------------------------------------

    async def do_handshake(self) -> None:
        """Complete the handshake (idempotent); a failed one raises ``trio.BrokenResourceError``."""
        if self._closed:
            raise trio.ClosedResourceError
        if self._handshook:
            await trio.lowlevel.checkpoint()
            return
        sock = self.socket
        waited = False
        while True:
            try:
                sock.do_handshake()
            except ssl.SSLWantReadError:
                await self._wait(readable=True)
                waited = True
                continue
            except ssl.SSLWantWriteError:
                await self._wait(readable=False)
                waited = True
                continue
            except (ssl.SSLError, OSError) as exc:
                raise trio.BrokenResourceError(f"TLS handshake failed: {exc}") from exc
            break
        self._handshook = True
        if not waited:  # a wait was the schedule point already (one pass of the run loop saved)
            await trio.lowlevel.cancel_shielded_checkpoint()

    # --- trio.abc.Stream --------------------------------------------------------------------------

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        # The argument is checked first, as trio's streams do: a bad one must not wait for data.
        limit = _DEFAULT_RECEIVE if max_bytes is None else operator.index(max_bytes)
        if limit < 1:
            raise ValueError("max_bytes must be >= 1")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this TLS stream")
        self._receiving = True
        try:
            if self._closed:
                raise trio.ClosedResourceError
            await trio.lowlevel.checkpoint_if_cancelled()
            if not self._handshook:
                await self.do_handshake()
            if self._eof:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return b""
            data, waited = await self._read(limit)
            # More of the message may be here already (see _RECORD): take it without a wait.
            size = len(data)
            if size and size < limit and (size >= _RECORD or self._readable_now()):
                parts = [data]
                while size < limit:
                    more = self._read_nowait(limit - size)
                    if not more:
                        break
                    parts.append(more)
                    size += len(more)
                    if len(more) < _RECORD and not self._readable_now():
                        break
                data = b"".join(parts)
            if not waited:
                await self._schedule_point()
            return data
        finally:
            self._receiving = False

    async def _read(self, limit: int) -> tuple[bytes, bool]:
        """Plaintext, and whether the task waited (and so already passed a schedule point)."""
        waited = False
        # Speed: after a short record the socket is almost always empty (a caller's next request, a
        # backend's next reply are yet to come), and trying it first costs a failed system call and
        # an exception on the path of every review. Wait for it instead, unless OpenSSL still holds
        # plaintext of the last record (a reader that asked for less than it): nothing would wake us.
        if self._drained and not self.socket.pending():
            await self._wait(readable=True)
            waited = True
        while (data := self._recv(limit)) is None:
            readable = not self._read_wants_write
            self._read_wants_write = False
            await self._wait(readable=readable)
            waited = True
        return data, waited

    def _recv(self, limit: int) -> bytes | None:
        """One read: plaintext (b"" at EOF), or None when the socket must be waited for first.

        None with ``_read_wants_write`` set: TLS must write before it can read (wait for writable).
        """
        try:
            data = self.socket.recv(limit)
        except ssl.SSLWantReadError:
            return None
        except ssl.SSLWantWriteError:
            self._read_wants_write = True
            return None
        except ssl.SSLZeroReturnError:
            data = b""
        except (ssl.SSLError, OSError) as exc:
            if self._closed:
                raise trio.ClosedResourceError from exc
            raise trio.BrokenResourceError(f"TLS read failed: {exc}") from exc
        if not data:
            self._eof = True
        self._drained = len(data) < _RECORD
        return data

    def _readable_now(self) -> bool:
        """Whether the socket holds bytes now (perhaps only part of a record), without reading them."""
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self.socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def _read_nowait(self, limit: int) -> bytes:
        """More plaintext if OpenSSL can produce it without blocking; b"" otherwise (or at EOF)."""
        try:
            data = self.socket.recv(limit)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return b""
        except ssl.SSLZeroReturnError:
            data = b""
        except (ssl.SSLError, OSError):
            return b""  # the next receive_some reports it
        if not data:
            self._eof = True
        return data

    def receive_now(self, max_bytes: int = _DEFAULT_RECEIVE) -> bytes | None:
        """Plaintext OpenSSL can hand over without waiting (b"" at EOF), or None: ``wait_readable`` first.

        For a task's own read loop (an HTTP/2 connection's reader, an inbound connection): the
        loop's wait is one ``wait_readable`` instead of ``receive_some``'s layers, which trio walks
        through again every time the task is woken. Like ``receive_some`` it reads on after a short
        record only if the socket holds more already (``_RECORD``), and it asks for a wait every few
        reads that found data ready, so that a peer that always has data does not keep the loop
        from yielding.
        """
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this TLS stream")
        if self._closed:
            raise trio.ClosedResourceError
        if self._eof:
            return b""
        if not self._handshook:
            return None
        if self._drained and not self.socket.pending() and not self._readable_now():
            self._drained = False
            return None
        self._unyielded += 1
        if self._unyielded > self._schedule_every:
            return None
        return self._recv(max_bytes)

    async def wait_readable(self) -> None:
        """Wait until ``receive_now`` may have something: the handshake done, the socket ready."""
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this TLS stream")
        if self._closed:
            raise trio.ClosedResourceError
        self._receiving = True
        try:
            if not self._handshook:
                await self.do_handshake()
                return
            self._unyielded = 0
            if self.socket.pending():  # plaintext is here already: only yield to the others
                await trio.lowlevel.checkpoint()
                return
            readable = not self._read_wants_write
            self._read_wants_write = False
            await self._wait(readable=readable)
        finally:
            self._receiving = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this TLS stream")
        self._sending = True
        try:
            if self._closed:
                raise trio.ClosedResourceError
            await trio.lowlevel.checkpoint_if_cancelled()
            if not self._handshook:
                await self.do_handshake()
            sock = self.socket
            view = memoryview(data)
            waited = False
            while view:
                try:
                    # OpenSSL (in the mode CPython sets) writes all of it or, blocked, nothing it
                    # reports; a retry must pass the same bytes again, which this loop does.
                    sent = sock.send(view)
                except ssl.SSLWantWriteError:
                    await self._wait(readable=False)
                    waited = True
                    continue
                except ssl.SSLWantReadError:
                    await self._wait(readable=True)
                    waited = True
                    continue
                except (ssl.SSLError, OSError) as exc:
                    if self._closed:
                        raise trio.ClosedResourceError from exc
                    raise trio.BrokenResourceError(f"TLS write failed: {exc}") from exc
                view = view[sent:]
            if not waited:
                await self._schedule_point()
        finally:
            self._sending = False

    def send_now(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` without waiting, if the socket takes it: how many bytes were written.

        0 means nothing could be written now and ``send_all`` must be given the same bytes (OpenSSL
        may have taken part of them into a record it is still writing). No schedule point and no
        cancel scope: a caller writing a small reply on a socket with room (the common case) skips
        both; one that must wait falls back to ``send_all``, which waits under its own deadline.
        """
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this TLS stream")
        if self._closed:
            raise trio.ClosedResourceError
        if not self._handshook:
            return 0
        try:
            return self.socket.send(data)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return 0
        except (ssl.SSLError, OSError) as exc:
            raise trio.BrokenResourceError(f"TLS write failed: {exc}") from exc

    async def wait_send_all_might_not_block(self) -> None:
        # A send-side operation like send_all: the two at once in two tasks are refused as busy.
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this TLS stream")
        self._sending = True
        try:
            if self._closed:
                raise trio.ClosedResourceError
            await self._wait(readable=False)
        finally:
            self._sending = False

    async def aclose(self) -> None:
        """Close at once: no ``close_notify`` is sent or awaited (safe under cancellation)."""
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self.socket)  # wakes a task waiting on it with ClosedResourceError
            self.socket.close()
        await trio.lowlevel.checkpoint()

    async def _schedule_point(self) -> None:
        """Let other tasks run after an operation that did not have to wait, every few times.

        trio's own streams yield to the scheduler on every call; an operation that had to wait for
        the socket has yielded already. One that did not need not yield each time for fairness:
        a task finding data ready again and again still lets every other task run at least every
        ``schedule_every`` operations (4 by default). Each yield skipped is one pass through trio's
        run loop (an ``epoll_wait`` and a task switch) saved on the path of every review.
        """
        self._unyielded += 1
        if self._unyielded >= self._schedule_every:
            self._unyielded = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def _wait(self, *, readable: bool) -> None:
        """Wait until the socket is readable (or writable).

        The reader task waits for readable and the writer task for writable. TLS can make a read
        want to write (or a write want to read) for a moment, and trio lets one task at a time wait
        on a socket for each direction. A second task that needs the same direction meanwhile waits
        for the first one's wake-up (or cancellation, or the stream's close) instead; both then retry
        their operation, which waits again if it still must.
        """
        self._unyielded = 0
        bit = 1 if readable else 2
        if self._waiting & bit:
            await self._co_waiters(readable).park()
            return
        self._waiting |= bit
        try:
            if readable:
                await trio.lowlevel.wait_readable(self.socket)
            else:
                await trio.lowlevel.wait_writable(self.socket)
        finally:
            self._waiting &= ~bit
            if readable:
                waiters, self._readable_waiters = self._readable_waiters, None
            else:
                waiters, self._writable_waiters = self._writable_waiters, None
            if waiters is not None:
                waiters.unpark_all()

    def _co_waiters(self, readable: bool) -> trio.lowlevel.ParkingLot:
        """Where a second task waiting for the same direction waits (made when first needed)."""
        if readable:
            if self._readable_waiters is None:
                self._readable_waiters = trio.lowlevel.ParkingLot()
            return self._readable_waiters
        if self._writable_waiters is None:
            self._writable_waiters = trio.lowlevel.ParkingLot()
        return self._writable_waiters


def stream_socket(stream: trio.abc.Stream) -> stdlib_socket.socket | trio.socket.SocketType | None:
    """The socket under a gateway connection stream (plain, ``trio.SSLStream`` or TLS), or None."""
    if isinstance(stream, TLSSocketStream):
        return stream.socket
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if isinstance(inner, trio.SocketStream):
        return inner.socket
    return None
