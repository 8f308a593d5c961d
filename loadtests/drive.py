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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Segment:
    """A stretch of an open-loop schedule at one rate (``--burst``: before, burst, after)."""

    name: str
    start: float  # seconds from the schedule's start
    seconds: float
    rate: float


def schedule_offsets(
    segments: list[Segment], *, poisson: bool, seed: int, limit: int | None = None
) -> list[float]:
    """The arrival times of consecutive segments (seconds from the start), at most ``limit``."""
    out: list[float] = []
    for i, seg in enumerate(segments):
        out += [seg.start + t for t in arrival_offsets(seg.rate, seg.seconds, poisson=poisson, seed=seed + i)]
    return out[:limit] if limit is not None else out


async def drive_open_loop_unbounded(offsets: list[float], handle: Handler) -> float:
    """Start one task per arrival at its intended time, however many are still in flight (as the
    kube-apiserver serves each request in its own goroutine); returns the start time used.

    Arrivals whose time has come while the scheduler was busy start together at once, each with its
    own intended time, so a stall of the generator is charged to the latency it measures too.
    """
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        i, n = 0, len(offsets)
        while i < n:
            now = trio.current_time()
            while i < n and start + offsets[i] <= now:
                nursery.start_soon(handle, i, start + offsets[i])
                i += 1
            if i < n:
                await trio.sleep_until(start + offsets[i])
    return start


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
