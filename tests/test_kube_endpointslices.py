"""EndpointSlice bookkeeping (gateway/sources/endpointslices.py) against the real kube-apiserver.

The API refuses loopback addresses in EndpointSlices (``may not be in the loopback range``), and
there is no cluster network here, so the slices written below carry addresses nothing listens on:
what is tested against the real API is the bookkeeping — which endpoints of which service are ready,
terminating or gone, as the apiserver lists and watches them. Calls actually spread over pods and
drained from terminating ones are tested in tests/test_transport_endpoints.py over loopback
addresses, which only the fake apiserver can serve.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import trio

from gateway.sources.endpointslices import ClusterEndpointSlices, ServiceEndpoint, ServiceKey
from gateway.sources.kube import KubeClient, load_kubeconfig
from gateway.sources.reflector import Backoff
from tests.support.controlplane import ControlPlane


def _slice(
    name: str, service: str, endpoints: list[tuple[str, bool, bool]], port: int = 8443
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [address], "conditions": {"ready": ready, "terminating": terminating}}
            for address, ready, terminating in endpoints
        ],
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
    }


class Seen:
    def __init__(self) -> None:
        self.latest: dict[ServiceKey, tuple[ServiceEndpoint, ...] | None] = {}

    def __call__(self, key: ServiceKey, endpoints: tuple[ServiceEndpoint, ...] | None) -> None:
        self.latest[key] = endpoints

    def of(self, key: ServiceKey) -> set[tuple[str, int, bool, bool]] | None:
        got = self.latest.get(key)
        return None if got is None else {(e.address, e.port, e.ready, e.terminating) for e in got}


async def _until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(15):
        while not predicate():
            await trio.sleep(0.01)


async def test_ready_terminating_and_removed_endpoints_follow_the_slices(
    control_plane: ControlPlane, kube_namespace: str, nursery: trio.Nursery
) -> None:
    api = functools.partial(trio.to_thread.run_sync)
    path = f"/apis/discovery.k8s.io/v1/namespaces/{kube_namespace}/endpointslices"
    key = (kube_namespace, "hooks", 443)
    seen = Seen()
    client = KubeClient(load_kubeconfig(control_plane.kubeconfig), request_timeout=10)
    source = ClusterEndpointSlices(client, seen, backoff=lambda: Backoff(initial=0.05, maximum=0.2))
    source.watch_services([key])
    await nursery.start(source.run)
    await _until(lambda: seen.of(key) == set())  # listed: no slice yet

    created = await api(
        control_plane.api, "POST", path, _slice("hooks-a", "hooks", [("10.1.0.1", True, False)])
    )
    assert created[0] == 201, created
    await _until(lambda: seen.of(key) == {("10.1.0.1", 8443, True, False)})

    # A second slice of the same service, and one of another service (not ours).
    await api(control_plane.api, "POST", path, _slice("hooks-b", "hooks", [("10.1.0.2", True, False)]))
    await api(control_plane.api, "POST", path, _slice("other-a", "other", [("10.9.0.9", True, False)]))
    await _until(lambda: seen.of(key) == {("10.1.0.1", 8443, True, False), ("10.1.0.2", 8443, True, False)})

    # A pod going away: not ready and terminating, then removed from its slice.
    await api(
        control_plane.api, "PUT", f"{path}/hooks-a", _slice("hooks-a", "hooks", [("10.1.0.1", False, True)])
    )
    await _until(lambda: ("10.1.0.1", 8443, False, True) in (seen.of(key) or set()))
    await api(control_plane.api, "PUT", f"{path}/hooks-a", _slice("hooks-a", "hooks", []))
    await _until(lambda: seen.of(key) == {("10.1.0.2", 8443, True, False)})

    # A slice relabelled to another service leaves ours (the apiserver sends DELETED for it).
    await api(
        control_plane.api,
        "PUT",
        f"{path}/hooks-b",
        _slice("hooks-b", "elsewhere", [("10.1.0.2", True, False)]),
    )
    await _until(lambda: seen.of(key) == set())

    # No longer referenced by the configuration: handed None (back to DNS).
    source.watch_services([])
    await _until(lambda: key in seen.latest and seen.latest[key] is None)
