"""Which of two worker processes accepts a connection: one inherited listening socket vs SO_REUSEPORT.

Counts, not timings (so it means something on a shared machine too):

    python benchmarks/bench_accept_spread.py

Patterns: 8 connections at once (kube-apiserver's few long-lived connections), 200 connections one
after another, and 200 when one worker spends 5 ms of CPU after each accept (a busy worker).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import selectors
import socket
import time
from typing import Any


def worker(mode: str, port: int, fd: int, results: Any, busy: bool) -> None:
    if mode == "reuseport":
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(1024)
    else:
        sock = socket.socket(fileno=os.dup(fd))
    sock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    accepted: list[socket.socket] = []
    results.put(("up", 0))
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        for _ in sel.select(0.05):
            try:
                accepted.append(sock.accept()[0])
            except BlockingIOError:
                continue  # the other worker took it
            if busy:
                start = time.perf_counter()
                while time.perf_counter() - start < 0.005:
                    pass
    results.put(("busy" if busy else "idle", len(accepted)))


def run(mode: str, pattern: str, one_busy: bool) -> str:
    fd, listener = -1, None
    if mode == "inherited":
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        port, fd = listener.getsockname()[1], listener.fileno()
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    results: Any = mp.Queue()
    procs = [mp.Process(target=worker, args=(mode, port, fd, results, one_busy and i == 0)) for i in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        results.get()
    time.sleep(0.3)
    clients = []
    for _ in range(8 if pattern == "burst of 8" else 200):
        clients.append(socket.create_connection(("127.0.0.1", port)))
        if pattern != "burst of 8":
            time.sleep(0.005)
    counts = sorted(results.get() for _ in procs)
    for p in procs:
        p.join()
    for c in clients:
        c.close()
    if listener is not None:
        listener.close()
    return f"{mode:<10} {pattern:<24} " + ", ".join(f"{who} {n}" for who, n in counts)


def main() -> None:
    patterns = (("burst of 8", False), ("200 one by one", False), ("200 one by one, 1 busy", True))
    for mode in ("inherited", "reuseport"):
        for pattern, busy in patterns:
            print(run(mode, pattern, busy))


if __name__ == "__main__":
    main()
