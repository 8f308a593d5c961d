"""Circuit breakers and bulkheads through the real gateway (webhook-gateway.io/backend-policy).

Real sockets: the gateway in-process, sample backends from gateway/devtools. What is asserted is
what the API server would see, and how many calls each backend received; never how long it took.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

from gateway.cli import parse
from gateway.devtools.backends import serve_backend
from gateway.observability import Observability
from gateway.server.serve import Running, serve
from tests.support.gateway import gateway_client, hook, pod, review, start_gateway

POLICY = "webhook-gateway.io/backend-policy"


def write(directory: Path, hooks: list[dict[str, Any]], policy: str) -> None:
    doc = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "team-a", "annotations": {POLICY: policy}},
        "webhooks": hooks,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "webhooks.yaml").write_text(yaml.safe_dump(doc))


BREAKER = [
    pytest.param(
        "Ignore",
        None,
        id="open circuit, failurePolicy Ignore: the backend is skipped at once with the fail-open annotation",
    ),
    pytest.param(
        "Fail",
        'Internal error occurred: failed calling webhook "stalled.example.com": circuit open after 2 consecutive failures (last: ',
        id="open circuit, failurePolicy Fail: denied at once naming the circuit and the last error",
    ),
]


@pytest.mark.parametrize(("failure_policy", "denial"), BREAKER)
async def test_open_circuit_answers_without_calling_the_stalled_backend(
    nursery: trio.Nursery, tmp_path: Path, failure_policy: str, denial: str | None
) -> None:
    """Two timeouts open the circuit; the next reviews do not call the backend at all, and get the
    answer the backend's failurePolicy gives any call error."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    stalled = hook(
        "stalled.example.com",
        f"http://127.0.0.1:{server.port}/sleep/10000/allow",
        timeoutSeconds=1,
        failurePolicy=failure_policy,
    )
    write(tmp_path / "c", [stalled], '"*": {circuitBreaker: {consecutiveFailures: 2, openSeconds: 600}}')
    options = parse(
        ["--config", str(tmp_path / "c"), "--bind", "127.0.0.1:0", "--drain-seconds", "0"]
    ).options
    observer = Observability(metrics=True)
    running: Running = await nursery.start(
        lambda task_status: serve(options, observer=observer, handle_signals=False, task_status=task_status)
    )
    client = await gateway_client(running)
    answers = []
    for _ in range(5):
        got = await client.post("/validate", json.dumps(review(pod())).encode())
        assert got is not None and got.status == 200
        answers.append(got.json["response"])
    assert len(server.calls) == 2, "calls 3..5 were not made: the circuit was open"
    last = answers[-1]
    if denial is None:
        assert last["allowed"] is True
        assert last["auditAnnotations"] == {"failed-open.validating.round_0_index_0": "stalled.example.com"}
    else:
        assert last["allowed"] is False
        assert last["status"]["message"].startswith(denial), last["status"]["message"]
    scraped = await client.post("/metrics", b"", method="GET")
    assert scraped is not None
    metrics = scraped.body.decode()
    assert 'webhook_gateway_backend_circuit_state{webhook="stalled.example.com"} 1.0' in metrics
    assert (
        'webhook_gateway_backend_calls_refused_total{reason="circuit_open",webhook="stalled.example.com"} 3.0'
        in metrics
    )


async def test_bulkhead_refuses_calls_over_max_in_flight(nursery: trio.Nursery, tmp_path: Path) -> None:
    """maxInFlight 1: while one call is in flight, a concurrent review's call is not made and is a
    call error under the backend's failurePolicy (Ignore here)."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    slow = hook("slow.example.com", f"http://127.0.0.1:{server.port}/sleep/500/deny", failurePolicy="Ignore")
    write(tmp_path / "c", [slow], '"*": {maxInFlight: 1}')
    running = await start_gateway(nursery, tmp_path / "c")
    answers: list[dict[str, Any]] = []

    async def send() -> None:
        client = await gateway_client(running)
        got = await client.post("/validate", json.dumps(review(pod())).encode())
        assert got is not None and got.status == 200
        answers.append(got.json["response"])

    async with trio.open_nursery() as reviews:
        reviews.start_soon(send)
        with trio.fail_after(5):
            while not server.calls:
                await trio.sleep(0.001)
        reviews.start_soon(send)
    assert len(server.calls) == 1
    assert sorted(a["allowed"] for a in answers) == [False, True], (
        "one denied by the backend, one failed open"
    )


async def test_live_reload_keeps_the_open_circuit_of_an_unchanged_backend(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A reload that adds a webhook (and changes the breaker's settings) keeps the open circuit of
    the stalled backend: it is still not called after the reload."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    stalled = hook(
        "stalled.example.com", f"http://127.0.0.1:{server.port}/sleep/10000/allow",
        timeoutSeconds=1, failurePolicy="Ignore",
    )  # fmt: skip
    write(tmp_path / "c", [stalled], '"*": {circuitBreaker: {consecutiveFailures: 1, openSeconds: 600}}')
    running = await start_gateway(nursery, tmp_path / "c", "--config-poll-seconds", "0.05")
    client = await gateway_client(running)
    for _ in range(2):
        got = await client.post("/validate", json.dumps(review(pod())).encode())
        assert got is not None and got.status == 200
    assert len(server.calls) == 1
    other = hook("other.example.com", f"http://127.0.0.1:{server.port}/allow")
    write(
        tmp_path / "c", [stalled, other], '"*": {circuitBreaker: {consecutiveFailures: 3, openSeconds: 600}}'
    )
    with trio.fail_after(10):
        while running.app.snapshot().generation < 2:  # type: ignore[union-attr]
            await trio.sleep(0.02)
    got = await client.post("/validate", json.dumps(review(pod())).encode())
    assert got is not None and got.json["response"]["allowed"] is True
    stalled_calls = [c for c in server.calls if c.path.startswith("/sleep/")]
    assert len(stalled_calls) == 1, "the stalled backend was not called again"
    assert len(server.calls) == 2, "the new backend was called"
