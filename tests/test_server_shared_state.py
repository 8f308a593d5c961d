"""One state per backend across workers: the shared tables (gateway/server/shared_state.py).

Each "worker" here is a ``SharedTable`` opened on the same file with its own worker number, as
each worker process opens it; the concurrency tests run real processes (multiprocessing, spawn)
on one table, since atomicity between processes is the point. The whole gateway with two workers
is tested through real sockets in tests/test_server_workers.py.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from gateway.config.backend_policy import ANNOTATION
from gateway.observability.metrics import Metrics
from gateway.resilience import (
    BackendGuards,
    Bulkhead,
    CallPermit,
    CircuitBreaker,
    CircuitState,
    Pass,
    Refusal,
)
from gateway.resilience.breaker import CircuitWord
from gateway.server.shared_state import (
    CIRCUITS,
    EJECTIONS,
    MIN_CIRCUIT_SLOTS,
    SharedCounters,
    SharedTable,
    circuit_slots,
    tag_of,
)
from gateway.server.workers import GAUGE_MERGE, MetricsSnapshot, _circuit_states, capture, merge
from gateway.transport.endpoints import EjectionWord, EndpointRouter
from tests.configs.builders import config, hook, load


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def circuits(path: Path, worker: int, *, capacity: int = 16, workers: int = 2) -> SharedTable[CircuitWord]:
    return SharedTable(path / "circuits.state", CIRCUITS, capacity=capacity, workers=workers, worker=worker)


def permit(breaker: CircuitBreaker) -> CallPermit:
    admitted, _ = breaker.admit()
    assert isinstance(admitted, CallPermit), admitted
    return admitted


def snapshot(policy: str, *names: str, url: str = "https://backend.example.com/hook") -> object:
    doc = config(*(hook(n, url=f"{url}/{n}") for n in names))
    doc["metadata"]["annotations"] = {ANNOTATION: policy}
    return load(doc)


BREAKER = '"*": {circuitBreaker: {consecutiveFailures: 3, openSeconds: 10}}'


# --- one circuit, several workers ------------------------------------------------------------------


def test_failures_from_every_worker_count_towards_one_circuit(tmp_path: Path) -> None:
    """consecutiveFailures 3: two failures in worker 0 and one in worker 1 open the circuit, in both."""
    clock = Clock()
    a, b = circuits(tmp_path, 0), circuits(tmp_path, 1)
    key = ("validating", "team-a/check/0", "url:https://b/x")
    in_a = CircuitBreaker(3, 10, clock, a.attach(key))
    in_b = CircuitBreaker(3, 10, clock, b.attach(key))
    in_a.record_failure(permit(in_a), "timeout")
    in_a.record_failure(permit(in_a), "timeout")
    transition = in_b.record_failure(permit(in_b), "connection refused")
    assert transition is not None and transition.state is CircuitState.OPEN
    refused, _ = in_a.admit()
    assert not isinstance(refused, CallPermit)
    assert refused.message == "circuit open after 3 consecutive failures (last: connection refused)"
    assert in_a.state is in_b.state is CircuitState.OPEN


def test_an_answer_in_another_worker_resets_the_count(tmp_path: Path) -> None:
    clock = Clock()
    a, b = circuits(tmp_path, 0), circuits(tmp_path, 1)
    in_a = CircuitBreaker(3, 10, clock, a.attach(("k",)))
    in_b = CircuitBreaker(3, 10, clock, b.attach(("k",)))
    in_a.record_failure(permit(in_a), "timeout")
    in_a.record_failure(permit(in_a), "timeout")
    in_b.record_success(permit(in_b))
    in_a.record_failure(permit(in_a), "timeout")
    assert in_a.state is CircuitState.CLOSED and in_b.failures == 1


def test_half_open_sends_one_probe_in_total_and_its_answer_closes_every_worker(tmp_path: Path) -> None:
    clock = Clock()
    a, b = circuits(tmp_path, 0), circuits(tmp_path, 1)
    in_a = CircuitBreaker(1, 10, clock, a.attach(("k",)))
    in_b = CircuitBreaker(1, 10, clock, b.attach(("k",)))
    in_a.record_failure(permit(in_a), "timeout")
    clock.now += 10
    probe = permit(in_b)
    assert probe.probe
    assert not isinstance(in_a.admit()[0], CallPermit), "the probe is out (in worker 1)"
    in_b.record_success(probe)
    assert in_a.state is CircuitState.CLOSED
    assert isinstance(in_a.admit()[0], CallPermit)


def _hammer(path: str, worker: int, rounds: int, out: multiprocessing.Queue[tuple[int, int]]) -> None:
    """A worker process: ``rounds`` failures on one circuit (threshold never reached), then probes."""
    table = SharedTable(Path(path), CIRCUITS, capacity=16, workers=4, worker=worker)
    breaker = CircuitBreaker(1_000_000, 0.05, time.monotonic, table.attach(("k",)))
    for _ in range(rounds):
        breaker.record_failure(permit(breaker), "boom")
    out.put((worker, 0))
    probes = 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and breaker.state is not CircuitState.OPEN:
        time.sleep(0.001)
    while time.monotonic() < deadline:
        admitted, _ = breaker.admit()
        if isinstance(admitted, CallPermit) and admitted.probe:
            probes += 1  # never reported: only one may be out in all processes
    out.put((worker, probes))


def test_processes_updating_one_circuit_at_once_lose_no_update_and_send_one_probe(tmp_path: Path) -> None:
    """4 processes × 500 failures at the same time: the count is exactly 2000 (every update is
    atomic across processes); once the circuit is half-open, one probe is out in total."""
    path = tmp_path / "circuits.state"
    table = SharedTable(path, CIRCUITS, capacity=16, workers=4, worker=0)
    cell = table.attach(("k",))
    assert cell is not None
    context = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[tuple[int, int]] = context.Queue()
    processes = [context.Process(target=_hammer, args=(str(path), w, 500, out)) for w in range(4)]
    for p in processes:
        p.start()
    done = [out.get(timeout=60) for _ in range(4)]
    assert all(probes == 0 for _, probes in done)
    assert cell.read().failures == 2000
    # Open it (one more failure past a threshold of 1): every process then tries to probe.
    opener = CircuitBreaker(1, 0.05, time.monotonic, cell)
    opener.record_failure(CallPermit(cell.read().epoch), "boom")
    probes = [out.get(timeout=60)[1] for _ in range(4)]
    for p in processes:
        p.join(timeout=30)
    assert sum(probes) == 1, probes


# --- slots: claim, release, reload, restart, full -------------------------------------------------


def test_a_key_has_one_record_whichever_worker_attaches_it_first(tmp_path: Path) -> None:
    a, b = circuits(tmp_path, 0), circuits(tmp_path, 1)
    first, again, other = a.attach(("k",)), a.attach(("k",)), b.attach(("k",))
    assert first is again
    assert first is not None and other is not None and first.offset == other.offset
    assert a.used == b.used == 1


def test_a_record_is_reclaimed_when_the_last_worker_releases_its_key(tmp_path: Path) -> None:
    """A reload that removes a backend: the record stays while one worker still has the old
    configuration, and is free once both reloaded; a backend added again starts closed."""
    clock = Clock()
    a, b = circuits(tmp_path, 0), circuits(tmp_path, 1)
    in_a = CircuitBreaker(1, 10, clock, a.attach(("k",)))
    b.attach(("k",))
    in_a.record_failure(permit(in_a), "timeout")
    a.release(("k",))
    assert a.used == 1
    b.release(("k",))
    assert a.used == 0
    again = CircuitBreaker(1, 10, clock, a.attach(("k",)))
    assert again.state is CircuitState.CLOSED


def test_a_released_cell_settles_a_call_in_flight_without_touching_the_table(tmp_path: Path) -> None:
    """A call admitted before a reload removed its backend ends after it: its result goes to the
    detached cell, not to whatever key the record holds by then."""
    clock = Clock()
    a = circuits(tmp_path, 0, capacity=1)
    old = CircuitBreaker(1, 10, clock, a.attach(("old",)))
    late = permit(old)
    a.release(("old",))
    new_cell = a.attach(("new",))
    assert new_cell is not None
    old.record_failure(late, "timeout")
    assert old.state is CircuitState.OPEN, "the old breaker's own view"
    assert new_cell.read() == CIRCUITS.initial, "the record now holds another key, untouched"


def test_a_restarted_worker_picks_up_the_state_and_clears_what_its_predecessor_held(tmp_path: Path) -> None:
    """Worker 0 dies without releasing; its successor (a new table in slot 0) finds the open
    circuit that worker 1 shares, and a key only the dead worker held is reclaimed."""
    clock = Clock()
    dead, b = circuits(tmp_path, 0), circuits(tmp_path, 1)
    opened = CircuitBreaker(1, 10, clock, dead.attach(("shared",)))
    b.attach(("shared",))
    dead.attach(("only-the-dead-one",))
    opened.record_failure(permit(opened), "timeout")
    assert b.used == 2
    successor = circuits(tmp_path, 0)
    assert b.used == 1, "the record held only by the dead worker was reclaimed"
    picked = CircuitBreaker(1, 10, clock, successor.attach(("shared",)))
    assert picked.state is CircuitState.OPEN


def test_a_full_table_leaves_the_key_to_the_worker_and_counts_it(tmp_path: Path) -> None:
    a = circuits(tmp_path, 0, capacity=2)
    assert a.attach(("one",)) is not None and a.attach(("two",)) is not None
    with capture_logs() as logs:
        assert a.attach(("three",)) is None
    assert a.refused == 1
    assert [e["event"] for e in logs] == [
        "shared state table full; this key keeps a state of its own in this worker"
    ]
    a.release(("one",))
    assert a.attach(("three",)) is not None, "room again after a release"


def test_probe_chains_survive_deletions(tmp_path: Path) -> None:
    """Keys whose homes collide probe past each other; deleting one in the middle (a tombstone)
    must not hide the keys after it, and emptied tails are reused."""
    a = circuits(tmp_path, 0, capacity=4)
    keys = [(f"k{i}",) for i in range(4)]
    cells = {k: a.attach(k) for k in keys}
    assert all(c is not None for c in cells.values())
    b = circuits(tmp_path, 1, capacity=4)
    for k in keys:  # worker 1 finds each key's record, wherever probing put it
        found = b.attach(k)
        assert found is not None and found.offset == cells[k].offset  # type: ignore[union-attr]
    for k in keys[:2]:
        a.release(k)
        b.release(k)
    c = circuits(tmp_path, 1, capacity=4)  # a fresh view: worker 1 restarted
    for k in keys[2:]:
        found = c.attach(k)
        assert found is not None and found.offset == cells[k].offset  # type: ignore[union-attr]
    assert a.used == 2
    assert all(a.attach((f"new{i}",)) is not None for i in range(2))
    assert a.attach(("one too many",)) is None


def test_circuit_slots_are_derived_from_the_configuration() -> None:
    small = load(config(hook("a.b.c")))
    assert circuit_slots(small) == MIN_CIRCUIT_SLOTS
    big = load(config(*(hook(f"h{i}.example.com") for i in range(100))))
    assert circuit_slots(big) == 400


# --- torn records --------------------------------------------------------------------------------


def test_a_record_left_half_written_by_a_killed_worker_is_repaired_not_read(tmp_path: Path) -> None:
    """seq odd (the writer died mid-write): readers do not take the half-written word; the first
    to lock the record resets it to the initial state and logs it."""
    clock = Clock()
    a, b = circuits(tmp_path, 0), circuits(tmp_path, 1)
    in_a = CircuitBreaker(1, 10, clock, a.attach(("k",)))
    cell_b = b.attach(("k",))
    assert cell_b is not None
    in_a.record_failure(permit(in_a), "timeout")
    offset = cell_b.offset
    seq = int.from_bytes(a.map[offset : offset + 8], "little")
    a.map[offset : offset + 8] = (seq + 1).to_bytes(8, "little")  # a write begun
    a.map[offset + a.payload_at] = 2  # half-way: the state byte says half-open
    with capture_logs() as logs:
        word = cell_b.read()
    assert word == CIRCUITS.initial
    assert [e["event"] for e in logs] == ["repairing a shared state record left half-written"]


def test_a_copy_mixing_two_writes_fails_its_checksum_and_is_read_again(tmp_path: Path) -> None:
    """A payload byte that does not belong to the record's seq (what a reader racing a writer on a
    weakly ordered CPU could copy): the CRC rejects it, whatever the seq says."""
    clock = Clock()
    a, b = circuits(tmp_path, 0), circuits(tmp_path, 1)
    in_a = CircuitBreaker(5, 10, clock, a.attach(("k",)))
    cell_b = b.attach(("k",))
    assert cell_b is not None
    in_a.record_failure(permit(in_a), "timeout")
    offset = cell_b.offset
    assert b.try_load(cell_b) is not None
    a.map[offset + a.payload_at] = 1  # state "open", seq unchanged and even
    assert b.try_load(cell_b) is None


# --- the guards and the router on shared cells -----------------------------------------------------


def test_guards_share_breakered_backends_and_release_them_on_reload(tmp_path: Path) -> None:
    clock = Clock()
    a, b = circuits(tmp_path, 0), circuits(tmp_path, 1)
    guards_a, guards_b = BackendGuards(clock, cells=a), BackendGuards(clock, cells=b)
    both = snapshot(BREAKER, "a.example.com", "b.example.com")
    guards_a.reconcile(both.mutating)  # type: ignore[attr-defined]
    guards_b.reconcile(both.mutating)  # type: ignore[attr-defined]
    assert a.used == 2
    guard = guards_a.for_webhook(both.mutating[0])  # type: ignore[attr-defined]
    for _ in range(3):
        passed = guard.before_call()
        assert isinstance(passed, Pass)
        guard.failed(passed, "timeout")
    assert dict(guards_b.states())["a.example.com"] is CircuitState.OPEN
    assert ("a.example.com", 1, True) in guards_b.circuits()
    one = snapshot(BREAKER, "b.example.com")
    guards_a.reconcile(one.mutating)  # type: ignore[attr-defined]
    assert a.used == 2, "worker 1 still has the old configuration"
    guards_b.reconcile(one.mutating)  # type: ignore[attr-defined]
    assert a.used == 1
    off = snapshot('"*": {maxInFlight: 5}', "b.example.com")
    guards_a.reconcile(off.mutating)  # type: ignore[attr-defined]
    guards_b.reconcile(off.mutating)  # type: ignore[attr-defined]
    assert a.used == 0, "a backend whose breaker is turned off needs no record"


def test_a_backend_the_table_has_no_room_for_is_reported_unshared(tmp_path: Path) -> None:
    a = circuits(tmp_path, 0, capacity=1)
    guards = BackendGuards(Clock(), cells=a)
    guards.reconcile(snapshot(BREAKER, "a.example.com", "b.example.com").mutating)  # type: ignore[attr-defined]
    assert sorted(guards.circuits()) == [("a.example.com", 0, True), ("b.example.com", 0, False)]


def test_an_endpoint_ejected_through_one_worker_is_ejected_in_the_other(tmp_path: Path) -> None:
    from gateway.sources.endpointslices import ServiceEndpoint

    clock = Clock()
    table_a = SharedTable(tmp_path / "e.state", EJECTIONS, capacity=8, workers=2, worker=0)
    table_b = SharedTable(tmp_path / "e.state", EJECTIONS, capacity=8, workers=2, worker=1)
    service = ("team-a", "hook", 443)
    endpoints = [
        ServiceEndpoint("10.0.0.1", 8443, True, False),
        ServiceEndpoint("10.0.0.2", 8443, True, False),
    ]
    router_a = EndpointRouter(clock, eject_after=3, cells=table_a)
    router_b = EndpointRouter(clock, eject_after=3, cells=table_b)
    router_a.update(service, endpoints)
    router_b.update(service, endpoints)
    bad_a = router_a.pickers[service].endpoints[("10.0.0.1", 8443)]
    bad_b = router_b.pickers[service].endpoints[("10.0.0.1", 8443)]
    for picker, bad in (
        (router_a.pickers[service], bad_a),
        (router_b.pickers[service], bad_b),
        (router_a.pickers[service], bad_a),
    ):
        picker.started(bad)
        picker.finished(bad, connect_failed=True)
    assert bad_b.ejected_until == clock.now + 30
    assert all(router_b.pickers[service].pick().address == "10.0.0.2" for _ in range(20))  # type: ignore[union-attr]
    assert table_a.used == 2
    router_a.update(service, None)
    router_b.update(service, endpoints[1:])
    assert table_a.used == 1, "the endpoint gone from the slices of both workers is reclaimed"
    assert isinstance(bad_b.cell.read(), EjectionWord)
    assert tag_of((*service, "10.0.0.1", 8443)) != tag_of((*service, "10.0.0.2", 8443))


# --- bulkheads: calls in flight of every worker -----------------------------------------------------


def counters(path: Path, worker: int, *, workers: int = 2) -> SharedCounters:
    return SharedCounters(path / "in_flight.state", capacity=16, workers=workers, worker=worker)


def test_max_in_flight_bounds_the_calls_of_all_workers_together(tmp_path: Path) -> None:
    """maxInFlight 2: one call in flight in each worker fills it; a release in either frees a slot."""
    a, b = counters(tmp_path, 0), counters(tmp_path, 1)
    in_a, in_b = Bulkhead(2, a.attach(("k",))), Bulkhead(2, b.attach(("k",)))
    first, second = in_a.try_acquire(), in_b.try_acquire()
    assert first is not None and second is not None
    assert in_a.try_acquire() is None and in_b.try_acquire() is None
    assert in_a.in_flight == in_b.in_flight == 2
    in_b.release(second)
    assert in_a.try_acquire() is not None


def test_the_calls_of_a_dead_worker_are_not_counted_after_its_restart(tmp_path: Path) -> None:
    dead, b = counters(tmp_path, 0), counters(tmp_path, 1)
    in_dead, in_b = Bulkhead(2, dead.attach(("k",))), Bulkhead(2, b.attach(("k",)))
    assert in_dead.try_acquire() is not None and in_dead.try_acquire() is not None
    assert in_b.try_acquire() is None
    counters(tmp_path, 0)  # its successor in the same slot
    assert in_b.in_flight == 0
    assert in_b.try_acquire() is not None


def test_a_released_key_takes_this_workers_calls_out_of_the_count(tmp_path: Path) -> None:
    """A reload that removes the backend's maxInFlight: the calls still in flight finish in the
    detached counter; the other workers' count no longer includes them, and never goes negative."""
    a, b = counters(tmp_path, 0), counters(tmp_path, 1)
    in_a, in_b = Bulkhead(1, a.attach(("k",))), Bulkhead(1, b.attach(("k",)))
    token = in_a.try_acquire()
    assert token is not None and in_b.in_flight == 1
    a.release(("k",))
    assert in_b.in_flight == 0
    in_a.release(token)
    assert in_b.in_flight == 0 and in_a.in_flight == 0


def test_guards_share_bulkheads_and_release_them_on_reload(tmp_path: Path) -> None:
    a, b = counters(tmp_path, 0), counters(tmp_path, 1)
    guards_a, guards_b = BackendGuards(Clock(), in_flight=a), BackendGuards(Clock(), in_flight=b)
    limited = snapshot('"*": {maxInFlight: 1}', "a.example.com")
    guards_a.reconcile(limited.mutating)  # type: ignore[attr-defined]
    guards_b.reconcile(limited.mutating)  # type: ignore[attr-defined]
    held = guards_a.for_webhook(limited.mutating[0]).before_call()  # type: ignore[attr-defined]
    assert isinstance(held, Pass)
    refused = guards_b.for_webhook(limited.mutating[0]).before_call()  # type: ignore[attr-defined]
    assert isinstance(refused, Refusal) and refused.reason == "max_in_flight"
    unlimited = snapshot("", "a.example.com")
    guards_a.reconcile(unlimited.mutating)  # type: ignore[attr-defined]
    guards_b.reconcile(unlimited.mutating)  # type: ignore[attr-defined]
    assert a.used == 0
    guards_a.for_webhook(limited.mutating[0]).succeeded(held)  # type: ignore[attr-defined]


# --- /metrics with several workers -----------------------------------------------------------------


def _states(metrics: Metrics) -> dict[str, float]:
    text = metrics.render()[0].decode()
    return {
        s.labels["webhook"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "webhook_gateway_backend_circuit_state"
    }


CIRCUIT_STATES = [
    pytest.param(
        [("a.example.com", 1, True)], [[("a.example.com", 0.0)]], [[]], {"a.example.com": 1.0},
        id="a shared circuit: the live state read now, not another worker's older snapshot",
    ),
    pytest.param(
        [("a.example.com", 1, False)], [[("a.example.com", 0.0)]], [[]], {},
        id="a circuit one worker keeps alone (table full), workers disagree: no state shown",
    ),
    pytest.param(
        [("a.example.com", 1, False)], [[("a.example.com", 1.0)]], [[]], {"a.example.com": 1.0},
        id="a circuit kept per worker on which every worker agrees: shown",
    ),
    pytest.param(
        [("a.example.com", 0, True)], [[("a.example.com", 1.0)]], [["a.example.com"]], {},
        id="shared here but another worker keeps it alone, and they disagree: no state shown",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("live", "others", "others_unshared", "expected"), CIRCUIT_STATES)
def test_metrics_show_only_circuit_states_every_worker_acts_on(
    live: list[tuple[str, int, bool]],
    others: list[list[tuple[str, float]]],
    others_unshared: list[list[str]],
    expected: dict[str, float],
) -> None:
    own = Metrics()
    own.set_circuit_source(lambda: live)
    snapshots = [capture(own)]
    for rows, unshared in zip(others, others_unshared, strict=True):
        snapshots.append(
            MetricsSnapshot(
                pid=1,
                families={
                    "webhook_gateway_backend_circuit_state": [((name,), value, []) for name, value in rows]
                },
                unshared_circuits=unshared,
            )
        )
    combined = Metrics()
    merge(combined, snapshots)
    _circuit_states(combined, own, snapshots)
    assert _states(combined) == expected
    assert "webhook_gateway_backend_circuit_state" in GAUGE_MERGE
