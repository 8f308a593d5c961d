"""MAT-33: a review that arrives before the gateway is ready waits for readiness, and starts the moment
the gateway becomes ready: woken by the change, not by polling."""

from __future__ import annotations

import json
from pathlib import Path

import trio
import trio.testing

from gateway.devtools.backends import serve_backend
from gateway.server.app import Readiness
from tests.support.gateway import gateway_client, hook, pod, review, start_gateway, write_config
from tests.support.kubeapi import FakeKubeAPI, write_kubeconfig


async def test_a_waiting_review_is_woken_by_the_change_not_a_timer(
    mock_clock: trio.testing.MockClock,
) -> None:
    """MAT-33: under a clock that never moves (no timer can fire), a wait for readiness ends as soon
    as a check turns true and ``changed`` is called; a change that leaves it unready keeps it waiting."""
    synced = False
    readiness = Readiness()
    readiness.add_check(lambda: synced)
    outcome: list[bool] = []

    async def review_waits() -> None:
        outcome.append(await readiness.wait(trio.current_time() + 10))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(review_waits)
        await trio.testing.wait_all_tasks_blocked()
        readiness.changed()  # e.g. a reload that still needs namespace labels
        await trio.testing.wait_all_tasks_blocked()
        assert outcome == []
        synced = True
        readiness.changed()
    assert outcome == [True]


async def test_a_wait_for_readiness_gives_up_at_its_deadline(autojump_clock: trio.testing.MockClock) -> None:
    """MAT-33: never ready: the wait ends at the review's deadline with False (virtual time, no sockets)."""
    readiness = Readiness()
    readiness.add_check(lambda: False)
    start = trio.current_time()
    assert await readiness.wait(start + 3) is False
    assert trio.current_time() - start == 3


async def test_a_review_before_the_first_namespace_list_is_answered_once_it_arrives(
    nursery: trio.Nursery, tmp_path: Path, kube_api: FakeKubeAPI
) -> None:
    """MAT-33 end to end: the first list fails (the source retries after its back-off, about 1 s); a
    review sent meanwhile waits, and is decided with the namespace's labels once the list is in."""
    backend = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    write_config(
        tmp_path / "c",
        validating={
            "a": [
                hook(
                    "teams.example.com",
                    f"http://127.0.0.1:{backend.port}/deny/403/team%20a",
                    namespaceSelector={"matchLabels": {"team": "a"}},
                )
            ]
        },
    )
    kube_api.fail_lists = 1
    kubeconfig = write_kubeconfig(kube_api, tmp_path / "kubeconfig")
    running = await start_gateway(
        nursery, tmp_path / "c", "--namespace-source", "cluster", "--kubeconfig", str(kubeconfig)
    )
    assert not running.app.readiness.ready
    client = await gateway_client(running)
    got = await client.post(
        "/validate?timeout=9s", json.dumps(review(pod(namespace="team-a"), namespace="team-a")).encode()
    )
    assert got is not None and got.status == 200
    assert got.json["response"]["allowed"] is False
    assert got.json["response"]["status"]["message"].endswith("team a")  # the backend's, not "not ready"
    assert len(kube_api.lists()) == 2
