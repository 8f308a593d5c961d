"""Benchmark: CPU per backend call and calls/s for the gateway's client vs httpx (if installed).

Run: /work/venv/bin/python benchmarks/bench_client.py [--calls N] [--concurrency C]

The backend runs in a subprocess (tests/support/httpservers.py: HTTP/1.1, h2c, or h2 over TLS on
127.0.0.1) so the CPU time measured (getrusage: user + system) is the client's alone. Not part of
the test suite.

Before/after comparisons of the gateway's client: ``--gateway-root DIR`` imports ``gateway`` from
another tree (e.g. ``git archive <commit> gateway | tar -x -C DIR``), ``--modes`` and ``--ours-only``
keep a run short, ``--body-bytes 8192`` sends a review-sized body.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BODY = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"x"}}' * 8
MODES = ("h1", "h2c", "h2tls")

Call = Callable[[], Awaitable[int]]


async def _serve(mode: str) -> None:
    from tests.support.httpservers import BackendServer

    class QuietServer(BackendServer):
        def _record(self, request: object) -> None:  # keep memory flat over many calls
            pass

    server = QuietServer(h2c=mode == "h2c")
    ca_pem = ""
    if mode == "h2tls":
        import trustme

        from tests.support.httpservers import server_context

        ca = trustme.CA()
        server.ssl_context = server_context(ca, "localhost", alpn=("h2",))
        ca_pem = ca.cert_pem.bytes().decode().replace("\n", "|")
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        print(server.port, flush=True)
        print(ca_pem, flush=True)


def start_backend(mode: str) -> tuple[subprocess.Popen[str], int, bytes]:
    process = subprocess.Popen(  # noqa: S603 - our own script, fixed arguments
        [sys.executable, __file__, "--serve", mode], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    port = int(process.stdout.readline())
    ca_pem = process.stdout.readline().strip().replace("|", "\n").encode()
    return process, port, ca_pem


Result = tuple[float, float, float]


async def measure(make_call: Call, calls: int, concurrency: int) -> Result:
    """(CPU µs per call, user µs of it, calls per second) for ``calls`` calls by ``concurrency`` workers."""
    for _ in range(min(200, calls)):
        await make_call()
    remaining = calls
    before, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            status = await make_call()
            assert status == 200, status

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall
    user = after.ru_utime - before.ru_utime
    system = after.ru_stime - before.ru_stime
    return (user + system) / calls * 1e6, user / calls * 1e6, calls / wall


async def bench_ours(port: int, mode: str, calls: int, concurrency: int, ca_pem: bytes = b"") -> Result:
    from gateway.config.model import ClientConfig
    from gateway.transport import ClientPool, resolve_target

    if mode == "h2tls":
        config = ClientConfig(url=f"https://localhost:{port}/validate", ca_bundle=ca_pem)
    else:
        config = ClientConfig(url=f"http://127.0.0.1:{port}/validate")
    target = resolve_target(config, None)
    async with ClientPool(h2c_prior_knowledge=mode == "h2c") as pool:

        async def call() -> int:
            response = await pool.post(target, body=BODY, timeout_seconds=10)
            assert response.http_version == ("HTTP/1.1" if mode == "h1" else "HTTP/2")
            return response.status

        return await measure(call, calls, concurrency)


async def bench_httpx(
    port: int, mode: str, calls: int, concurrency: int, ca_pem: bytes = b""
) -> Result | None:
    h2c = mode == "h2c"
    if mode == "h2tls":
        return None  # not compared over TLS
    try:
        import httpx
    except ImportError:
        return None
    if h2c:
        try:
            import h2  # noqa: F401  (httpx's http2 extra)
        except ImportError:
            return None
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    kwargs = {"http1": False, "http2": True} if h2c else {}
    async with httpx.AsyncClient(limits=limits, follow_redirects=False, **kwargs) as client:  # type: ignore[arg-type]
        url = f"http://127.0.0.1:{port}/validate?timeout=10s"
        headers = {"content-type": "application/json", "accept": "application/json, */*"}

        async def call() -> int:
            return (await client.post(url, content=BODY, headers=headers, timeout=10)).status_code

        return await measure(call, calls, concurrency)


def main() -> None:
    global BODY  # noqa: PLW0603 - set once from the command line, before any call
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--modes", default="h1,h2c", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--body-bytes", type=int, default=len(BODY), help="request body size")
    parser.add_argument("--ours-only", action="store_true", help="skip httpx")
    parser.add_argument("--gateway-root", help="import gateway from this directory instead")
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(_serve, args.serve)
        return
    if args.gateway_root:
        sys.path.insert(0, os.path.abspath(args.gateway_root))
    import gateway

    BODY = (BODY * (args.body_bytes // len(BODY) + 1))[: args.body_bytes]
    print(f"gateway from {Path(gateway.__file__).parent}; body {len(BODY)} bytes")
    print(f"{'client':<28}{'mode':<14}{'CPU µs/call':>12}{'user µs':>9}{'calls/s':>10}")
    for mode in args.modes.split(","):
        process, port, ca_pem = start_backend(mode)
        try:
            benches = [
                ("gateway " + {"h1": "h11 pool", "h2c": "h2 (h2c)", "h2tls": "h2 (TLS)"}[mode], bench_ours)
            ]
            if not args.ours_only:
                benches.append(("httpx " + ("http2 (h2c)" if mode == "h2c" else "http/1.1"), bench_httpx))  # type: ignore[arg-type]
            for name, bench in benches:
                for concurrency in (1, args.concurrency):
                    result = trio.run(bench, port, mode, args.calls, concurrency, ca_pem)
                    mode_name = "sequential" if concurrency == 1 else f"{concurrency} workers"
                    if result is None:
                        print(f"{name:<28}{mode_name:<14}{'skipped':>22}")
                        break
                    print(
                        f"{name:<28}{mode_name:<14}{result[0]:>12.0f}{result[1]:>9.0f}{result[2]:>10.0f}",
                        flush=True,
                    )
        finally:
            process.terminate()
            process.wait()


if __name__ == "__main__":
    main()
