"""The serving gateway's garbage collector: start-up objects frozen, full collections when quiet.

docs/performance.md ("Garbage collection"): a full collection scans every open connection's
objects, so once it serves the gateway turns CPython's own full collections off and makes them
itself (``gateway.server.gcgovernor``): when no request is in flight, or at a bound on time or
memory growth whatever the load. The decision is a table here; the rest runs a real gateway
in-process (the test must plant its objects in the gateway's own heap) over real sockets, with a
real backend that keeps a review in flight.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from gateway.cli import parse
from gateway.devtools.backends import serve_backend
from gateway.observability import Observability
from gateway.server.gcgovernor import GEN0_THRESHOLD, NEVER, GcGovernor, GcPolicy, GcReason
from gateway.server.serve import Running, serve
from tests.support.gateway import hook, write_config
from tests.support.inbound import read_response, review_request

MiB = 1 << 20
POLICY = GcPolicy(quiet_seconds=0.1, min_young_collections=7, max_interval=300.0, max_growth_bytes=64 * MiB)


def _governor(*, busy_at: float = 0.0, last_full_at: float = 0.0, lowest_rss: int = 100 * MiB) -> GcGovernor:
    governor = GcGovernor.start(POLICY, last_full_at, lowest_rss)
    governor.busy_at = busy_at
    return governor


# (in flight now, last request read at, now, middle-generation collections since the last full one,
#  RSS); the governor started at 0 s with 100 MiB resident.
DECISIONS: list[Any] = [
    pytest.param(0, -1.0, 10.0, 7, 100 * MiB, "quiet", id="quiet for longer than quiet_seconds and 7 middle-generation collections (~700,000 allocations): a full collection"),
    pytest.param(1, -1.0, 10.0, 5_000, 100 * MiB, None, id="a request in flight: no full collection, however many young collections"),
    pytest.param(0, 9.95, 10.0, 5_000, 100 * MiB, None, id="a request read less than quiet_seconds ago: no full collection"),
    pytest.param(0, -1.0, 10.0, 6, 100 * MiB, None, id="quiet, but fewer allocations than CPython's own threshold was: not worth a full collection"),
    pytest.param(0, -1.0, 400.0, 0, 500 * MiB, None, id="nothing reached the oldest generation since the last full collection: none, whatever the bounds"),
    pytest.param(1, -1.0, 300.0, 1, 100 * MiB, "interval", id="busy, max_interval after the last full collection: a full collection all the same"),
    pytest.param(1, -1.0, 299.0, 1, 100 * MiB, None, id="busy, short of max_interval and of max_growth_bytes: no full collection"),
    pytest.param(1, -1.0, 10.0, 1, 164 * MiB, "growth", id="busy, the resident set 64 MiB above its lowest since the last full collection: a full collection"),
    pytest.param(1, -1.0, 10.0, 1, 163 * MiB, None, id="busy, the resident set grown by less than max_growth_bytes: no full collection"),
]  # fmt: skip


@pytest.mark.parametrize(("in_flight", "last_request_at", "now", "young", "rss", "expected"), DECISIONS)
def test_when_a_full_collection_is_due(
    in_flight: int, last_request_at: float, now: float, young: int, rss: int, expected: GcReason | None
) -> None:
    governor = _governor()
    governor.observe(now, in_flight=in_flight, last_request_at=last_request_at)
    assert governor.due(now, young=young, rss=rss) == expected


def test_growth_counts_from_the_lowest_point_since_the_last_full_collection_not_from_that_collection() -> (
    None
):
    governor = _governor(busy_at=10.0, lowest_rss=200 * MiB)
    governor.observe(10.0, in_flight=1, last_request_at=-1.0)
    assert governor.due(10.0, young=1, rss=120 * MiB) is None  # memory came back (a heap trim)
    assert governor.due(11.0, young=1, rss=184 * MiB) == "growth"  # 64 MiB above that low point


def test_a_large_resident_set_may_grow_by_half_before_growth_forces_a_full_collection() -> None:
    governor = _governor(busy_at=10.0, lowest_rss=400 * MiB)
    governor.observe(10.0, in_flight=1, last_request_at=-1.0)
    assert governor.due(10.0, young=1, rss=599 * MiB) is None  # more than 64 MiB, less than half
    assert governor.due(10.0, young=1, rss=600 * MiB) == "growth"


def test_a_burst_of_connections_explains_its_memory_at_its_peak_and_after_its_connections_closed() -> None:
    governor = _governor(busy_at=10.0)  # 100 MiB resident, no connection open
    governor.observe(10.0, in_flight=1, last_request_at=-1.0)
    assert governor.due(10.0, young=1, rss=164 * MiB, connections=1_024) is None  # 1,024 x 64 KiB
    # They closed; malloc keeps their memory for the next ones: still explained.
    assert governor.due(11.0, young=1, rss=164 * MiB, connections=0) is None
    assert governor.due(12.0, young=1, rss=228 * MiB, connections=1_024) == "growth"  # 64 MiB unexplained


def test_connections_explain_nothing_beyond_their_count_at_the_lowest_point() -> None:
    governor = _governor(busy_at=10.0)
    governor.observe(10.0, in_flight=1, last_request_at=-1.0)
    assert governor.due(10.0, young=1, rss=164 * MiB, connections=1_024) is None
    assert governor.due(11.0, young=1, rss=90 * MiB, connections=1_024) is None  # a heap trim: lower
    assert governor.due(12.0, young=1, rss=154 * MiB, connections=1_024) == "growth"  # as many open as then


def test_a_full_collection_restarts_every_bound_and_is_counted_with_its_pause() -> None:
    governor = _governor()
    governor.observe(300.0, in_flight=1, last_request_at=-1.0)
    assert governor.due(300.0, young=1, rss=100 * MiB) == "interval"
    governor.collected("interval", now=300.5, rss=150 * MiB, pause=0.25)
    assert governor.due(301.0, young=1, rss=150 * MiB) is None
    assert governor.due(301.0, young=1, rss=213 * MiB) is None  # 63 MiB above the collection's 150
    assert governor.collections == {"quiet": 0, "interval": 1, "growth": 0}
    assert (governor.pause_seconds, governor.longest_pause) == (0.25, 0.25)


def test_a_connection_being_established_counts_as_busy() -> None:
    governor = _governor(busy_at=0.0)
    governor.observe(10.0, in_flight=0, last_request_at=-1.0, establishing=3)  # a dial storm
    assert governor.due(10.0, young=100, rss=100 * MiB) is None
    governor.observe(10.2, in_flight=0, last_request_at=-1.0, establishing=0)
    assert governor.due(10.2, young=100, rss=100 * MiB) == "quiet"


def test_a_request_read_between_two_polls_counts_as_busy_until_quiet_seconds_after_it() -> None:
    governor = _governor(busy_at=0.0)
    governor.observe(10.0, in_flight=0, last_request_at=9.97)  # read and answered between two polls
    assert governor.due(10.0, young=100, rss=100 * MiB) is None
    governor.observe(10.08, in_flight=0, last_request_at=9.97)
    assert governor.due(10.08, young=100, rss=100 * MiB) == "quiet"


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults, as a process starts
    gc.unfreeze()
    yield
    gc.set_threshold(*threshold)
    gc.unfreeze()


class FullCollections:
    """Records each full collection of this process with the reviews the gateway had in flight."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.app: Any = None
        self.in_flight_at: list[int] = []  # one entry per full collection
        self.young = 0  # middle-generation collections seen
        self.changed = trio.Event()
        self._token = token

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase != "stop":
            return
        if info["generation"] == 1:
            self.young += 1
        elif info["generation"] == 2 and self.app is not None:
            self.in_flight_at.append(self.app.in_flight)
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self.changed.set)

    async def wait(self, predicate: Any) -> None:
        while not predicate():
            self.changed = trio.Event()
            await self.changed.wait()


@pytest.fixture
async def full_collections(restored_gc: None) -> AsyncIterator[FullCollections]:
    recorder = FullCollections(trio.lowlevel.current_trio_token())
    gc.callbacks.append(recorder)
    yield recorder
    gc.callbacks.remove(recorder)


async def _gateway(nursery: trio.Nursery, tmp_path: Path, backend_url: str, policy: GcPolicy) -> Running:
    config = tmp_path / "config"
    write_config(config, validating={"v": [hook("v.example.com", backend_url, timeoutSeconds=30)]})
    options = parse(["--config", str(config), "--bind", "127.0.0.1:0", "--drain-seconds", "0"]).options
    observer = Observability(metrics=True, review_log=False)
    running: Running = await nursery.start(
        partial(serve, options, observer=observer, handle_signals=False, gc_policy=policy)
    )
    return running


async def _full_collections_exported(running: Running) -> dict[str, float]:
    """``webhook_gateway_gc_full_collections_total`` per reason, from the gateway's ``GET /metrics``."""
    stream = await trio.open_tcp_stream("127.0.0.1", int(running.urls[0].rsplit(":", 1)[1]))
    await stream.send_all(b"GET /metrics HTTP/1.1\r\nhost: gw\r\n\r\n")
    text = (await read_response(stream)).decode()
    await stream.aclose()
    prefix = 'webhook_gateway_gc_full_collections_total{reason="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


async def _review_in_flight(nursery: trio.Nursery, running: Running) -> trio.Event:
    """Send one review whose backend takes its time; return once the gateway has it in flight."""
    answered = trio.Event()
    port = int(running.urls[0].rsplit(":", 1)[1])

    async def send() -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(review_request("/validate?timeout=30s"))
        assert b" 200 " in (await read_response(stream)).split(b"\r\n", 1)[0]
        answered.set()
        await stream.aclose()

    nursery.start_soon(send)
    while running.app.in_flight == 0:
        await trio.sleep(0.01)
    return answered


async def _young_collections(recorder: FullCollections, count: int) -> None:
    """Allocate until the middle generation has been collected ``count`` times, yielding to the
    event loop as a busy gateway would (memory stays flat: each batch replaces the one before)."""
    until = recorder.young + count
    batch: list[list[None]] = []
    while recorder.young < until:
        # Each batch outgrows the youngest generation's threshold before the one before is freed.
        batch = [[] for _ in range(2 * GEN0_THRESHOLD)]  # type: ignore[misc]
        await trio.sleep(0)
    del batch


async def test_no_full_collection_while_a_review_is_in_flight_and_one_once_the_gateway_is_quiet(
    full_collections: FullCollections, nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = await nursery.start(partial(serve_backend))
    running = await _gateway(nursery, tmp_path, backend.url("/sleep/1500/allow"), POLICY)
    full_collections.app = running.app
    assert gc.get_freeze_count() > 0  # what start-up left alive is never scanned again
    answered = await _review_in_flight(nursery, running)
    # Three times the allocations that made CPython collect in full before the governor (100
    # middle-generation collections of 10 x 700 allocations each: 21 of 10 x 10,000).
    await _young_collections(full_collections, 21)
    assert running.app.in_flight == 1
    assert full_collections.in_flight_at == []
    await answered.wait()
    with trio.fail_after(20):  # a deadline for a broken governor, not a measurement
        await full_collections.wait(lambda: 0 in full_collections.in_flight_at)
    assert all(n == 0 for n in full_collections.in_flight_at), full_collections.in_flight_at
    exported = await _full_collections_exported(running)
    assert exported["quiet"] >= 1
    assert exported["interval"] == exported["growth"] == 0


async def test_a_reference_cycle_made_while_reviews_are_in_flight_is_collected_at_the_interval_bound(
    full_collections: FullCollections, nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = await nursery.start(partial(serve_backend))
    policy = GcPolicy(quiet_seconds=3600, max_interval=0.5, max_growth_bytes=1 << 40, poll_interval=0.05)
    running = await _gateway(nursery, tmp_path, backend.url("/sleep/25000/allow"), policy)
    full_collections.app = running.app
    await _review_in_flight(nursery, running)
    collected = trio.Event()

    class Leaked:
        pass

    cycle = Leaked()
    cycle.me = cycle  # type: ignore[attr-defined]
    weakref.finalize(cycle, collected.set)
    await _young_collections(full_collections, 2)  # alive, it reaches the oldest generation
    assert not collected.is_set()
    del cycle  # garbage now that only a full collection can find
    with trio.fail_after(20):  # a deadline for a broken governor, not a measurement
        await collected.wait()
    assert running.app.in_flight == 1  # collected under load, by the bound
    assert full_collections.in_flight_at and full_collections.in_flight_at[-1] == 1
    assert (await _full_collections_exported(running))["interval"] >= 1


async def test_at_shutdown_the_governor_ends_and_gives_the_process_its_thresholds_back(
    restored_gc: None, tmp_path: Path
) -> None:
    async with trio.open_nursery() as nursery:
        backend = await nursery.start(partial(serve_backend))
        running = await _gateway(nursery, tmp_path, backend.url("/allow"), POLICY)
        # CPython makes no full collection itself, and a young one only every 10,000 allocations
        assert gc.get_threshold() == (GEN0_THRESHOLD, 10, NEVER) == (10_000, 10, NEVER)
        running.shutdown()
        with trio.fail_after(20):
            while gc.get_threshold() != (700, 10, 10):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()  # the backend
    assert gc.get_threshold() == (700, 10, 10)
