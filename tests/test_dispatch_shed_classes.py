"""Shed reviews alike share one verdict (``Dispatcher.decide_shed``), and nothing else does.

Under overload most reviews are shed and most are alike, so a shed verdict is walked once per
class of reviews and snapshot. Each row changes one thing the verdict reads that a socket test
cannot change by itself (tests/test_server_shed_at_once.py has the ones a review carries): the
namespace's labels in the label source, the deadline, the shedding reason, the snapshot, a
Shadow backend. The second review must get the verdict ``decide(..., shed=)`` gives it, and the
first one's only when the row says so. The label source and backends are in-memory stand-ins of
dispatch's ports (no backend is ever called here); nothing is timed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from gateway.config.load import load_documents
from gateway.dispatch.engine import Dispatcher
from gateway.dispatch.shadow import ShadowCalls, ShadowResult
from gateway.review import decode_inbound
from tests.support.gateway import hook, review
from tests.test_dispatch_deadlines import VirtualBackends, snapshot
from tests.test_gateway_modes import VALIDATING, config

SELECTOR = {"matchLabels": {"team": "shop"}}


class Labels:
    """Namespace labels known now, changed by the test between two reviews (an informer's update)."""

    def __init__(self) -> None:
        self.known = {"shop": {"team": "shop"}}

    async def labels(self, name: str) -> dict[str, str]:
        raise AssertionError("a shed review never waits for a lookup")

    def labels_now(self, name: str) -> dict[str, str] | None:
        return self.known.get(name)


def _shop_relabelled(labels: Labels) -> None:
    labels.known["shop"] = {"team": "cafe"}


CASES = [
    pytest.param(
        {},
        lambda labels, snap: ({}, snap),
        True,
        id="FPT-01: the same review again, under the same snapshot: the first verdict, not walked again",
    ),
    pytest.param(
        {"namespaceSelector": SELECTOR},
        lambda labels, snap: ({}, snap),
        True,
        id="MAT-13: the same namespace with the same labels: the first verdict",
    ),
    pytest.param(
        {"namespaceSelector": SELECTOR},
        lambda labels, snap: (_shop_relabelled(labels) or {}, snap),
        False,
        id="MAT-13: the namespace relabelled in the label source, the snapshot unchanged: decided again",
    ),
    pytest.param(
        {},
        lambda labels, snap: ({"deadline": -1.0}, snap),
        False,
        id="FPT-08: a review whose deadline has passed is refused for that, not with the shed verdict",
    ),
    pytest.param(
        {},
        lambda labels, snap: ({"shed": "event_loop_lag"}, snap),
        False,
        id="GW: another shedding reason gives another message: decided again",
    ),
    pytest.param(
        {},
        lambda labels, snap: ({}, snapshot(hook("sel.example.com", "https://x", failurePolicy="Ignore"))),
        False,
        id="ORD-04: a new snapshot (a reload, the backend now Ignore) decides its reviews itself",
    ),
]


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.mark.parametrize(("fields", "change", "shared"), CASES)
async def test_a_shed_verdict_is_shared_only_by_reviews_it_reads_alike(
    autojump_clock: Any, fields: dict[str, Any], change: Any, shared: bool
) -> None:
    backends = VirtualBackends({})
    snap = snapshot(hook("sel.example.com", "https://x", **fields))
    labels = Labels()
    dispatcher = Dispatcher(backends, labels)
    first = dispatcher.decide_shed(
        "validating",
        decode_inbound(json.dumps(review()).encode()),
        snap,
        deadline=trio.current_time() + 5,
        shed="in_flight",
    )
    given, snap = change(labels, snap)
    doc = decode_inbound(json.dumps(review()).encode())
    deadline = trio.current_time() + given.get("deadline", 5.0)
    shed = given.get("shed", "in_flight")
    second = dispatcher.decide_shed("validating", doc, snap, deadline=deadline, shed=shed)
    ordinary = await dispatcher.decide("validating", doc, snap, deadline=deadline, shed=shed)
    assert first is not None and second is not None
    assert (second is first) is shared
    assert dispatcher.shed_verdicts_reused == int(shared)
    assert (second.allowed, second.status, second.audit_annotations) == (
        ordinary.allowed,
        ordinary.status,
        ordinary.audit_annotations,
    )
    if not shared:
        assert (first.allowed, first.status) != (second.allowed, second.status), "the row changes the verdict"
    assert backends.calls == []


async def test_a_review_with_a_shadow_backend_is_walked_every_time(autojump_clock: Any) -> None:
    """A Shadow call is started apart from the review (and refused there, shed): every shed review
    reports its own, so none shares a verdict."""
    hooks = [hook("fast.example.com", "https://fast"), hook("shadow.example.com", "https://shadow")]
    snap = load_documents([("test", config(VALIDATING, hooks, "shadow.example.com: {mode: Shadow}"))])
    results: list[ShadowResult] = []
    async with trio.open_nursery() as server:
        dispatcher = Dispatcher(
            VirtualBackends({}), Labels(), shadow=ShadowCalls(server, on_result=results.append)
        )
        for _ in range(2):
            doc = decode_inbound(json.dumps(review()).encode())
            verdict = dispatcher.decide_shed(
                "validating", doc, snap, deadline=trio.current_time() + 5, shed="in_flight"
            )
            assert verdict is not None and not verdict.allowed
    assert dispatcher.shed_verdicts_reused == 0
    assert [(r.webhook, r.outcome) for r in results] == [("shadow.example.com", "error")] * 2
