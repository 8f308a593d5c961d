"""The gateway with namespace labels from a (fake) cluster: list+watch, live GET on a miss (GW-01, MAT-13/16)."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from gateway.devtools.backends import serve_backend
from tests.support.gateway import gateway_client, hook, pod, review, start_gateway, write_config
from tests.support.kubeapi import FakeKubeAPI, write_kubeconfig


async def test_namespace_labels_follow_the_cluster(
    nursery: trio.Nursery, tmp_path: Path, kube_api: FakeKubeAPI
) -> None:
    """Labels come from the watch; a label change reaches reviews; an unknown namespace is a 404."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    team_a = {"matchLabels": {"team": "a"}}
    write_config(
        tmp_path / "c",
        validating={
            "a": [
                hook(
                    "teams.example.com",
                    f"http://127.0.0.1:{server.port}/deny/403/team%20a",
                    namespaceSelector=team_a,
                )
            ]
        },
    )
    kubeconfig = write_kubeconfig(kube_api, tmp_path / "kubeconfig")
    running = await start_gateway(
        nursery, tmp_path / "c", "--namespace-source", "cluster", "--kubeconfig", str(kubeconfig)
    )
    client = await gateway_client(running)

    async def decide(namespace: str) -> dict[str, object]:
        got = await client.post(
            "/validate", json.dumps(review(pod(namespace=namespace), namespace=namespace)).encode()
        )
        assert got is not None and got.status == 200
        return dict(got.json["response"])

    assert (await decide("team-a"))["allowed"] is False
    assert (await decide("default"))["allowed"] is True
    calls = len(server.calls)

    kube_api.put("default", {"team": "a"})  # a watch event: the gateway's cache follows
    with trio.fail_after(5):
        while (await decide("default"))["allowed"] is True:
            await trio.sleep(0.05)
    assert len(server.calls) > calls

    ghost = await decide("ghost")  # a cache miss: one live GET, answered 404
    assert ghost["allowed"] is False
    assert ghost["status"] == {
        "status": "Failure",
        "message": 'namespaces "ghost" not found',
        "reason": "NotFound",
        "details": {"name": "ghost", "kind": "namespaces"},
        "code": 404,
    }
    assert any(path == "/api/v1/namespaces/ghost" for path, _, _ in kube_api.requests)
