"""Benchmark: CPU per backend call and calls/s for the gateway's client vs httpx (if installed).

Run: /work/venv/bin/python benchmarks/bench_client.py [--calls N] [--concurrency C]

The backend runs in a subprocess (tests/support/httpservers.py: HTTP/1.1 and h2c on 127.0.0.1) so
the CPU time measured (getrusage: user + system) is the client's alone. Not part of the test suite.
"""

from __future__ import annotations

import argparse
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

Call = Callable[[], Awaitable[int]]


async def _serve(h2c: bool) -> None:
    from tests.support.httpservers import BackendServer

    class QuietServer(BackendServer):
        def _record(self, request: object) -> None:  # keep memory flat over many calls
            pass

    async with trio.open_nursery() as nursery:
        server: BackendServer = await nursery.start(QuietServer(h2c=h2c).serve)
        print(server.port, flush=True)


def start_backend(h2c: bool) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(  # noqa: S603 - our own script, fixed arguments
        [sys.executable, __file__, "--serve", "h2c" if h2c else "h1"], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    return process, int(process.stdout.readline())


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


async def bench_ours(port: int, h2c: bool, calls: int, concurrency: int) -> Result:
    from gateway.config.model import ClientConfig
    from gateway.transport import ClientPool, resolve_target

    target = resolve_target(ClientConfig(url=f"http://127.0.0.1:{port}/validate"), None)
    async with ClientPool(h2c_prior_knowledge=h2c) as pool:

        async def call() -> int:
            return (await pool.post(target, body=BODY, timeout_seconds=10)).status

        return await measure(call, calls, concurrency)


async def bench_httpx(port: int, h2c: bool, calls: int, concurrency: int) -> Result | None:
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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--serve", choices=["h1", "h2c"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(_serve, args.serve == "h2c")
        return
    print(f"{'client':<28}{'mode':<14}{'CPU µs/call':>12}{'user µs':>9}{'calls/s':>10}")
    for h2c in (False, True):
        process, port = start_backend(h2c)
        try:
            for name, bench in (
                ("gateway " + ("h2 (h2c)" if h2c else "h11 pool"), bench_ours),
                (
                    "httpx " + ("http2 (h2c)" if h2c else "http/1.1"),
                    bench_httpx,
                ),
            ):
                for concurrency in (1, args.concurrency):
                    result = trio.run(bench, port, h2c, args.calls, concurrency)
                    mode = "sequential" if concurrency == 1 else f"{concurrency} workers"
                    if result is None:
                        print(f"{name:<28}{mode:<14}{'skipped (not installed)':>22}")
                        break
                    print(
                        f"{name:<28}{mode:<14}{result[0]:>12.0f}{result[1]:>9.0f}{result[2]:>10.0f}",
                        flush=True,
                    )
        finally:
            process.terminate()
            process.wait()


if __name__ == "__main__":
    main()
