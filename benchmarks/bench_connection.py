"""CPU of the gateway's inbound server per new TLS connection, apart from any review.

    python benchmarks/bench_connection.py [--connections 2000] [--repeat 3] [--key-type ecdsa]
                                          [--nginx] [--profile PATH.prof]

The gateway's own listener (``gateway.server.hypercorn.listener.serve_inbound``, the code
``python -m gateway`` serves with) runs in a child process in front of a trivial ASGI app (200,
two bytes). Client processes on loopback then make the same number of requests twice: one
request per new connection (connect, full TLS 1.3 handshake as client-go does it, one request,
close), and all of them over keep-alive connections. Reported: the server process's CPU (user +
system, ``/proc/PID/stat``) per request in each mode, and their difference — what a new connection
costs beyond the request it carries — beside what the TLS handshake alone costs
(``benchmarks/bench_tls_handshake.py``). Medians of the repeats.

``--nginx`` measures nginx (Debian ``nginx-light``) the same way in the same run, with the same
certificate and clients, answering ``200 ok`` itself (one worker, no session tickets: the
client-go-like client never resumes, and the gateway sends none), and reports the gateway's cost
of a new connection as a ratio to nginx's: the floor of any TLS server on this machine.

``--profile`` runs the server under cProfile during the per-connection phase (for where the time
goes, not for the figures: cProfile inflates small calls).

``--perf`` says which code the CPU went to, for the gateway and (with ``--nginx``) for nginx: one
more per-connection phase and one more keep-alive phase under ``perf record -e cpu-clock`` (Debian
``linux-perf``), whose samples are split by the library they fell in (the Python interpreter,
OpenSSL's crypto and TLS, libc, the kernel, …). perf slows the server down, so only its shares are
used: each share times the median CPU per request measured without it. The difference of the two
phases is what a new connection costs in each part.

The whole connection, with a real review, beside nginx's: ``python -m loadtests passthrough
--connection-policy per-review --nginx`` (docs/performance.md).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import trustme

from loadtests import processes

_SERVER = textwrap.dedent(
    """
    import gc, os, ssl, sys, trio
    from gateway.server.hypercorn.config import server_config
    from gateway.server.hypercorn.listener import serve_inbound
    from gateway.server.limits import InboundLimits, InboundRuntime
    from gateway.wire.tls import server_context

    cert, key, port_file, profile = sys.argv[1:5]
    context = server_context(cert, key)

    class Tls:
        pass

    tls = Tls()
    tls.context = context

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while True:
            message = await receive()
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        # What a connection costs, not how fast the gateway admits them: no --handshake-rate bound.
        runtime = InboundRuntime(limits=InboundLimits(handshake_rate=0))
        cfg = server_config("127.0.0.1:0", tls=tls, shutdown_timeout=1.0, runtime=runtime)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                lambda task_status: serve_inbound(app, cfg, tls_context=lambda: tls.context,
                                                  shutdown_trigger=stop.wait, task_status=task_status))
            gc.collect()
            gc.freeze()
            with open(port_file + ".tmp", "w") as f:
                f.write(urls[0].rsplit(":", 1)[1])
            os.rename(port_file + ".tmp", port_file)
            await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes stdin
            stop.set()

    if profile != "-":
        import cProfile, time
        profiler = cProfile.Profile(time.process_time)  # CPU time: waiting in epoll is not counted
        profiler.runcall(trio.run, main)
        profiler.dump_stats(profile)
    else:
        trio.run(main)
    """
)

_NGINX_CONF = """daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_session_tickets off;
        keepalive_requests 1000000;
        location / {{ return 200 "ok"; }}
    }}
}}
"""

_REQUEST = b"POST /validate HTTP/1.1\r\nHost: gateway\r\nContent-Length: 2\r\n\r\n{}"


def _client(port: int, ca_pem: str, count: int, per_connection: bool) -> None:
    context = ssl.create_default_context(cadata=ca_pem)
    context.set_alpn_protocols(["http/1.1"])
    conn = None
    for _ in range(count):
        if conn is None:
            raw = socket.create_connection(("127.0.0.1", port))
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = context.wrap_socket(raw, server_hostname="127.0.0.1")
        conn.sendall(_REQUEST)
        reply = b""
        while not reply.endswith(b"ok"):
            chunk = conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the server closed the connection: {reply!r}")
            reply += chunk
        if per_connection:
            conn.close()
            conn = None
    if conn is not None:
        conn.close()


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _phase(pid: int, port: int, ca_pem: str, total: int, clients: int, *, per_connection: bool) -> float:
    """Server CPU µs per request."""
    each = total // clients
    before = _cpu(pid)
    procs = [
        multiprocessing.Process(target=_client, args=(port, ca_pem, each, per_connection))
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a client failed (exit code {p.exitcode})")
    time.sleep(0.3)  # let the server finish closing the last connections
    return (_cpu(pid) - before) * 1e6 / (each * clients)


# The library a sample fell in (perf's "dso"), as the part of the server it stands for.
_PARTS: tuple[tuple[str, str], ...] = (
    (r"^\[kernel", "kernel"),
    (r"^libcrypto\.", "OpenSSL crypto (libcrypto)"),
    (r"^libssl\.", "OpenSSL TLS (libssl)"),
    (r"^libc\.", "libc"),
    (r"^(libpython|python)", "Python interpreter"),
    (r"\.cpython-.*\.so$", "Python extension modules"),
    (r"^nginx$", "nginx"),
)
_DSO_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S.*?)\s*$")
# The parts every server's table lists, with or without samples: a short run can take no sample of
# a small part (nginx's own code is ~2 % of its connection), and a row that comes and goes with the
# sampling reads as a different server.
_LISTED = ("OpenSSL crypto (libcrypto)", "OpenSSL TLS (libssl)", "libc", "kernel")


def part_of(dso: str) -> str:
    """The part of the server a library stands for (``other`` for any not named in ``_PARTS``)."""
    return next((part for pattern, part in _PARTS if re.search(pattern, dso)), "other")


def _samples(report: str) -> list[tuple[str, float]]:
    """(library, fraction of the samples) per line of ``perf report --sort dso --stdio`` text."""
    out = []
    for line in report.splitlines():
        match = None if line.startswith("#") else _DSO_LINE.match(line)
        if match:
            out.append((match[2], float(match[1]) / 100))
    return out


def shares(report: str) -> dict[str, float]:
    """Fractions of the samples per part, from ``perf report --sort dso --stdio`` text."""
    out: dict[str, float] = {}
    for dso, fraction in _samples(report):
        part = part_of(dso)
        out[part] = out.get(part, 0.0) + fraction
    return out


def unnamed(report: str) -> list[str]:
    """The libraries counted as ``other``, most samples first."""
    return [dso for dso, _ in _samples(report) if part_of(dso) == "other"]


def _perf_phase(pid: int, phase: Callable[[], float], out: str) -> tuple[dict[str, float], list[str]]:
    """Shares of ``pid``'s CPU per part while ``phase`` runs, from a ``perf record`` of it, and the
    libraries counted as ``other``."""
    perf = shutil.which("perf")
    assert perf is not None
    recorder = subprocess.Popen(  # noqa: S603 - fixed arguments
        [perf, "record", "--quiet", "-e", "cpu-clock", "-F", "2000", "-p", str(pid), "-o", out],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.5)  # perf attaches
    if recorder.poll() is not None:
        raise SystemExit(
            f"perf record failed: {recorder.stderr.read().decode()[-500:] if recorder.stderr else ''}"
        )
    phase()
    recorder.send_signal(signal.SIGINT)
    recorder.wait(timeout=30)
    report = subprocess.run(  # noqa: S603 - fixed arguments
        [perf, "report", "-i", out, "--sort", "dso", "--stdio"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    found = shares(report)
    if not found:
        raise SystemExit(f"perf recorded no samples of process {pid}")
    return found, unnamed(report)


Breakdown = dict[str, tuple[float, float, float]]  # part: µs with a new connection, kept, difference


def breakdown_rows(
    fresh: dict[str, float], kept: dict[str, float], medians: tuple[float, ...], listed: tuple[str, ...]
) -> Breakdown:
    """Per part, µs per request with a new connection, over keep-alive, and their difference: the
    ``listed`` parts always (0 without samples), any other part that has samples; largest first, and
    in the order listed among equals."""
    parts = sorted(dict.fromkeys([*listed, *fresh, *kept]), key=lambda p: -fresh.get(p, 0.0))
    rows = {}
    for part in parts:
        new_us, kept_us = fresh.get(part, 0.0) * medians[0], kept.get(part, 0.0) * medians[1]
        rows[part] = (new_us, kept_us, new_us - kept_us)
    return rows


def _breakdown(
    pid: int,
    port: int,
    ca_pem: str,
    args: argparse.Namespace,
    *,
    medians: tuple[float, ...],
    out: str,
    own: str,
) -> tuple[Breakdown, list[str]]:
    """Per part: µs per request with a new connection, over keep-alive, and their difference; and the
    libraries counted as ``other``. ``own`` is the server's own code, listed like ``_LISTED``."""
    fresh, fresh_other = _perf_phase(
        pid, lambda: _phase(pid, port, ca_pem, args.connections, args.clients, per_connection=True), out
    )
    kept, kept_other = _perf_phase(
        pid, lambda: _phase(pid, port, ca_pem, args.connections, args.clients, per_connection=False), out
    )
    other = list(dict.fromkeys(fresh_other + kept_other))
    return breakdown_rows(fresh, kept, medians, (own, *_LISTED)), other


def _print_breakdown(label: str, rows: Breakdown, other: list[str]) -> None:
    print(f"{label}: where the CPU went (perf's shares of the medians above), µs per request:")
    print(f"  {'part':32} {'new connection':>15} {'keep-alive':>11} {'difference':>11}")
    for part, (new_us, kept_us, diff) in rows.items():
        print(f"  {part:32} {new_us:15.0f} {kept_us:11.0f} {diff:11.0f}")
    if other:
        print(f"  other: {', '.join(other)}")


def _measure(
    pid: int, port: int, ca_pem: str, args: argparse.Namespace, label: str, *, own: str
) -> tuple[tuple[float, ...], tuple[Breakdown, list[str]] | None]:
    """Medians of (new connection per request, keep-alive, difference) µs of ``pid``'s CPU, and with
    ``--perf`` where that CPU went."""
    _phase(pid, port, ca_pem, 200, args.clients, per_connection=True)  # warm-up
    rows = []
    for _ in range(args.repeat):
        fresh = _phase(pid, port, ca_pem, args.connections, args.clients, per_connection=True)
        kept = _phase(pid, port, ca_pem, args.connections, args.clients, per_connection=False)
        rows.append((fresh, kept, fresh - kept))
        print(
            f"  {label}: new connection per request {fresh:7.0f} µs, keep-alive {kept:5.0f} µs, "
            f"difference {fresh - kept:5.0f} µs",
            flush=True,
        )
    medians = tuple(statistics.median(col) for col in zip(*rows, strict=True))
    if not args.perf:
        return medians, None
    with tempfile.TemporaryDirectory() as tmp:
        return medians, _breakdown(
            pid, port, ca_pem, args, medians=medians, out=os.path.join(tmp, "perf.data"), own=own
        )


def _nginx(
    tmp: str, cert_path: str, key_path: str, args: argparse.Namespace, ca_pem: str
) -> tuple[tuple[float, ...], tuple[Breakdown, list[str]] | None]:
    exe = processes.nginx()
    if exe is None:
        raise SystemExit("--nginx needs nginx (Debian nginx-light)")
    directory = os.path.join(tmp, "nginx")
    os.mkdir(directory)
    port = processes.free_port()
    conf = os.path.join(directory, "nginx.conf")
    Path(conf).write_text(_NGINX_CONF.format(dir=directory, port=port, cert=cert_path, key=key_path))
    proc = subprocess.Popen([exe, "-p", directory, "-c", conf, "-e", os.path.join(directory, "error.log")])  # noqa: S603
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"nginx exited: {Path(directory, 'error.log').read_text()[-500:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("nginx is not listening after 10 s") from None
                time.sleep(0.05)
        return _measure(proc.pid, port, ca_pem, args, "nginx  ", own="nginx")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--key-type", choices=("ecdsa", "rsa"), default="ecdsa")
    parser.add_argument("--profile", default="-", help="cProfile output of the server (per-connection phase)")
    parser.add_argument("--nginx", action="store_true", help="also measure nginx, same run, same certificate")
    parser.add_argument(
        "--perf", action="store_true", help="split each server's CPU by library with perf (Debian linux-perf)"
    )
    args = parser.parse_args()
    if args.perf and args.profile != "-":
        parser.error("--perf and --profile measure apart: give one of them")
    if args.perf and shutil.which("perf") is None:
        raise SystemExit("--perf needs perf on PATH (Debian: apt-get install linux-perf)")

    kind = trustme.KeyType.RSA if args.key_type == "rsa" else trustme.KeyType.ECDSA
    ca = trustme.CA(key_type=kind)
    cert = ca.issue_cert("127.0.0.1", key_type=kind)
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path, port_file = (os.path.join(tmp, n) for n in ("cert.pem", "key.pem", "port"))
        cert.cert_chain_pems[0].write_to_path(cert_path)
        cert.private_key_pem.write_to_path(key_path)
        server = subprocess.Popen(  # noqa: S603 - our own script, fixed arguments
            [sys.executable, "-c", _SERVER, cert_path, key_path, port_file, args.profile],
            stdin=subprocess.PIPE,
        )
        try:
            while not os.path.exists(port_file):
                if server.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(0.05)
            port = int(Path(port_file).read_text())
            ca_pem = ca.cert_pem.bytes().decode()
            if args.profile != "-":  # the profile is of new connections only
                for _ in range(args.repeat):
                    fresh = _phase(
                        server.pid, port, ca_pem, args.connections, args.clients, per_connection=True
                    )
                    print(f"  new connection per request {fresh:7.0f} µs (under cProfile)")
                return
            (fresh, kept, diff), ours = _measure(
                server.pid, port, ca_pem, args, "gateway", own="Python interpreter"
            )
            floor, theirs = _nginx(tmp, cert_path, key_path, args, ca_pem) if args.nginx else (None, None)
        finally:
            assert server.stdin is not None
            server.stdin.close()
            server.wait(timeout=30)
    print(
        f"{args.key_type}: server CPU per request: new connection {fresh:.0f} µs, keep-alive {kept:.0f} µs; "
        f"a new connection costs {diff:.0f} µs (medians of {args.repeat})"
    )
    if floor is not None:
        # CPU is read in clock ticks (10 ms): too few connections can measure no difference at all.
        ratio = f"{diff / floor[2]:.2f}x" if floor[2] > 0 else "- (too few connections to tell)"
        print(
            f"{args.key_type}: nginx: new connection {floor[0]:.0f} µs, keep-alive {floor[1]:.0f} µs; "
            f"a new connection costs {floor[2]:.0f} µs; the gateway's = {ratio} nginx's"
        )
    for label, where in (("gateway", ours), ("nginx", theirs)):
        if where is not None:
            _print_breakdown(f"{args.key_type}: {label}", *where)


if __name__ == "__main__":
    main()
