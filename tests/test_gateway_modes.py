"""Rollout modes (Warn, Shadow) and the breaker at the dispatch seam, through the real gateway.

Real sockets: the gateway in-process, sample backends from gateway/devtools, configured with the
``webhook-gateway.io/backend-policy`` annotation. What is asserted is what the API server would
see, what each backend received, and the metrics; never how long anything took. Where time is the
point (a Shadow call never delays the answer; the bound on Shadow calls), a virtual clock drives
the dispatcher with virtual backends.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
import yaml
from structlog.testing import capture_logs

from gateway.config.load import load_documents
from gateway.devtools.backends import serve_backend
from gateway.dispatch.engine import Dispatcher
from gateway.dispatch.shadow import ShadowCalls, ShadowResult
from gateway.server.serve import Running
from tests.support.gateway import gateway_client, hook, pod, review
from tests.test_dispatch_deadlines import NoNamespaces, VirtualBackends, inbound
from tests.test_gateway_resilience import _gateway_with_metrics

POLICY = "webhook-gateway.io/backend-policy"
VALIDATING = "ValidatingWebhookConfiguration"
MUTATING = "MutatingWebhookConfiguration"


def config(kind: str, hooks: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": "team-a", "annotations": {POLICY: policy}},
        "webhooks": hooks,
    }


def write(directory: Path, kind: str, hooks: list[dict[str, Any]], policy: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "webhooks.yaml").write_text(yaml.safe_dump(config(kind, hooks, policy)))


async def backend(nursery: trio.Nursery) -> Any:
    return await nursery.start(lambda task_status: serve_backend(task_status=task_status))


async def ask(running: Running, kind: str, obj: dict[str, Any] | None = None) -> dict[str, Any]:
    client = await gateway_client(running)
    path = "/validate" if kind == VALIDATING else "/mutate"
    got = await client.post(path, json.dumps(review(obj or pod())).encode())
    assert got is not None and got.status == 200
    answer: dict[str, Any] = got.json["response"]
    return answer


async def scrape(running: Running) -> str:
    client = await gateway_client(running)
    got = await client.post("/metrics", b"", method="GET")
    assert got is not None
    return got.body.decode()


def patch_of(answer: dict[str, Any]) -> Any:
    return json.loads(base64.b64decode(answer["patch"])) if "patch" in answer else None


# --- the breaker counts what only dispatch can see --------------------------------------------------

UNVERIFIABLE = [
    pytest.param(
        VALIDATING, "wrong-uid", "Ignore", True,
        id="a 2xx reply that fails verification (wrong uid) counts for the breaker: the circuit opens",
    ),
    pytest.param(
        VALIDATING, "no-response", "Fail", True,
        id="a 2xx reply without a response counts for the breaker under Fail too",
    ),
    pytest.param(
        MUTATING, "undecodable-patch", "Ignore", True,
        id="MUT-04: an undecodable patch counts for the breaker",
    ),
    pytest.param(
        MUTATING, "invalid-patch", "Fail", True,
        id="MUT-07: a patch that cannot be applied counts for the breaker",
    ),
    pytest.param(
        VALIDATING, "deny", "Fail", False,
        id="a denial is an answer: it never opens the circuit",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "path", "failure_policy", "opens"), UNVERIFIABLE)
async def test_breaker_counts_unverifiable_replies_and_unusable_patches(
    nursery: trio.Nursery, tmp_path: Path, kind: str, path: str, failure_policy: str, opens: bool
) -> None:
    """consecutiveFailures 2: after two bad replies the backend is not called again; reviews get the
    call error of an open circuit under the backend's failurePolicy."""
    server = await backend(nursery)
    bad = hook("bad.example.com", f"http://127.0.0.1:{server.port}/{path}", failurePolicy=failure_policy)
    write(tmp_path / "c", kind, [bad], '"*": {circuitBreaker: {consecutiveFailures: 2, openSeconds: 600}}')
    running = await _gateway_with_metrics(nursery, tmp_path / "c")
    answers = [await ask(running, kind) for _ in range(4)]
    assert len(server.calls) == (2 if opens else 4)
    metrics = await scrape(running)
    state = 'webhook_gateway_backend_circuit_state{webhook="bad.example.com"} 1.0'
    assert (state in metrics) is opens
    if opens and failure_policy == "Fail":
        assert answers[-1]["allowed"] is False
        assert "circuit open after 2 consecutive failures (last: " in answers[-1]["status"]["message"]
    elif opens:
        assert answers[-1]["allowed"] is True


# --- Warn ---------------------------------------------------------------------------------------

WARN = [
    pytest.param(
        VALIDATING, "deny/403/image%20registry%20not%20allowed", "Fail",
        ["warned.example.com: image registry not allowed"], None,
        id="Warn: a validating denial becomes allowed with the warning <webhook>: <message>",
    ),
    pytest.param(
        VALIDATING, "status/500", "Fail", [], "failed-open.validating.round_0_index_0",
        id="Warn: a call error under Fail is handled as under Ignore (failed-open annotation)",
    ),
    pytest.param(
        MUTATING, "deny/403/no%20latest%20tags", "Fail", ["warned.example.com: no latest tags"], None,
        id="Warn: a mutating denial becomes allowed with the warning",
    ),
    pytest.param(
        MUTATING, "patch/checked", "Fail",
        ["warned.example.com: would have changed the object: add /metadata/labels/checked"], None,
        id="Warn: a mutating backend applies no patch and warns what it would have changed",
    ),
    pytest.param(
        MUTATING, "invalid-patch", "Fail", ["warned.example.com: "], None,
        id="Warn: a patch that cannot be applied is a warning, not a denial",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "path", "failure_policy", "warnings", "failed_open"), WARN)
async def test_warn_mode_never_denies_and_warns(
    nursery: trio.Nursery,
    tmp_path: Path,
    kind: str,
    path: str,
    failure_policy: str,
    warnings: list[str],
    failed_open: str | None,
) -> None:
    server = await backend(nursery)
    warned = hook(
        "warned.example.com", f"http://127.0.0.1:{server.port}/{path}", failurePolicy=failure_policy
    )
    write(tmp_path / "c", kind, [warned], "warned.example.com: {mode: Warn}")
    running = await _gateway_with_metrics(nursery, tmp_path / "c")
    answer = await ask(running, kind)
    assert len(server.calls) == 1, "a backend in Warn mode is called as usual"
    assert answer["allowed"] is True, answer
    assert "patch" not in answer
    got = answer.get("warnings", [])
    assert len(got) == len(warnings)
    for text, expected in zip(got, warnings, strict=True):
        assert text.startswith(expected), got
    annotations = answer.get("auditAnnotations", {})
    family = "validating" if kind == VALIDATING else "mutating"
    assert json.loads(annotations[f"mode.{family}.round_0_index_0"]) == {
        "configuration": "team-a",
        "webhook": "warned.example.com",
        "mode": "Warn",
    }
    if failed_open is not None:
        assert annotations[failed_open] == "warned.example.com"
        metrics = await scrape(running)
        assert 'webhook_gateway_admission_webhook_fail_open_count{name="warned.example.com"' in metrics


@pytest.mark.parametrize("kind", [VALIDATING, MUTATING])
async def test_warn_mode_dry_run_refusal_is_a_warning(
    nursery: trio.Nursery, tmp_path: Path, kind: str
) -> None:
    """FPT-09 in Warn mode: a backend with side effects is not called in a dry run, and the denial
    the refusal would be becomes a warning, for validating and mutating backends alike."""
    server = await backend(nursery)
    warned = hook("warned.example.com", f"http://127.0.0.1:{server.port}/allow", sideEffects="Unknown")
    doc = config(kind, [warned], "warned.example.com: {mode: Warn}")
    doc["apiVersion"] = "admissionregistration.k8s.io/v1beta1"  # v1 allows only None/NoneOnDryRun
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "webhooks.yaml").write_text(yaml.safe_dump(doc))
    running = await _gateway_with_metrics(nursery, tmp_path / "c")
    client = await gateway_client(running)
    path = "/validate" if kind == VALIDATING else "/mutate"
    got = await client.post(path, json.dumps(review(pod(), dry_run=True)).encode())
    assert got is not None and got.status == 200
    answer = got.json["response"]
    assert server.calls == []
    assert answer["allowed"] is True, answer
    assert answer["warnings"] == [
        'warned.example.com: admission webhook "warned.example.com" does not support dry run'
    ]


async def test_warn_mode_mutating_backend_leaves_the_chain_unchanged(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The next backend in the chain sees the object without the Warn backend's patch."""
    server = await backend(nursery)
    warned = hook("warned.example.com", f"http://127.0.0.1:{server.port}/patch/warned")
    after = hook("after.example.com", f"http://127.0.0.1:{server.port}/patch/after")
    write(tmp_path / "c", MUTATING, [warned, after], "warned.example.com: {mode: Warn}")
    running = await _gateway_with_metrics(nursery, tmp_path / "c")
    answer = await ask(running, MUTATING)
    assert answer["allowed"] is True
    assert [op["path"] for op in patch_of(answer)] == ["/metadata/labels/after"]
    seen = server.calls[1].review["request"]["object"]["metadata"]["labels"]
    assert "warned" not in seen


# --- Shadow -------------------------------------------------------------------------------------

SHADOW = [
    pytest.param(VALIDATING, "deny/403/nope", "denied", "nope", id="Shadow: a denial is counted as denied, the review allowed"),
    pytest.param(VALIDATING, "allow", "allowed", "", id="Shadow: an allowed result is counted as allowed"),
    pytest.param(VALIDATING, "status/500", "error", "status 500", id="Shadow: a call error is counted as error, never fails the review"),
    pytest.param(MUTATING, "patch/shadowed", "mutated", "add /metadata/labels/shadowed", id="Shadow: a patch is counted as mutated and never applied"),
    pytest.param(MUTATING, "deny/403/nope", "denied", "nope", id="Shadow: a mutating denial never stops the chain"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "path", "outcome", "message"), SHADOW)
async def test_shadow_results_are_counted_and_logged_never_used(
    nursery: trio.Nursery, tmp_path: Path, kind: str, path: str, outcome: str, message: str
) -> None:
    server = await backend(nursery)
    shadow = hook("shadow.example.com", f"http://127.0.0.1:{server.port}/{path}")
    enforced = hook("enforced.example.com", f"http://127.0.0.1:{server.port}/allow")
    write(tmp_path / "c", kind, [shadow, enforced], "shadow.example.com: {mode: Shadow}")
    with capture_logs() as logs:
        running = await _gateway_with_metrics(nursery, tmp_path / "c")
        answer = await ask(running, kind)
        with trio.fail_after(10):
            while {"shadow decision", "review"} - {e.get("event") for e in logs}:
                await trio.sleep(0.01)
    assert answer["allowed"] is True and "patch" not in answer and "warnings" not in answer, answer
    family = "validating" if kind == VALIDATING else "mutating"
    assert json.loads(answer["auditAnnotations"][f"mode.{family}.round_0_index_0"])["mode"] == "Shadow"
    assert sorted(c.path.split("?")[0] for c in server.calls) == sorted(["/allow", f"/{path}"])
    (line,) = [e for e in logs if e.get("event") == "shadow decision"]
    assert line["webhook"] == "shadow.example.com" and line["outcome"] == outcome
    assert message in line.get("message", ""), line
    metrics = await scrape(running)
    assert (
        f'webhook_gateway_shadow_decisions_total{{outcome="{outcome}",webhook="shadow.example.com"}} 1.0'
        in metrics
    )
    (review_line,) = [e for e in logs if e.get("event") == "review"]
    assert review_line["modes"] == {"shadow.example.com": "Shadow"}, "the review line names the modes"


async def test_shadow_mutating_backend_sees_the_object_at_its_position(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """first (Enforce) patches, shadow (Shadow) sees that patch, its own patch reaches nobody."""
    server = await backend(nursery)
    first = hook("first.example.com", f"http://127.0.0.1:{server.port}/patch/first")
    shadow = hook("shadow.example.com", f"http://127.0.0.1:{server.port}/patch/shadowed")
    last = hook("last.example.com", f"http://127.0.0.1:{server.port}/patch/last")
    write(tmp_path / "c", MUTATING, [first, shadow, last], "shadow.example.com: {mode: Shadow}")
    running = await _gateway_with_metrics(nursery, tmp_path / "c")
    answer = await ask(running, MUTATING)
    with trio.fail_after(10):
        while len(server.calls) < 3:
            await trio.sleep(0.01)
    assert [op["path"] for op in patch_of(answer)] == ["/metadata/labels/first", "/metadata/labels/last"]
    by_path = {
        c.path.split("?")[0]: c.review["request"]["object"]["metadata"]["labels"] for c in server.calls
    }
    assert by_path["/patch/shadowed"] == {"app": "web", "first": "true"}
    assert "shadowed" not in by_path["/patch/last"]


# --- Shadow and time: virtual clock, virtual backends -------------------------------------------


def _snapshot(policy: str, *hooks: dict[str, Any]) -> Any:
    return load_documents([("test", config(VALIDATING, list(hooks), policy))])


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_shadow_call_never_delays_the_answer(autojump_clock: Any) -> None:
    """The shadow backend takes 4 s, the enforcing one none: the answer is there at once (virtual
    time), the shadow result 4 s later, from the server's nursery."""
    snap = _snapshot(
        "slow.example.com: {mode: Shadow}",
        hook("fast.example.com", "https://fast"),
        hook("slow.example.com", "https://slow", timeoutSeconds=10),
    )
    backends = VirtualBackends({"fast.example.com": (0, "allow"), "slow.example.com": (4, "deny")})
    results: list[tuple[float, ShadowResult]] = []
    async with trio.open_nursery() as server:
        shadow = ShadowCalls(server, on_result=lambda r: results.append((trio.current_time(), r)))
        dispatcher = Dispatcher(backends, NoNamespaces(), shadow=shadow)
        started = trio.current_time()
        verdict = await dispatcher.validate(inbound(), snap, deadline=started + 10)
        answered = trio.current_time() - started
        assert verdict.allowed and results == []
    assert answered == 0
    ((at, result),) = results
    assert at - started == 4
    assert (result.webhook, result.outcome) == ("slow.example.com", "denied")


async def test_shadow_calls_are_bounded_in_number(autojump_clock: Any) -> None:
    """max_in_flight 1: a second review's shadow call while the first runs is not made (error)."""
    snap = _snapshot(
        "slow.example.com: {mode: Shadow}",
        hook("fast.example.com", "https://fast"),
        hook("slow.example.com", "https://slow", timeoutSeconds=10),
    )
    backends = VirtualBackends({"fast.example.com": (0, "allow"), "slow.example.com": (4, "allow")})
    results: list[ShadowResult] = []
    async with trio.open_nursery() as server:
        shadow = ShadowCalls(server, max_in_flight=1, on_result=results.append)
        dispatcher = Dispatcher(backends, NoNamespaces(), shadow=shadow)
        for _ in range(2):
            verdict = await dispatcher.validate(inbound(), snap, deadline=trio.current_time() + 10)
            assert verdict.allowed
    assert [r.outcome for r in results] == ["error", "allowed"]
    assert "shadow calls already in flight" in results[0].message
    assert [name for name, _, _ in backends.calls].count("slow.example.com") == 1
    assert msgspec.json.encode(results[1].webhook) == b'"slow.example.com"'


async def test_a_call_cancelled_by_the_caller_gives_its_bulkhead_slot_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """maxInFlight 1: the caller of the first review goes away mid-call; the cancelled call frees its
    slot (it is abandoned, not leaked), so the next review's call is made and allowed."""
    server = await backend(nursery)
    slow = hook("slow.example.com", f"http://127.0.0.1:{server.port}/sleep/1000/allow")
    write(tmp_path / "c", VALIDATING, [slow], '"*": {maxInFlight: 1}')
    running = await _gateway_with_metrics(nursery, tmp_path / "c")
    leaving = await gateway_client(running)
    with trio.move_on_after(0.3):
        await leaving.post("/validate", json.dumps(review(pod())).encode())
    await leaving.aclose()
    pool = running.app.dispatcher.caller.pool  # type: ignore[attr-defined]
    with trio.fail_after(5):  # the cancelled call's connection is closed: the call is over
        while sum(pool.open_connections().values()):
            await trio.sleep(0.02)
    answer = await ask(running, VALIDATING)
    assert answer["allowed"] is True, answer
    assert len(server.calls) == 2


async def test_a_shed_review_makes_no_shadow_calls(nursery: trio.Nursery, tmp_path: Path) -> None:
    """--shed-max-event-loop-lag: a review shed for overload calls no backend, its Shadow-mode one
    neither; the shadow result is an error naming the overload."""
    import time

    server = await backend(nursery)
    enforced = hook("enforced.example.com", f"http://127.0.0.1:{server.port}/allow", failurePolicy="Ignore")
    shadow = hook("shadow.example.com", f"http://127.0.0.1:{server.port}/deny")
    write(tmp_path / "c", VALIDATING, [enforced, shadow], "shadow.example.com: {mode: Shadow}")
    running = await _gateway_with_metrics(nursery, tmp_path / "c", "--shed-max-event-loop-lag", "0.1")
    client = await gateway_client(running)
    time.sleep(0.5)  # block the event loop: the lag probe wakes at least 0.4 s late
    got = await client.post("/validate", json.dumps(review(pod())).encode())
    assert got is not None and got.json["response"]["allowed"] is True
    expected = 'webhook_gateway_shadow_decisions_total{outcome="error",webhook="shadow.example.com"} 1.0'
    with trio.fail_after(10):
        while expected not in await scrape(running):
            await trio.sleep(0.02)
    assert server.calls == []
