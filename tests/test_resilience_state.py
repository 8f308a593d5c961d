"""The resilience state machines (circuit breaker, bulkhead, shedder, guards) on a virtual clock.

Pure code, so no sockets here: time is a counter the tests move. The wire-level behaviour (a stalled
backend answered in milliseconds while its circuit is open) belongs to the dispatch tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.backend_policy import BackendPolicy, CircuitBreakerPolicy
from gateway.resilience import (
    BackendGuards,
    Bulkhead,
    CallPermit,
    CircuitBreaker,
    CircuitOpen,
    CircuitState,
    Pass,
    Refusal,
    ReviewSlot,
    Shedder,
    ShedPolicy,
    Transition,
)
from tests.configs.builders import config, hook, load


@dataclass
class VirtualClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def permit(breaker: CircuitBreaker) -> CallPermit:
    admitted, _ = breaker.admit()
    assert isinstance(admitted, CallPermit), admitted
    return admitted


# --- circuit breaker ---------------------------------------------------------------------------------

# Each step: ("ok" | "fail" | "wait <s>" | "admit"), and the state expected after it.
BREAKER_STORIES = [
    pytest.param(
        [("fail", "closed"), ("fail", "closed"), ("fail", "open")],
        id="three consecutive call errors open a circuit of consecutiveFailures 3",
    ),
    pytest.param(
        [("fail", "closed"), ("fail", "closed"), ("ok", "closed"), ("fail", "closed"), ("fail", "closed")],
        id="an answer in between resets the count: failures must be consecutive",
    ),
    pytest.param(
        [("fail", "closed"), ("fail", "closed"), ("fail", "open"), ("wait 9.9", "open")],
        id="the circuit stays open for openSeconds",
    ),
    pytest.param(
        [("fail", "closed"), ("fail", "closed"), ("fail", "open"), ("wait 10", "half-open")],
        id="after openSeconds the circuit is half-open",
    ),
    pytest.param(
        [("fail", "closed"), ("fail", "closed"), ("fail", "open"), ("wait 10", "half-open"), ("ok", "closed")],
        id="half-open: a successful probe closes the circuit",
    ),
    pytest.param(
        [
            ("fail", "closed"), ("fail", "closed"), ("fail", "open"), ("wait 10", "half-open"),
            ("fail", "open"), ("wait 9", "open"), ("wait 1", "half-open"),
        ],
        id="half-open: a failed probe opens the circuit for another openSeconds",
    ),
]  # fmt: skip


@pytest.mark.parametrize("story", BREAKER_STORIES)
def test_circuit_breaker_story(story: list[tuple[str, str]]) -> None:
    """Each step moves the breaker (consecutiveFailures 3, openSeconds 10) as the policy says."""
    clock = VirtualClock()
    breaker = CircuitBreaker(3, 10, clock)
    for step, expected in story:
        if step.startswith("wait"):
            clock.advance(float(step.split()[1]))
        elif step == "ok":
            breaker.record_success(permit(breaker))
        else:
            breaker.record_failure(permit(breaker), "connection refused")
        assert breaker.state.label == expected, step


def test_open_circuit_refuses_with_the_count_and_the_last_error() -> None:
    """While open, every call is refused at once with a message naming N and the last error."""
    clock = VirtualClock()
    breaker = CircuitBreaker(2, 10, clock)
    breaker.record_failure(permit(breaker), "timeout")
    breaker.record_failure(permit(breaker), 'Post "https://b/x": connection refused')
    refused, transition = breaker.admit()
    assert isinstance(refused, CircuitOpen)
    assert transition is None
    assert refused.message == (
        'circuit open after 2 consecutive failures (last: Post "https://b/x": connection refused)'
    )
    assert refused.retry_at == clock.now + 10


def test_half_open_lets_exactly_one_probe_through() -> None:
    """Half-open: the first call is the probe; the others are refused until it reports."""
    clock = VirtualClock()
    breaker = CircuitBreaker(1, 5, clock)
    breaker.record_failure(permit(breaker), "timeout")
    clock.advance(5)
    probe, transition = breaker.admit()
    assert isinstance(probe, CallPermit) and probe.probe
    assert transition == Transition(CircuitState.OPEN, CircuitState.HALF_OPEN, clock.now)
    second, _ = breaker.admit()
    assert isinstance(second, CircuitOpen)
    assert breaker.record_success(probe) == Transition(CircuitState.HALF_OPEN, CircuitState.CLOSED, clock.now)
    assert isinstance(breaker.admit()[0], CallPermit)


def test_an_abandoned_probe_frees_the_slot_for_the_next_review() -> None:
    """A probe cancelled without a result (the caller went away) says nothing: the next call probes."""
    clock = VirtualClock()
    breaker = CircuitBreaker(1, 5, clock)
    breaker.record_failure(permit(breaker), "timeout")
    clock.advance(5)
    probe = permit(breaker)
    breaker.record_abandoned(probe)
    again = permit(breaker)
    assert again.probe
    assert breaker.state is CircuitState.HALF_OPEN


def test_results_of_calls_from_an_older_state_are_ignored() -> None:
    """A slow call admitted while closed that fails after the circuit opened does not re-open it; one
    that succeeds during the probe does not close it: only the probe decides."""
    clock = VirtualClock()
    breaker = CircuitBreaker(1, 5, clock)
    slow = permit(breaker)
    breaker.record_failure(permit(breaker), "timeout")
    assert breaker.state is CircuitState.OPEN
    clock.advance(5)
    probe = permit(breaker)
    assert breaker.record_success(slow) is None
    assert breaker.record_failure(slow, "late") is None
    assert breaker.state is CircuitState.HALF_OPEN
    breaker.record_success(probe)
    assert breaker.state is CircuitState.CLOSED


def test_a_probe_that_never_reports_is_given_up_after_its_lease() -> None:
    """A probe whose worker was killed never reports: after probe_lease seconds the next call probes
    (one at a time still), instead of a circuit refusing for ever."""
    clock = VirtualClock()
    breaker = CircuitBreaker(1, 5, clock, probe_lease=35)
    breaker.record_failure(permit(breaker), "timeout")
    clock.advance(5)
    lost = permit(breaker)
    assert lost.probe
    clock.advance(34.9)
    refused, _ = breaker.admit()
    assert isinstance(refused, CircuitOpen) and refused.retry_at == pytest.approx(clock.now + 0.1)
    clock.advance(0.1)
    again = permit(breaker)
    assert again.probe
    assert isinstance(breaker.admit()[0], CircuitOpen), "one probe at a time"
    breaker.record_success(again)
    assert breaker.state is CircuitState.CLOSED


def test_reconfigure_keeps_the_open_period() -> None:
    """New thresholds from a reload do not close an open circuit."""
    clock = VirtualClock()
    breaker = CircuitBreaker(1, 10, clock)
    breaker.record_failure(permit(breaker), "timeout")
    breaker.reconfigure(5, 20)
    clock.advance(15)
    assert breaker.state is CircuitState.OPEN
    clock.advance(5)
    assert breaker.state is CircuitState.HALF_OPEN


EVENTS = st.lists(
    st.one_of(
        st.just(("admit",)),
        st.tuples(st.just("ok"), st.integers(0, 5)),
        st.tuples(st.just("fail"), st.integers(0, 5)),
        st.tuples(st.just("abandon"), st.integers(0, 5)),
        st.tuples(st.just("wait"), st.floats(0, 7, allow_nan=False)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(events=EVENTS, threshold=st.integers(1, 4))
def test_circuit_breaker_invariants(events: list[tuple[Any, ...]], threshold: int) -> None:
    """Any interleaving: at most one probe out (within its lease); calls pass while open only if
    openSeconds are over; the circuit opens only on a failure; the state reported in transitions is
    the state read after."""
    clock = VirtualClock()
    breaker = CircuitBreaker(threshold, 5, clock, probe_lease=20)
    outstanding: list[CallPermit] = []
    leased: dict[int, float] = {}  # id(probe permit) -> when its lease ends
    for event in events:
        if event[0] == "admit":
            before = breaker.state
            admitted, _ = breaker.admit()
            if isinstance(admitted, CallPermit):
                assert before is not CircuitState.OPEN
                outstanding.append(admitted)
                if admitted.probe:
                    leased[id(admitted)] = clock.now + 20
            else:
                assert before is not CircuitState.CLOSED
            current = [
                p for p in outstanding if p.probe and p.epoch == breaker.epoch and leased[id(p)] > clock.now
            ]
            assert len(current) <= 1
        elif event[0] == "wait":
            clock.advance(event[1])
        elif outstanding:
            p = outstanding.pop(event[1] % len(outstanding))
            before = breaker.state
            if event[0] == "ok":
                transition = breaker.record_success(p)
                assert transition is None or transition.state is CircuitState.CLOSED
            elif event[0] == "fail":
                transition = breaker.record_failure(p, "boom")
                assert transition is None or transition.state is CircuitState.OPEN
            else:
                breaker.record_abandoned(p)
                transition = None
                assert breaker.state is before
            if transition is not None:
                assert breaker.state is transition.state


# --- bulkhead ----------------------------------------------------------------------------------------


def test_bulkhead_refuses_over_max_in_flight_and_releases_once() -> None:
    """maxInFlight 2: a third call is refused; a release frees one slot; a double release is a no-op."""
    bulkhead = Bulkhead(2)
    a, b = bulkhead.try_acquire(), bulkhead.try_acquire()
    assert a is not None and b is not None
    assert bulkhead.try_acquire() is None
    bulkhead.release(a)
    bulkhead.release(a)
    assert bulkhead.in_flight == 1
    assert bulkhead.try_acquire() is not None
    assert bulkhead.try_acquire() is None


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 5), ops=st.lists(st.booleans(), max_size=50))
def test_bulkhead_never_exceeds_its_limit(limit: int, ops: list[bool]) -> None:
    """Any sequence of acquires (True) and releases (False): in flight stays within 0..limit."""
    bulkhead = Bulkhead(limit)
    held = []
    for acquire in ops:
        if acquire:
            token = bulkhead.try_acquire()
            assert (token is None) == (len(held) == limit)
            if token is not None:
                held.append(token)
        elif held:
            bulkhead.release(held.pop())
        assert 0 <= bulkhead.in_flight == len(held) <= limit


# --- shedding ----------------------------------------------------------------------------------------

SHED_CASES = [
    pytest.param(ShedPolicy(), 1000, [5.0], None, 0.0, id="no predictor configured: never shed"),
    pytest.param(ShedPolicy(max_in_flight=3), 2, [], None, 0.0, id="in-flight bound: below it, start"),
    pytest.param(ShedPolicy(max_in_flight=3), 3, [], "in_flight", 0.0, id="in-flight bound: at it, shed"),
    pytest.param(
        ShedPolicy(max_event_loop_lag=0.2), 0, [0.1], None, 0.0, id="event-loop lag below the threshold: start"
    ),
    pytest.param(
        ShedPolicy(max_event_loop_lag=0.2), 0, [0.3], "event_loop_lag", 0.0, id="event-loop lag over it: shed"
    ),
    pytest.param(
        ShedPolicy(max_in_flight=3, max_event_loop_lag=0.2), 3, [0.3], "in_flight", 0.0,
        id="both say shed: the in-flight bound is named (it is exact)",
    ),
    pytest.param(
        ShedPolicy(max_cpu_share=0.85), 0, [], None, 0.84,
        id="the process used 84 % of the CPU it may use, --shed-max-cpu 0.85: start",
    ),
    pytest.param(
        ShedPolicy(max_cpu_share=0.85), 0, [], "cpu", 0.85,
        id="it used 85 %: shed, before the CPU quota stalls the event loop",
    ),
    pytest.param(
        ShedPolicy(max_in_flight=3), 0, [], None, 1.0,
        id="no CPU threshold: a process at its whole CPU is not shed for it",
    ),
    pytest.param(
        ShedPolicy(max_event_loop_lag=0.2, max_cpu_share=0.85), 0, [0.3], "event_loop_lag", 0.9,
        id="lag and CPU both say shed: the lag is named",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "in_flight", "lags", "expected", "cpu"), SHED_CASES)
def test_shedder_decides(
    policy: ShedPolicy, in_flight: int, lags: list[float], expected: str | None, cpu: float
) -> None:
    clock = VirtualClock()
    shedder = Shedder(policy, clock, lambda: cpu)
    for _ in range(in_flight):
        assert isinstance(shedder.try_start(), ReviewSlot)
    for lag in lags:
        shedder.observe_lag(lag)
    result = shedder.try_start()
    assert (None if isinstance(result, ReviewSlot) else result) == expected


def test_lag_samples_expire_and_an_overdue_probe_counts_as_lag() -> None:
    """A lag spike counts for lag_window; a probe that has not reported for long is lag itself."""
    clock = VirtualClock()
    shedder = Shedder(ShedPolicy(max_event_loop_lag=0.2, lag_probe_interval=0.05, lag_window=1.0), clock)
    shedder.observe_lag(0.5)
    assert shedder.try_start() == "event_loop_lag"
    clock.advance(1.01)
    shedder.observe_lag(0.0)
    assert isinstance(shedder.try_start(), ReviewSlot)
    clock.advance(0.3)  # no sample for 0.3 s: the loop is 0.25 s late at least
    assert shedder.lag() == pytest.approx(0.25)
    assert shedder.try_start() == "event_loop_lag"


def test_a_loop_blocked_before_the_first_sample_counts_as_lag() -> None:
    """A loop blocked right after the probe started, before its first sample, is lag: how overdue the first sample is."""
    clock = VirtualClock()
    shedder = Shedder(ShedPolicy(max_event_loop_lag=0.2, lag_probe_interval=0.05, lag_window=1.0), clock)
    shedder.probe_started()
    assert isinstance(shedder.try_start(), ReviewSlot)
    clock.advance(0.5)  # the first sample was due at 0.05 s
    assert shedder.lag() == pytest.approx(0.45)
    assert shedder.try_start() == "event_loop_lag"


def test_finished_reviews_free_the_in_flight_bound() -> None:
    shedder = Shedder(ShedPolicy(max_in_flight=1), VirtualClock())
    slot = shedder.try_start()
    assert isinstance(slot, ReviewSlot)
    assert shedder.try_start() == "in_flight"
    shedder.finish(slot)
    shedder.finish(slot)
    assert shedder.in_flight == 0
    assert isinstance(shedder.try_start(), ReviewSlot)


# --- guards and reload -------------------------------------------------------------------------------

ANNOTATION = "webhook-gateway.io/backend-policy"


def snapshot_with(policy: str, *names: str, url: str = "https://backend.example.com/hook") -> Any:
    doc = config(*(hook(n, clientConfig={"url": url}) for n in names))
    doc["metadata"]["annotations"] = {ANNOTATION: policy}
    return load(doc)


def test_guard_refuses_when_open_then_over_max_in_flight() -> None:
    """The circuit is asked first (circuit_open), then the bulkhead (max_in_flight); a refusal from
    the bulkhead hands a half-open probe back so the next call can probe."""
    clock = VirtualClock()
    transitions: list[tuple[str, CircuitState]] = []
    guards = BackendGuards(clock, lambda name, t: transitions.append((name, t.state)))
    snap = snapshot_with(
        '"*": {circuitBreaker: {consecutiveFailures: 1, openSeconds: 5}, maxInFlight: 1}', "a.b.c"
    )
    guards.reconcile(snap.mutating)
    guard = guards.for_webhook(snap.mutating[0])
    first = guard.before_call()
    assert isinstance(first, Pass)
    over = guard.before_call()
    assert over == Refusal("max_in_flight", "1 calls already in flight (maxInFlight 1)")
    guard.failed(first, "timeout")
    refused = guard.before_call()
    assert isinstance(refused, Refusal) and refused.reason == "circuit_open"
    clock.advance(5)
    probe = guard.before_call()
    assert isinstance(probe, Pass)
    assert isinstance(guard.before_call(), Refusal)
    guard.succeeded(probe)
    assert transitions == [
        ("a.b.c", CircuitState.OPEN),
        ("a.b.c", CircuitState.HALF_OPEN),
        ("a.b.c", CircuitState.CLOSED),
    ]


def test_a_backend_without_policy_is_never_refused() -> None:
    guards = BackendGuards(VirtualClock())
    snap = load(config(hook("a.b.c")))
    guard = guards.for_webhook(snap.mutating[0])
    passes = [guard.before_call() for _ in range(1000)]
    assert all(isinstance(p, Pass) for p in passes)
    assert guard.mode == "Enforce"


RELOADS = [
    pytest.param(
        '"*": {circuitBreaker: {consecutiveFailures: 1, openSeconds: 60}}',
        '"*": {circuitBreaker: {consecutiveFailures: 1, openSeconds: 60}}',
        "https://backend.example.com/hook",
        CircuitState.OPEN,
        id="reload with the backend unchanged: its open circuit stays open",
    ),
    pytest.param(
        '"*": {circuitBreaker: {consecutiveFailures: 1, openSeconds: 60}}',
        '"*": {circuitBreaker: {consecutiveFailures: 3, openSeconds: 60}, maxInFlight: 5}',
        "https://backend.example.com/hook",
        CircuitState.OPEN,
        id="reload with new settings for the backend: its circuit state is kept",
    ),
    pytest.param(
        '"*": {circuitBreaker: {consecutiveFailures: 1, openSeconds: 60}}',
        '"*": {circuitBreaker: {consecutiveFailures: 1, openSeconds: 60}}',
        "https://other.example.com/hook",
        CircuitState.CLOSED,
        id="reload moving the webhook to another URL: a new backend starts closed",
    ),
]


@pytest.mark.parametrize(("before", "after", "url", "expected"), RELOADS)
def test_reload_keeps_state_of_unchanged_backends(
    before: str, after: str, url: str, expected: CircuitState
) -> None:
    clock = VirtualClock()
    guards = BackendGuards(clock)
    old = snapshot_with(before, "a.b.c", "d.e.f")
    guards.reconcile(old.mutating)
    guard = guards.for_webhook(old.mutating[0])
    passed = guard.before_call()
    assert isinstance(passed, Pass)
    guard.failed(passed, "timeout")
    new = snapshot_with(after, "a.b.c", "d.e.f", url=url)
    result = guards.reconcile(new.mutating)
    assert guards.for_webhook(new.mutating[0]).circuit_state is expected
    assert len(guards) == 2
    assert (result.kept, result.added, result.removed) == (
        (2, 0, 0) if expected is CircuitState.OPEN else (0, 2, 2)
    )


def test_reload_keeps_calls_in_flight_counted() -> None:
    """A new maxInFlight applies to the calls already in flight: they are not forgotten."""
    guards = BackendGuards(VirtualClock())
    old = snapshot_with('"*": {maxInFlight: 2}', "a.b.c")
    guards.reconcile(old.mutating)
    held = [guards.for_webhook(old.mutating[0]).before_call() for _ in range(2)]
    new = snapshot_with('"*": {maxInFlight: 3}', "a.b.c")
    guards.reconcile(new.mutating)
    guard = guards.for_webhook(new.mutating[0])
    third = guard.before_call()
    assert isinstance(third, Pass)
    assert isinstance(guard.before_call(), Refusal)
    first = held[0]
    assert isinstance(first, Pass)
    guard.succeeded(first)
    assert isinstance(guard.before_call(), Pass)


def test_states_lists_backends_with_a_breaker() -> None:
    guards = BackendGuards(VirtualClock())
    snap = snapshot_with('"*": {maxInFlight: 2}\nd.e.f: {circuitBreaker: {}}', "a.b.c", "d.e.f")
    guards.reconcile(snap.mutating)
    assert dict(guards.states()) == {"d.e.f": CircuitState.CLOSED}
    assert snap.mutating[1].backend_policy == BackendPolicy(
        circuit_breaker=CircuitBreakerPolicy(), max_in_flight=2
    )
