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


async def test_service_backend_calls_are_balanced_over_its_endpointslices(
    nursery: trio.Nursery, tmp_path: Path, kube_api: FakeKubeAPI
) -> None:
    """With cluster access, a clientConfig.service backend is called at every ready pod its
    EndpointSlices announce (here 127.0.0.2 and 127.0.0.3), TLS verified against the service name."""
    import base64
    import ssl

    import trustme

    ca = trustme.CA()
    pods = []
    for address in ("127.0.0.2", "127.0.0.3"):
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("hook.team-a.svc").configure_cert(context)
        pods.append(
            await nursery.start(
                lambda task_status, a=address, c=context: serve_backend(
                    host=a, ssl_context=c, http1_only=True, task_status=task_status
                )
            )
        )
    for i, pod_server in enumerate(pods):
        kube_api.put_slice("team-a", f"hook-{i}", "hook", pod_server.port, [(pod_server.host, True, False)])
    bundle = base64.b64encode(ca.cert_pem.bytes()).decode()
    service = {"namespace": "team-a", "name": "hook", "path": "/allow"}
    entry = hook("pods.example.com", "", clientConfig={"service": service, "caBundle": bundle})
    write_config(tmp_path / "c", validating={"a": [entry]})
    kubeconfig = write_kubeconfig(kube_api, tmp_path / "kubeconfig")
    running = await start_gateway(
        nursery, tmp_path / "c", "--namespace-source", "cluster", "--kubeconfig", str(kubeconfig)
    )
    client = await gateway_client(running)
    with trio.fail_after(10):
        while not any(p.endswith("/endpointslices") and "watch" in q for p, q, _ in kube_api.requests):
            await trio.sleep(0.01)
        for _ in range(40):
            got = await client.post("/validate", json.dumps(review(pod())).encode())
            assert got is not None and got.status == 200
            assert got.json["response"]["allowed"] is True, got.json
    assert all(len(p.calls) > 0 for p in pods), [len(p.calls) for p in pods]
