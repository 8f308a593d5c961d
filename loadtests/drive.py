"""Load shapes: the closed loop (N clients back to back) and the open loop (arrivals at intended times).

The open loop measures latency from the *intended* send time, so a stall in the system under test
shows up in the latency of every request that should have been sent during it (no coordinated
omission). Both drivers call ``handle(worker, intended_time)``; the handler sends, verifies and
records ``trio.current_time() - intended_time``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable

import trio

Handler = Callable[[int, float], Awaitable[None]]


def arrival_offsets(
    rate: float, duration: float, *, poisson: bool = False, seed: int = 0, limit: int | None = None
) -> list[float]:
    """Intended send times (seconds from the start) for ``rate`` per second during ``duration``.

    Constant spacing ``1/rate``, or exponential gaps (a Poisson process) when ``poisson``; at most
    ``limit`` arrivals.
    """
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    cap = limit if limit is not None else math.inf
    while t < duration and len(out) < cap:
        out.append(t)
        t += rng.expovariate(rate) if poisson else 1.0 / rate
    return out


async def drive_open_loop(offsets: list[float], workers: int, handle: Handler) -> float:
    """Hand each arrival to a free worker at its intended time; returns the start time used.

    The schedule never waits for answers: when every worker is busy, arrivals queue and their
    latency keeps counting from the intended time.
    """
    send, receive = trio.open_memory_channel[float](len(offsets) + 1)
    start = trio.current_time()

    async def worker(index: int, rx: trio.MemoryReceiveChannel[float]) -> None:
        async with rx:
            async for intended in rx:
                await handle(index, intended)

    async with trio.open_nursery() as nursery:
        for i in range(workers):
            nursery.start_soon(worker, i, receive.clone())
        await receive.aclose()
        async with send:
            for off in offsets:
                intended = start + off
                await trio.sleep_until(intended)
                send.send_nowait(intended)
    return start


async def drive_closed_loop(
    workers: int, duration: float, max_requests: int | None, handle: Handler
) -> float:
    """Run ``workers`` clients back to back until ``duration`` passes or ``max_requests`` are issued."""
    start = trio.current_time()
    deadline = start + duration
    budget = [max_requests if max_requests is not None else -1]

    async def worker(index: int) -> None:
        while trio.current_time() < deadline and budget[0] != 0:
            budget[0] -= 1
            await handle(index, trio.current_time())

    async with trio.open_nursery() as nursery:
        for i in range(workers):
            nursery.start_soon(worker, i)
    return start
