"""CPU to read one request that arrives in several TLS records: the socket's ``ssl`` against a memory BIO.

    python benchmarks/bench_tls_read.py [--records 4096,4096,208] [--requests 4000] [--repeat 5]

kube-apiserver's client writes a request through a 4 KiB buffer, and each write is a TLS record
(early in a connection Go makes them ~1 KiB), so an ~8 KB review comes as several records. Python's
``ssl`` on a socket reads a record with two ``read`` system calls (its header, then its body) and
has no read-ahead; the gateway's stream (``gateway/wire/tls_stream.py``) then asks with a
zero-timeout ``poll`` whether more is already there. A memory BIO (``ssl.MemoryBIO``) would take
every byte there with one ``recv`` and decrypt the records from memory.

Both readers, one after the other on a new connection each, with the same client process writing
each request as the given records and waiting for a one-byte answer (one request at a time, like a
review on a kept connection); reported: the serving process's CPU per request (``time.process_time``,
the kernel's part included), the median of the repeats, and the difference.
"""

from __future__ import annotations

import argparse
import multiprocessing
import select
import socket
import ssl
import statistics
import time
from collections.abc import Callable

import trustme

_WARM = 200


def _client(port: int, ca_pem: str, records: list[int], requests: int) -> None:
    context = ssl.create_default_context(cadata=ca_pem)
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            body = b"x" * sum(records)
            for _ in range(requests):
                offset = 0
                for size in records:  # one write, one record
                    tls.sendall(body[offset : offset + size])
                    offset += size
                if tls.recv(1) != b"k":
                    raise SystemExit("the server answered something else")


Reader = tuple[Callable[[], None], Callable[[bytes], None]]  # read one request, answer it
_SILENCE = 10.0  # seconds a reader waits for the client before it gives up
_GONE = "the client closed the connection"


def _poller(sock: socket.socket) -> select.poll:
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return poller


def _wait(poller: select.poll, silence: float) -> None:
    """Until the socket is readable; a client silent for ``silence`` seconds ends the run."""
    if not poller.poll(silence * 1000):
        raise SystemExit(f"the client sent nothing for {silence:g} s")


def _ends_when_gone(step: Callable[[], None]) -> Callable[[], None]:
    """``step``, with the client's reset or a broken pipe ending the run as its close does (a close
    with bytes still unread on its side, such as the server's TLS 1.3 tickets, is a reset)."""

    def run() -> None:
        try:
            step()
        except ConnectionError:
            raise SystemExit(_GONE) from None

    return run


def socket_reader(
    raw: socket.socket, context: ssl.SSLContext, size: int, *, silence: float = _SILENCE
) -> Reader:
    """The gateway's discipline: ``recv`` on the ``SSLSocket``, and on after a short record only if
    a zero-timeout ``poll`` says more bytes are there."""
    raw.settimeout(silence)  # the handshake blocks, at most this long
    tls = context.wrap_socket(raw, server_side=True)
    tls.setblocking(False)
    poller = _poller(tls)

    def recv() -> int:
        data = tls.recv(65536)
        if not data:
            raise SystemExit(_GONE)
        return len(data)

    def read() -> None:
        got = 0
        while got < size:
            try:
                got += recv()
            except ssl.SSLWantReadError:
                _wait(poller, silence)
                continue
            while got < size and poller.poll(0):
                try:
                    got += recv()
                except ssl.SSLWantReadError:
                    break

    return _ends_when_gone(read), tls.send


def bio_reader(
    raw: socket.socket, context: ssl.SSLContext, size: int, *, silence: float = _SILENCE
) -> Reader:
    """One ``recv`` of whatever is there into a memory BIO, the records decrypted from it."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=True)
    raw.setblocking(False)
    poller = _poller(raw)

    def fill() -> None:
        while True:
            try:
                data = raw.recv(262144)
            except BlockingIOError:
                _wait(poller, silence)
                continue
            if not data:
                raise SystemExit(_GONE)
            incoming.write(data)
            return

    def handshake() -> None:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                raw.sendall(outgoing.read())
                fill()
        raw.sendall(outgoing.read())

    _ends_when_gone(handshake)()

    def read() -> None:
        got = 0
        while got < size:
            try:
                data = tls.read(65536)
            except ssl.SSLWantReadError:
                raw.sendall(outgoing.read())  # TLS 1.3 session tickets, once
                fill()
                continue
            if not data:  # the client's close_notify
                raise SystemExit(_GONE)
            got += len(data)

    def answer(data: bytes) -> None:
        tls.write(data)
        raw.sendall(outgoing.read())

    return _ends_when_gone(read), answer


def server_context() -> tuple[str, ssl.SSLContext]:
    """A new CA's PEM and a server context with an ECDSA P-256 certificate for 127.0.0.1 it issued."""
    ca = trustme.CA(key_type=trustme.KeyType.ECDSA)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", key_type=trustme.KeyType.ECDSA).configure_cert(context)
    return ca.cert_pem.bytes().decode(), context


def measure(kind: str, records: list[int], requests: int) -> float:
    """Microseconds of this process's CPU per request read with ``kind`` ("socket" or "bio")."""
    ca_pem, context = server_context()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = multiprocessing.get_context("spawn").Process(
            target=_client,
            args=(listener.getsockname()[1], ca_pem, records, _WARM + requests),
        )
        client.start()
        listener.settimeout(_SILENCE)
        try:
            raw, _ = listener.accept()
        except TimeoutError:
            client.kill()
            raise SystemExit(f"the client did not connect within {_SILENCE:g} s") from None
    cpu = None
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        make = socket_reader if kind == "socket" else bio_reader
        read, answer = make(raw, context, sum(records))
        for _ in range(_WARM):
            read()
            answer(b"k")
        started = time.process_time()
        for _ in range(requests):
            read()
            answer(b"k")
        cpu = time.process_time() - started
    finally:
        raw.close()
        client.join(timeout=60 if cpu is not None else 0)  # a failed run does not wait for it
        if client.is_alive():
            client.kill()
            client.join()
    if client.exitcode != 0:
        raise SystemExit(f"the client failed (exit code {client.exitcode})")
    return cpu * 1e6 / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--records",
        default="4096,4096,208",
        help="the request's TLS records, in bytes (default: an 8,400-byte review in Go's 4 KiB writes)",
    )
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    records = [int(size) for size in args.records.split(",")]
    if not records or min(records) < 1:
        parser.error("--records: one or more sizes in bytes, each at least 1")
    runs: dict[str, list[float]] = {"socket": [], "bio": []}
    for _ in range(args.repeat):
        for kind, results in runs.items():  # alternated, so that a busy spell hits both
            results.append(measure(kind, records, args.requests))
    ours, bio = (statistics.median(runs[kind]) for kind in ("socket", "bio"))
    shape = f"{sum(records)} bytes in {len(records)} TLS records"
    print(f"request of {shape}, CPU per request (medians of {args.repeat}):")
    print(f"  ssl on the socket, poll between records (the gateway's): {ours:6.1f} µs")
    print(f"  one recv into a memory BIO:                             {bio:6.1f} µs")
    print(f"  the memory BIO saves {ours - bio:.1f} µs per request")


if __name__ == "__main__":
    main()
