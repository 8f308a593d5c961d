"""Reinvocation bookkeeping of the mutating chain (MUT-15..19)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gateway.dispatch.reinvocation import ReinvocationState


@dataclass(frozen=True)
class Backend:
    """One backend of a scenario: its policy and what it does in each round."""

    name: str
    if_needed: bool = False
    changes_in: frozenset[int] = field(default_factory=frozenset)  # rounds in which it changes the object
    matches_in: frozenset[int] = frozenset({0, 1})  # rounds in which it matches the (current) object


def backend(
    name: str, policy: str, *, changes: set[int] | None = None, matches: set[int] | None = None
) -> Backend:
    return Backend(
        name=f"cfg/{name}/0",  # ORD-03 identity
        if_needed=policy == "IfNeeded",
        changes_in=frozenset(changes or ()),
        matches_in=frozenset({0, 1} if matches is None else matches),
    )


def run_chain(backends: list[Backend]) -> list[tuple[int, str]]:
    """Drive the two rounds as the mutating dispatcher does; return (round, backend) per invocation."""
    state = ReinvocationState()
    calls: list[tuple[int, str]] = []
    for b in backends:
        if 0 in b.matches_in:
            calls.append((0, b.name.split("/")[1]))
            state.record(b.name, if_needed=b.if_needed, changed=0 in b.changes_in)
    if state.should_run_round_1:
        for b in backends:
            if 1 in b.matches_in and state.should_reinvoke(b.name):
                calls.append((1, b.name.split("/")[1]))
                state.record(b.name, if_needed=b.if_needed, changed=1 in b.changes_in)
    return calls


@pytest.mark.parametrize(
    ("backends", "expected"),
    [
        pytest.param(
            [backend("A", "IfNeeded"), backend("B", "Never", changes={0})],
            [(0, "A"), (0, "B"), (1, "A")],
            id="MUT-19: A(IfNeeded, no change), B(Never, changes) → round 1 calls A",
        ),
        pytest.param(
            [backend("A", "IfNeeded", changes={0}), backend("B", "IfNeeded")],
            [(0, "A"), (0, "B")],
            id="MUT-19: A(IfNeeded, changes), B(IfNeeded, no change) → round 1 calls nobody",
        ),
        pytest.param(
            [backend("A", "IfNeeded"), backend("B", "IfNeeded")],
            [(0, "A"), (0, "B")],
            id="MUT-16: no change in round 0 → no round 1",
        ),
        pytest.param(
            [backend("A", "IfNeeded"), backend("B", "IfNeeded"), backend("C", "Never", changes={0})],
            [(0, "A"), (0, "B"), (0, "C"), (1, "A"), (1, "B")],
            id="MUT-15: a change moves every invoked IfNeeded backend into R",
        ),
        pytest.param(
            [backend("A", "Never"), backend("B", "Never", changes={0})],
            [(0, "A"), (0, "B")],
            id="MUT-15: Never backends never enter P, so round 1 calls nobody",
        ),
        pytest.param(
            [backend("A", "IfNeeded"), backend("B", "Never", changes={0}), backend("C", "IfNeeded")],
            [(0, "A"), (0, "B"), (0, "C"), (1, "A")],
            id="MUT-15: only backends invoked before the change move to R",
        ),
        pytest.param(
            [backend("A", "IfNeeded", changes={1}), backend("B", "IfNeeded", changes={0})],
            [(0, "A"), (0, "B"), (1, "A"), (1, "B")],
            id="MUT-18: a change by a reinvoked backend makes a later IfNeeded backend eligible in round 1",
        ),
        pytest.param(
            [
                backend("A", "IfNeeded"),
                backend("B", "IfNeeded", changes={0, 1}),
                backend("C", "Never", changes={0}),
            ],
            [(0, "A"), (0, "B"), (0, "C"), (1, "A"), (1, "B")],
            id="MUT-18: one earlier in the list is not called again after a round-1 change",
        ),
        pytest.param(
            [backend("A", "IfNeeded", changes={0, 1}), backend("B", "IfNeeded", changes={0, 1})],
            [(0, "A"), (0, "B"), (1, "A"), (1, "B")],
            id="MUT-16: never a round 2 — each backend is invoked at most twice",
        ),
        pytest.param(
            [backend("A", "Never", changes={0}), backend("B", "IfNeeded", matches={1})],
            [(0, "A")],
            id="MUT-17: a backend not invoked in round 0 is never invoked in round 1, even if it matches now",
        ),
        pytest.param(
            [backend("A", "IfNeeded", matches={0}), backend("B", "Never", changes={0})],
            [(0, "A"), (0, "B")],
            id="MUT-16: round 1 calls a backend in R only if it matches again",
        ),
        pytest.param(
            [backend("A", "Never", changes={0}), backend("B", "Never", changes={0})],
            [(0, "A"), (0, "B")],
            id="MUT-19: changes by Never backends set the flag, and R empty means nobody is called",
        ),
    ],
)
def test_reinvocation_scenarios(backends: list[Backend], expected: list[tuple[int, str]]) -> None:
    """MUT-15..19: which backends are invoked in which round."""
    assert run_chain(backends) == expected


def test_ignored_failed_if_needed_backend_enters_p() -> None:
    """MUT-15: an ignored call error counts as 'no change'; an IfNeeded backend still enters P."""
    state = ReinvocationState()
    state.record("cfg/failing/0", if_needed=True, changed=False)  # its call failed, failurePolicy Ignore
    assert state.previously_invoked == {"cfg/failing/0"}
    state.record("cfg/changer/0", if_needed=False, changed=True)
    assert state.should_reinvoke("cfg/failing/0")


@pytest.mark.parametrize(
    ("records", "p", "r", "flag"),
    [
        pytest.param([], set(), set(), False, id="MUT-15: a new review starts empty"),
        pytest.param([("a", True, False)], {"a"}, set(), False, id="MUT-15: IfNeeded enters P"),
        pytest.param([("a", False, False)], set(), set(), False, id="MUT-15: Never does not enter P"),
        pytest.param([("a", True, True)], {"a"}, set(), True,
                     id="MUT-15: a backend's own change moves P first, then it enters P"),
        pytest.param([("a", True, False), ("b", False, True)], set(), {"a"}, True,
                     id="MUT-15: a change moves all of P into R and empties P"),
        pytest.param([("a", True, False), ("b", True, True), ("c", True, False), ("d", False, True)],
                     set(), {"a", "b", "c"}, True, id="MUT-15/18: R only grows"),
        pytest.param([("cfg/x/0", True, False), ("cfg/x/1", False, True)], set(), {"cfg/x/0"}, True,
                     id="MUT-15/ORD-03: identities with the same webhook name are distinct"),
    ],
)  # fmt: skip
def test_state_after_records(
    records: list[tuple[str, bool, bool]], p: set[str], r: set[str], flag: bool
) -> None:
    """MUT-15: P, R and the flag after a sequence of invocations."""
    state = ReinvocationState()
    for identity, if_needed, changed in records:
        state.record(identity, if_needed=if_needed, changed=changed)
    assert state.previously_invoked == p
    assert state.to_reinvoke == r
    assert state.should_run_round_1 is flag
    assert all(state.should_reinvoke(i) for i in r)
    assert repr(state) == f"<ReinvocationState reinvoke={flag} P={sorted(p)} R={sorted(r)}>"
