"""Dispatch deadlines and confinement under trio's virtual clock (FPT-07/08, VAL-06, VAL-10, GW-05).

The backends here are in-memory implementations of dispatch's ``WebhookCaller`` port that answer
with real AdmissionReview bytes after a virtual delay, so deadlines can be asserted exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from gateway.config.load import load_documents
from gateway.config.model import Webhook
from gateway.dispatch.engine import Dispatcher
from gateway.errors import CallingWebhookError
from gateway.review import decode_inbound
from tests.support.gateway import hook, review


@dataclass
class Reply:
    status: int
    content_type: str
    body: bytes


class VirtualBackends:
    """Each webhook name maps to (delay seconds, behaviour); calls are recorded with virtual times."""

    def __init__(self, plan: dict[str, tuple[float, str]]) -> None:
        self.plan = plan
        self.calls: list[tuple[str, float, float]] = []  # name, started, timeout given

    def url(self, hook: Webhook, *, timeout_seconds: float) -> str:
        return f"https://{hook.name}/?timeout={int(timeout_seconds)}s"

    async def call(self, hook: Webhook, body: bytes, *, timeout_seconds: float) -> Reply:
        delay, behaviour = self.plan[hook.name]
        self.calls.append((hook.name, trio.current_time(), timeout_seconds))
        if behaviour == "boom":
            raise RuntimeError("unexpected bug")
        with trio.move_on_after(timeout_seconds):
            await trio.sleep(delay)
            sent = json.loads(body)
            response = {"uid": sent["request"]["uid"], "allowed": behaviour == "allow"}
            return Reply(
                200,
                "application/json",
                msgspec.json.encode(
                    {"apiVersion": sent["apiVersion"], "kind": "AdmissionReview", "response": response}
                ),
            )
        raise CallingWebhookError(
            f'failed to call webhook: Post "{self.url(hook, timeout_seconds=timeout_seconds)}": '
            "context deadline exceeded",
            kind="timeout",
        )


class NoNamespaces:
    async def labels(self, name: str) -> dict[str, str]:
        return {}

    def labels_now(self, name: str) -> dict[str, str] | None:
        return None  # always the awaited path, which these tests bound by the deadline


def snapshot(*hooks: dict[str, Any], kind: str = "ValidatingWebhookConfiguration") -> Any:
    doc = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": "cfg"},
        "webhooks": list(hooks),
    }
    return load_documents([("test", doc)])


def inbound() -> Any:
    return decode_inbound(json.dumps(review()).encode())


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_gateway_deadline_fails_every_unfinished_backend_in_time(autojump_clock: Any) -> None:
    """FPT-08: at the gateway deadline each unfinished call gets a timeout error under its own policy."""
    backends = VirtualBackends(
        {
            "fast.example.com": (1, "allow"),
            "slow.example.com": (20, "allow"),
            "lax.example.com": (20, "allow"),
        }
    )
    snap = snapshot(
        hook("fast.example.com", "https://x"),
        hook("slow.example.com", "https://x", timeoutSeconds=30),
        hook("lax.example.com", "https://x", timeoutSeconds=30, failurePolicy="Ignore"),
    )
    start = trio.current_time()
    verdict = await Dispatcher(backends, NoNamespaces()).validate(inbound(), snap, deadline=start + 5)
    assert trio.current_time() - start == pytest.approx(5, abs=0.1)
    assert not verdict.allowed
    assert verdict.status is not None
    assert verdict.status.message.startswith(
        'Internal error occurred: failed calling webhook "slow.example.com"'
    )
    assert verdict.audit_annotations == {"failed-open.validating.round_0_index_2": "lax.example.com"}
    assert [t for _, _, t in backends.calls] == [pytest.approx(5)] * 3  # FPT-07: min(timeoutSeconds, budget)


async def test_per_backend_timeout_inside_a_longer_budget(autojump_clock: Any) -> None:
    """FPT-05: timeoutSeconds bounds one call even when the gateway's budget is longer."""
    backends = VirtualBackends({"slow.example.com": (20, "allow")})
    snap = snapshot(hook("slow.example.com", "https://x", timeoutSeconds=2))
    start = trio.current_time()
    verdict = await Dispatcher(backends, NoNamespaces()).validate(inbound(), snap, deadline=start + 29.8)
    assert trio.current_time() - start == pytest.approx(2, abs=0.1)
    assert verdict.status is not None and verdict.status.message.endswith("context deadline exceeded")


async def test_mutating_chain_shares_the_budget(autojump_clock: Any) -> None:
    """GW-05/FPT-08: backends not yet started when the budget runs out are failed without a call."""
    backends = VirtualBackends(
        {"one.example.com": (4, "allow"), "two.example.com": (4, "allow"), "three.example.com": (4, "allow")}
    )
    snap = snapshot(
        *(
            hook(n, "https://x", failurePolicy="Ignore", timeoutSeconds=10)
            for n in ("one.example.com", "two.example.com", "three.example.com")
        ),
        kind="MutatingWebhookConfiguration",
    )
    start = trio.current_time()
    verdict = await Dispatcher(backends, NoNamespaces()).mutate(inbound(), snap, deadline=start + 6)
    assert trio.current_time() - start == pytest.approx(6, abs=0.1)
    assert [name for name, _, _ in backends.calls] == ["one.example.com", "two.example.com"]
    assert verdict.allowed
    assert set(verdict.audit_annotations) >= {
        "failed-open.mutation.round_0_index_1",
        "failed-open.mutation.round_0_index_2",
    }
    assert verdict.report is not None and verdict.report.deadline_exhausted


@pytest.mark.parametrize(
    ("policy", "allowed", "message"),
    [
        pytest.param(
            "Fail",
            False,
            "Internal error occurred: ValidatingAdmissionWebhook/buggy.example.com has "
            "panicked: unexpected bug",
            id="VAL-06: a bug handling a Fail backend is a 500 naming it",
        ),
        pytest.param("Ignore", True, None, id="VAL-06: a bug handling an Ignore backend fails open"),
    ],
)
async def test_a_bug_stays_with_its_backend(
    autojump_clock: Any, policy: str, allowed: bool, message: str | None
) -> None:
    """VAL-06: an unexpected exception while handling one backend does not affect the others."""
    backends = VirtualBackends({"buggy.example.com": (0, "boom"), "fine.example.com": (1, "allow")})
    snap = snapshot(
        hook("buggy.example.com", "https://x", failurePolicy=policy), hook("fine.example.com", "https://x")
    )
    verdict = await Dispatcher(backends, NoNamespaces()).validate(
        inbound(), snap, deadline=trio.current_time() + 10
    )
    assert verdict.allowed is allowed
    assert (verdict.status.message if verdict.status else None) == message
    assert len(backends.calls) == 2


@pytest.mark.parametrize(
    ("policy", "allowed", "message", "calls", "annotation"),
    [
        pytest.param(
            "Fail",
            False,
            "Internal error occurred: MutatingAdmissionWebhook/buggy.example.com has "
            "panicked: unexpected bug",
            1,
            None,
            id="VAL-06, MUT-14: a bug handling a Fail mutating backend is a 500 naming it; the chain stops",
        ),
        pytest.param(
            "Ignore",
            True,
            None,
            2,
            "buggy.example.com",
            id="VAL-06, MUT-14: a bug handling an Ignore mutating backend fails open; the chain goes on",
        ),
    ],
)
async def test_a_bug_in_a_mutating_call_stays_with_its_backend(
    autojump_clock: Any, policy: str, allowed: bool, message: str | None, calls: int, annotation: str | None
) -> None:
    """VAL-06 for the chain: an unexpected exception while calling one mutating backend is confined to
    it, under its own failurePolicy, as in the validating fan-out."""
    backends = VirtualBackends({"buggy.example.com": (0, "boom"), "fine.example.com": (1, "allow")})
    snap = snapshot(
        hook("buggy.example.com", "https://x", failurePolicy=policy),
        hook("fine.example.com", "https://x"),
        kind="MutatingWebhookConfiguration",
    )
    verdict = await Dispatcher(backends, NoNamespaces()).mutate(
        inbound(), snap, deadline=trio.current_time() + 10
    )
    assert verdict.allowed is allowed
    assert (verdict.status.message if verdict.status else None) == message
    assert len(backends.calls) == calls
    assert verdict.audit_annotations.get("failed-open.mutation.round_0_index_0") == annotation


class CachedNamespaces:
    """Knows ``shop`` now (a cache hit) and ``gone`` not to exist; a live lookup would never end."""

    def __init__(self) -> None:
        self.awaited = 0

    async def labels(self, name: str) -> dict[str, str]:
        self.awaited += 1
        await trio.sleep_forever()
        raise AssertionError

    def labels_now(self, name: str) -> dict[str, str] | None:
        if name == "gone":
            from gateway.dispatch.ports import NamespaceNotFoundError

            raise NamespaceNotFoundError(name)
        return {"team": "shop"} if name == "shop" else None


@pytest.mark.parametrize(
    ("namespace", "allowed", "seconds", "awaited"),
    [
        pytest.param(
            "shop", True, 0, 0, id="MAT-12: a namespace known now is used without a lookup or its deadline"
        ),
        pytest.param(
            "gone", False, 0, 0, id="MAT-16: a namespace known now not to exist is answered without a lookup"
        ),
        pytest.param(
            "other",
            False,
            5,
            1,
            id="MAT-17: a namespace not known now is looked up, bounded by the review's deadline",
        ),
    ],
)
async def test_namespace_labels_known_now_skip_the_lookup(
    autojump_clock: Any, namespace: str, allowed: bool, seconds: float, awaited: int
) -> None:
    backends = VirtualBackends({"sel.example.com": (0, "allow")})
    snap = snapshot(hook("sel.example.com", "https://x", namespaceSelector={"matchLabels": {"team": "shop"}}))
    namespaces = CachedNamespaces()
    start = trio.current_time()
    verdict = await Dispatcher(backends, namespaces).validate(
        decode_inbound(json.dumps(review(namespace=namespace)).encode()), snap, deadline=start + 5
    )
    assert verdict.allowed is allowed
    assert trio.current_time() - start == pytest.approx(seconds, abs=0.1)
    assert namespaces.awaited == awaited
    assert len(backends.calls) == (1 if allowed else 0)


@pytest.mark.parametrize(
    ("namespace", "at_once"),
    [
        pytest.param("shop", True, id="MAT-12: a namespace known now: a shed review is decided at once"),
        pytest.param("gone", True, id="MAT-16: a namespace known now not to exist: decided at once"),
        pytest.param("other", False, id="MAT-17: a namespace not known now: not at once (the lookup waits)"),
    ],
)
async def test_a_shed_review_is_decided_at_once_unless_its_namespace_must_be_looked_up(
    autojump_clock: Any, namespace: str, at_once: bool
) -> None:
    """``decide_shed`` gives ``decide(..., shed=)``'s verdict without awaiting anything, or None
    when the decision needs a namespace lookup; it never starts the lookup."""
    backends = VirtualBackends({"sel.example.com": (0, "allow"), "all.example.com": (0, "allow")})
    snap = snapshot(
        hook("sel.example.com", "https://x", namespaceSelector={"matchLabels": {"team": "shop"}}),
        hook("all.example.com", "https://x", failurePolicy="Ignore"),
    )
    namespaces = CachedNamespaces()
    dispatcher = Dispatcher(backends, namespaces)
    doc = json.dumps(review(namespace=namespace)).encode()
    deadline = trio.current_time() + 5
    verdict = dispatcher.decide_shed(
        "validating", decode_inbound(doc), snap, deadline=deadline, shed="in_flight"
    )
    assert namespaces.awaited == 0 and backends.calls == []
    if not at_once:
        assert verdict is None
        return
    assert verdict is not None
    ordinary = await dispatcher.decide(
        "validating", decode_inbound(doc), snap, deadline=deadline, shed="in_flight"
    )
    assert (verdict.allowed, verdict.status, verdict.audit_annotations) == (
        ordinary.allowed,
        ordinary.status,
        ordinary.audit_annotations,
    )
