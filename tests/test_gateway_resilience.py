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
from structlog.testing import capture_logs

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
    running = await _gateway_with_metrics(nursery, tmp_path / "c")
    client = await gateway_client(running)
    answers = []
    with capture_logs() as logs:
        for _ in range(5):
            got = await client.post("/validate", json.dumps(review(pod())).encode())
            assert got is not None and got.status == 200
            answers.append(got.json["response"])
    assert len(server.calls) == 2, "calls 3..5 were not made: the circuit was open"
    warned = [e.get("error_kind") for e in logs if e["event"] == "backend failed open"]
    if failure_policy == "Ignore":  # the 3 calls not made are one line, not one per review
        assert warned == ["timeout", "timeout", "circuit_open"], warned
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


async def _gateway_with_metrics(nursery: trio.Nursery, config_dir: Path, *args: str) -> Running:
    options = parse(
        ["--config", str(config_dir), "--bind", "127.0.0.1:0", "--drain-seconds", "0", *args]
    ).options
    observer = Observability(metrics=True)
    running: Running = await nursery.start(
        lambda task_status: serve(options, observer=observer, handle_signals=False, task_status=task_status)
    )
    return running


SHEDDING = [
    pytest.param(
        "Fail",
        False,
        'Internal error occurred: failed calling webhook "slow.example.com": the gateway is overloaded '
        "(in_flight); the call was not made",
        id="shed under failurePolicy Fail: HTTP 200, denied as for a call error, the backend not called",
    ),
    pytest.param(
        "Ignore",
        True,
        None,
        id="shed under failurePolicy Ignore: HTTP 200, allowed as for an ignored call error",
    ),
]


@pytest.mark.parametrize(("failure_policy", "allowed", "message"), SHEDDING)
async def test_reviews_over_the_in_flight_bound_are_shed_with_the_backends_policies(
    nursery: trio.Nursery, tmp_path: Path, failure_policy: str, allowed: bool, message: str | None
) -> None:
    """--shed-max-in-flight 1: a review arriving while one is being decided is answered at once,
    as if its backend had a call error under its own failurePolicy; never a 5xx."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    slow = hook(
        "slow.example.com", f"http://127.0.0.1:{server.port}/sleep/300/allow", failurePolicy=failure_policy
    )
    write(tmp_path / "c", [slow], "")
    running = await _gateway_with_metrics(nursery, tmp_path / "c", "--shed-max-in-flight", "1")
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
    shed = answers[0]  # answered first: it did not wait for the backend
    assert shed["allowed"] is allowed
    if message is not None:
        assert shed["status"]["message"] == message
    assert answers[1]["allowed"] is True
    client = await gateway_client(running)
    scraped = await client.post("/metrics", b"", method="GET")
    assert scraped is not None
    assert 'webhook_gateway_reviews_shed_total{reason="in_flight"} 1.0' in scraped.body.decode()


async def test_reviews_are_shed_while_the_event_loop_lags(nursery: trio.Nursery, tmp_path: Path) -> None:
    """--shed-max-event-loop-lag: right after the loop was blocked (here by the test itself, in the
    gateway's own process), a review is shed; once the lag has passed, reviews call the backend."""
    import time

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    backend_hook = hook("b.example.com", f"http://127.0.0.1:{server.port}/allow", failurePolicy="Ignore")
    write(tmp_path / "c", [backend_hook], "")
    running = await _gateway_with_metrics(nursery, tmp_path / "c", "--shed-max-event-loop-lag", "0.1")
    client = await gateway_client(running)
    time.sleep(0.5)  # block the event loop: the lag probe wakes at least 0.4 s late
    got = await client.post("/validate", json.dumps(review(pod())).encode())
    assert got is not None and got.status == 200
    assert got.json["response"]["allowed"] is True
    assert "failed-open.validating.round_0_index_0" in got.json["response"]["auditAnnotations"]
    assert server.calls == []
    with trio.fail_after(10):
        while not server.calls:  # a lag sample counts for 1 s, then reviews run normally again
            got = await client.post("/validate", json.dumps(review(pod())).encode())
            await trio.sleep(0.1)
    scraped = await client.post("/metrics", b"", method="GET")
    assert scraped is not None
    assert 'webhook_gateway_reviews_shed_total{reason="event_loop_lag"}' in scraped.body.decode()


async def test_reviews_are_shed_while_the_process_uses_most_of_its_cpu(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """--shed-max-cpu: a review arriving after the process used more than that share of the CPU it
    may use over the last 100 ms or more (here the test itself burns it, in the gateway's own
    process) is shed; after a quiet spell, reviews call the backend again."""
    import time

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    backend_hook = hook("b.example.com", f"http://127.0.0.1:{server.port}/allow", failurePolicy="Ignore")
    write(tmp_path / "c", [backend_hook], "")
    running = await _gateway_with_metrics(nursery, tmp_path / "c", "--shed-max-cpu", "0.5")
    client = await gateway_client(running)

    async def allowed_after_calling_the_backend() -> bool:
        calls = len(server.calls)
        got = await client.post("/validate", json.dumps(review(pod())).encode())
        assert got is not None and got.status == 200
        assert got.json["response"]["allowed"] is True
        return len(server.calls) > calls

    await trio.sleep(0.3)  # quiet: the first measure covers it
    assert await allowed_after_calling_the_backend()
    spin_until = time.process_time() + 0.3  # the whole CPU for 0.3 s: twice the threshold
    while time.process_time() < spin_until:
        pass
    assert not await allowed_after_calling_the_backend()  # shed: allowed under Ignore, not called
    await trio.sleep(0.3)
    assert await allowed_after_calling_the_backend()
    scraped = await client.post("/metrics", b"", method="GET")
    assert scraped is not None
    assert 'webhook_gateway_reviews_shed_total{reason="cpu"} 1.0' in scraped.body.decode()


async def test_the_cpu_the_process_may_use_is_read_again_while_it_serves(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """--shed-max-cpu measures against the CPU the process may use *now*: a pod's CPU limit can
    change while it runs (an in-place resize rewrites its cgroup's ``cpu.max``), and so can the CPUs
    it may run on. Both are read again every second (``cgroup.CpuBudget``). Here the CPUs change (a
    test may not write the machine's cgroups): one of two worker processes may use one CPU of two,
    and half of one once the process may run on a single CPU. The same 60 % of a CPU is below the
    0.85 threshold before and above it after."""
    import os
    import time

    cpus = os.sched_getaffinity(0)
    assert len(cpus) >= 2, "this test narrows the process to one CPU: it needs two to start with"
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    backend_hook = hook("b.example.com", f"http://127.0.0.1:{server.port}/allow", failurePolicy="Ignore")
    write(tmp_path / "c", [backend_hook], "")
    argv = ["--config", str(tmp_path / "c"), "--bind", "127.0.0.1:0", "--drain-seconds", "0"]
    options = parse([*argv, "--shed-max-cpu", "0.85"]).options
    running: Running = await nursery.start(
        lambda task_status: serve(
            options,
            observer=Observability(metrics=True),
            handle_signals=False,
            processes=2,
            task_status=task_status,
        )
    )
    client = await gateway_client(running)

    async def called_the_backend(after_60_percent_of_a_cpu: bool = True) -> bool:
        until = time.monotonic() + 0.3
        while after_60_percent_of_a_cpu and time.monotonic() < until:  # 6 ms of CPU in every 10 ms
            spin_until = time.process_time() + 0.006
            while time.process_time() < spin_until:
                pass
            time.sleep(0.004)
        calls = len(server.calls)
        got = await client.post("/validate", json.dumps(review(pod())).encode())
        assert got is not None and got.status == 200
        assert got.json["response"]["allowed"] is True
        return len(server.calls) > calls

    try:
        await trio.sleep(0.3)  # quiet: each measure covers the time since the last one
        assert await called_the_backend(after_60_percent_of_a_cpu=False)
        assert await called_the_backend()  # 0.6 of one CPU
        os.sched_setaffinity(0, {min(cpus)})  # this thread runs the event loop: what the gateway reads
        await trio.sleep(1.1)  # the budget is read again at most once a second
        with capture_logs() as logs:
            assert await called_the_backend(after_60_percent_of_a_cpu=False)  # quiet: not shed
        assert [(e["before"], e["cpu_budget"]) for e in logs if e["event"] == "cpu budget changed"] == [
            (1.0, 0.5)
        ]
        assert not await called_the_backend()  # 1.2 of half a CPU: shed
    finally:
        os.sched_setaffinity(0, cpus)
