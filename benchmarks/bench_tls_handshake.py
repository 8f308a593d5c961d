"""CPU of one TLS server handshake in Python's ``ssl``, by certificate key type and session tickets.

    python benchmarks/bench_tls_handshake.py [--handshakes 300] [--repeat 3]

A blocking server thread and a client on loopback; each handshake is a new connection with a full
handshake (no resumption, as client-go), TLS 1.3, the client verifying the certificate. Reported:
the serving thread's CPU per handshake (``time.thread_time``, so time spent waiting for a CPU on a
busy machine does not count), the median of the repeats, for ECDSA P-256 and RSA 2048 keys and
with OpenSSL's default two TLS 1.3 session tickets or none (``SSLContext.num_tickets = 0``).
This is the handshake alone: what the gateway spends on a new connection beyond it is its own
Python around it (``python -m loadtests passthrough --connection-policy per-review --nginx``
measures the whole connection beside nginx's; docs/performance.md).
"""

from __future__ import annotations

import argparse
import socket
import ssl
import statistics
import threading
import time

import trustme


def _serve(listener: socket.socket, context: ssl.SSLContext, count: int, cpu: list[float]) -> None:
    for _ in range(count):
        conn, _ = listener.accept()
        started = time.thread_time()
        with context.wrap_socket(conn, server_side=True) as tls:
            tls.recv(1)  # the client's first byte: the handshake's last flight has been processed
            cpu.append(time.thread_time() - started)


def measure(key_type: str, tickets: int | None, handshakes: int) -> float:
    """Microseconds of the serving thread's CPU per handshake."""
    kind = trustme.KeyType.RSA if key_type == "rsa" else trustme.KeyType.ECDSA
    ca = trustme.CA(key_type=kind)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", key_type=kind).configure_cert(server)
    if tickets is not None:
        server.num_tickets = tickets
    client = ssl.create_default_context()
    ca.configure_trust(client)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        cpu: list[float] = []
        thread = threading.Thread(target=_serve, args=(listener, server, handshakes, cpu))
        thread.start()
        for _ in range(handshakes):
            with client.wrap_socket(
                socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1"
            ) as tls:
                tls.sendall(b"x")
        thread.join()
    return statistics.fmean(cpu) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--handshakes", type=int, default=300)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    print(f"{ssl.OPENSSL_VERSION}; {args.handshakes} handshakes per run, median of {args.repeat} runs")
    print("key            tickets   server CPU µs per handshake (runs)")
    for key_type, label in (("ecdsa", "ECDSA P-256"), ("rsa", "RSA 2048")):
        for tickets, shown in ((None, "default"), (0, "none")):
            runs = [measure(key_type, tickets, args.handshakes) for _ in range(args.repeat)]
            listed = ", ".join(f"{r:.0f}" for r in runs)
            print(f"{label:<14} {shown:<9} {statistics.median(runs):6.0f} ({listed})")


if __name__ == "__main__":
    main()
