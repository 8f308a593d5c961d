"""Endpoint-aware load balancing for clientConfig.service backends.

The picker alone on a virtual clock (power of two choices, drain, outlier ejection); the
EndpointSlice reflector against the fake kube-apiserver (list, watch, 410 re-list, services coming
and going); and whole calls through the real client pool to several real TLS backends on
127.0.0.x addresses announced as one service's endpoints, verified against the service DNS name.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trustme

from gateway.config.model import Webhook
from gateway.errors import CallingWebhookError
from gateway.sources.endpointslices import (
    ClusterEndpointSlices,
    ServiceEndpoint,
    ServiceKey,
    referenced_services,
)
from gateway.sources.kube import KubeClient, load_kubeconfig
from gateway.sources.namespaces import Backoff
from gateway.transport.caller import BackendCaller
from gateway.transport.endpoints import EndpointPicker, EndpointRouter
from gateway.transport.pool import ClientPool
from tests.configs.builders import config, hook, load
from tests.support.httpservers import BackendServer, server_context
from tests.support.kubeapi import FakeKubeAPI, write_kubeconfig

SERVICE: ServiceKey = ("team-a", "hook", 443)
DNS_NAME = "hook.team-a.svc"


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def ep(address: str, *, ready: bool = True, terminating: bool = False, port: int = 8443) -> ServiceEndpoint:
    return ServiceEndpoint(address, port, ready, terminating)


# --- the picker ------------------------------------------------------------------------------------

PICKS = [
    pytest.param([ep("10.0.0.1"), ep("10.0.0.2", ready=False)], {"10.0.0.1"}, id="endpoints not ready get no calls"),
    pytest.param(
        [ep("10.0.0.1"), ep("10.0.0.2", terminating=True)], {"10.0.0.1"},
        id="terminating endpoints are drained: no new calls",
    ),
    pytest.param([ep("10.0.0.1", ready=False)], {None}, id="no ready endpoint: DNS as without cluster access"),
    pytest.param([ep("10.0.0.1"), ep("10.0.0.2"), ep("10.0.0.3")], {"10.0.0.1", "10.0.0.2", "10.0.0.3"},
                 id="every ready endpoint gets calls"),
]  # fmt: skip


@pytest.mark.parametrize(("endpoints", "expected"), PICKS)
def test_picker_chooses_among_ready_endpoints(
    endpoints: list[ServiceEndpoint], expected: set[str | None]
) -> None:
    picker = EndpointPicker(Clock(), rng=random.Random(1))
    picker.update(endpoints)
    picked = {(e.address if (e := picker.pick()) is not None else None) for _ in range(200)}
    assert picked == expected


def test_power_of_two_choices_prefers_fewer_outstanding_calls() -> None:
    """With two endpoints both are compared every time: the busier one never wins."""
    picker = EndpointPicker(Clock(), rng=random.Random(2))
    picker.update([ep("10.0.0.1"), ep("10.0.0.2")])
    busy = picker.endpoints[("10.0.0.1", 8443)]
    picker.started(busy)
    assert all((e := picker.pick()) is not None and e.address == "10.0.0.2" for _ in range(50))


def test_outlier_ejection_after_consecutive_connection_failures() -> None:
    """3 connection failures in a row eject an endpoint for 30 s (60 s the second time); a call
    that connected resets the count; with every endpoint ejected, all are tried (panic mode)."""
    clock = Clock()
    picker = EndpointPicker(clock, rng=random.Random(3), eject_after=3, eject_seconds=30)
    picker.update([ep("10.0.0.1"), ep("10.0.0.2")])
    bad = picker.endpoints[("10.0.0.1", 8443)]

    def fail(times: int, *, connect_failed: bool = True) -> None:
        for _ in range(times):
            picker.started(bad)
            picker.finished(bad, connect_failed=connect_failed)

    fail(2)
    fail(1, connect_failed=False)
    fail(2)
    assert bad.ejected_until == 0, "failures must be consecutive"
    fail(1)
    assert bad.ejected_until == 30
    assert {e.address for _ in range(100) if (e := picker.pick())} == {"10.0.0.2"}
    clock.now = 30
    assert "10.0.0.1" in {e.address for _ in range(100) if (e := picker.pick())}
    fail(3)
    assert bad.ejected_until == 30 + 60
    picker.endpoints[("10.0.0.2", 8443)].ejected_until = 1000
    assert picker.pick() is not None, "panic mode: every ready endpoint ejected, try them anyway"


def test_update_keeps_the_state_of_known_endpoints() -> None:
    picker = EndpointPicker(Clock())
    picker.update([ep("10.0.0.1")])
    known = picker.endpoints[("10.0.0.1", 8443)]
    picker.started(known)
    picker.update([ep("10.0.0.1", terminating=True), ep("10.0.0.2")])
    assert picker.endpoints[("10.0.0.1", 8443)] is known
    assert known.outstanding == 1 and known.terminating


# --- the EndpointSlice reflector -------------------------------------------------------------------


@pytest.fixture
def client(kube_api: FakeKubeAPI, tmp_path: Path) -> KubeClient:
    return KubeClient(load_kubeconfig(write_kubeconfig(kube_api, tmp_path / "kubeconfig")), request_timeout=5)


def _fast_backoff() -> Backoff:
    return Backoff(initial=0.01, maximum=0.05, rng=random.Random(6))


async def _until(predicate: Callable[[], bool]) -> None:
    """Wait (bounded) until ``predicate()`` holds; the bound only turns a hang into a failure."""
    with trio.fail_after(10):
        while not predicate():
            await trio.sleep(0.005)


class Seen:
    """What the reflector handed on, per service."""

    def __init__(self) -> None:
        self.latest: dict[ServiceKey, tuple[ServiceEndpoint, ...] | None] = {}

    def __call__(self, key: ServiceKey, endpoints: tuple[ServiceEndpoint, ...] | None) -> None:
        self.latest[key] = endpoints

    def addresses(self, key: ServiceKey = SERVICE) -> set[tuple[str, bool, bool]] | None:
        found = self.latest.get(key)
        return None if found is None else {(e.address, e.ready, e.terminating) for e in found}


async def test_reflector_lists_watches_and_relists(
    kube_api: FakeKubeAPI, client: KubeClient, nursery: trio.Nursery
) -> None:
    """List with the service-name label selector, follow the watch, re-list after 410 Expired."""
    kube_api.put_slice("team-a", "hook-1", "hook", 8443, [("10.0.0.1", True, False)])
    kube_api.put_slice("team-a", "other-1", "other", 8443, [("10.9.9.9", True, False)])
    seen = Seen()
    source = ClusterEndpointSlices(client, seen, backoff=_fast_backoff)
    await nursery.start(source.run)
    source.watch_services([SERVICE])
    await _until(lambda: seen.addresses() == {("10.0.0.1", True, False)})
    assert kube_api.slice_requests(watch=False)[0]["labelSelector"] == "kubernetes.io/service-name=hook"
    await _until(lambda: len(kube_api.slice_requests(watch=True)) == 1)
    assert kube_api.slice_requests(watch=True)[0]["allowWatchBookmarks"] == "true"

    kube_api.put_slice("team-a", "hook-2", "hook", 8443, [("10.0.0.2", True, False)])
    kube_api.put_slice("team-a", "hook-1", "hook", 8443, [("10.0.0.1", False, True)])
    await _until(lambda: seen.addresses() == {("10.0.0.1", False, True), ("10.0.0.2", True, False)})

    kube_api.silent = True
    kube_api.delete_slice("team-a", "hook-1")
    kube_api.compact()
    kube_api.drop_watches()
    kube_api.silent = False
    await _until(lambda: seen.addresses() == {("10.0.0.2", True, False)})
    assert source.lists == 2, "410 Expired on the resumed watch: re-listed"


async def test_reflector_follows_the_referenced_services(
    kube_api: FakeKubeAPI, client: KubeClient, nursery: trio.Nursery
) -> None:
    """A reload that drops the last reference to a service hands None on (back to DNS)."""
    kube_api.put_slice("team-a", "hook-1", "hook", 8443, [("10.0.0.1", True, False)])
    snapshot = load(config(hook("a.b.c", clientConfig={"service": {"namespace": "team-a", "name": "hook"}})))
    seen = Seen()
    source = ClusterEndpointSlices(client, seen, backoff=_fast_backoff)
    await nursery.start(source.run)
    source.watch_services(referenced_services(snapshot))
    await _until(lambda: seen.addresses() == {("10.0.0.1", True, False)})
    source.watch_services([])
    await _until(lambda: SERVICE in seen.latest and seen.latest[SERVICE] is None)


async def test_slices_with_several_ports_use_the_service_port(
    kube_api: FakeKubeAPI, client: KubeClient, nursery: trio.Nursery
) -> None:
    """An FQDN slice is skipped (DNS does that already)."""
    kube_api.put_slice(
        "team-a", "hook-fqdn", "hook", 8443, [("pod.example.com", True, False)], address_type="FQDN"
    )
    kube_api.put_slice("team-a", "hook-1", "hook", 8443, [("10.0.0.1", True, False)])
    seen = Seen()
    source = ClusterEndpointSlices(client, seen, backoff=_fast_backoff)
    await nursery.start(source.run)
    source.watch_services([SERVICE])
    await _until(lambda: seen.addresses() == {("10.0.0.1", True, False)})
    found = seen.latest[SERVICE]
    assert found is not None and found[0].port == 8443


# --- whole calls: real backends as the pods of one service -----------------------------------------


async def _pods(
    nursery: trio.Nursery, ca: trustme.CA, hosts: list[str], name: str = DNS_NAME
) -> list[BackendServer]:
    context = server_context(ca, name, alpn=("http/1.1",))
    return [await nursery.start(BackendServer(ssl_context=context, host=h).serve) for h in hosts]


def _service_webhook(ca: trustme.CA) -> Webhook:
    bundle = base64.b64encode(ca.cert_pem.bytes()).decode()
    client_config = {"service": {"namespace": "team-a", "name": "hook", "path": "/v"}, "caBundle": bundle}
    return load(config(hook("a.b.c", clientConfig=client_config))).mutating[0]


async def _call(caller: BackendCaller, webhook: Webhook) -> int:
    reply = await caller.call(webhook, json.dumps({"kind": "AdmissionReview"}).encode(), timeout_seconds=5)
    return reply.status


async def test_calls_spread_over_the_pods_and_drain_a_terminating_one(
    kube_api: FakeKubeAPI, client: KubeClient, nursery: trio.Nursery
) -> None:
    """Calls to one service reach every ready pod (not just the first connection's), TLS verified
    against the service DNS name while dialling the pod address; a terminating pod gets no new calls."""
    ca = trustme.CA()
    pods = await _pods(nursery, ca, ["127.0.0.2", "127.0.0.3"])
    for i, pod in enumerate(pods):
        kube_api.put_slice("team-a", f"hook-{i}", "hook", pod.port, [(pod.host, True, False)])
    webhook = _service_webhook(ca)
    router = EndpointRouter(trio.current_time, rng=random.Random(4))
    source = ClusterEndpointSlices(client, router.update, backoff=_fast_backoff)
    await nursery.start(source.run)
    source.watch_services([SERVICE])
    await _until(lambda: SERVICE in router.pickers and len(router.pickers[SERVICE].endpoints) == 2)
    async with ClientPool() as pool:
        caller = BackendCaller(pool, endpoints=router)
        for _ in range(40):
            assert await _call(caller, webhook) == 200
        counts = [len(p.requests) for p in pods]
        assert all(c > 0 for c in counts), counts
        assert pods[0].requests[0].headers["host"] == f"{DNS_NAME}:443"

        kube_api.put_slice("team-a", "hook-0", "hook", pods[0].port, [(pods[0].host, False, True)])
        await _until(lambda: router.pickers[SERVICE].endpoints[(pods[0].host, pods[0].port)].terminating)
        before = len(pods[0].requests)
        for _ in range(20):
            assert await _call(caller, webhook) == 200
        assert len(pods[0].requests) == before


async def test_conversion_calls_spread_over_the_pods_too(nursery: trio.Nursery) -> None:
    """CNV-15: a CRD's conversion backend behind a clientConfig.service is balanced over its pods
    like an admission backend (one outbound caller), TLS verified against the service DNS name."""
    from gateway.config.load import load_documents
    from gateway.conversion.convert import ConversionService
    from tests.support.conversion import CRD, conversion_review, crd, crontab

    ca = trustme.CA()
    pods = await _pods(nursery, ca, ["127.0.0.2", "127.0.0.3"])
    router = EndpointRouter(trio.current_time, rng=random.Random(4))
    router.update(SERVICE, [ServiceEndpoint(p.host, p.port, True, False) for p in pods])
    service = {"namespace": "team-a", "name": "hook", "path": "/convert", "port": 443}
    snapshot = load_documents([("crd.yaml", crd(service=service, ca_bundle=ca.cert_pem.bytes()))])
    body = json.dumps(conversion_review([crontab()])).encode()
    async with ClientPool() as pool:
        conversions = ConversionService(BackendCaller(pool, endpoints=router))
        for _ in range(40):
            await conversions.handle(snapshot, CRD, body, deadline=trio.current_time() + 5)
    counts = [len(p.requests) for p in pods]
    assert all(c > 0 for c in counts) and sum(counts) == 40, counts
    assert pods[0].requests[0].headers["host"] == f"{DNS_NAME}:443"
    assert referenced_services(snapshot) == {SERVICE}, "the gateway watches the conversion service's pods"


async def test_tls_is_verified_against_the_service_name_not_the_pod_address(nursery: trio.Nursery) -> None:
    """A pod whose certificate is not for the service DNS name is refused, as with DNS."""
    ca = trustme.CA()
    (pod,) = await _pods(nursery, ca, ["127.0.0.2"], name="127.0.0.2")
    router = EndpointRouter(trio.current_time)
    router.update(SERVICE, [ServiceEndpoint(pod.host, pod.port, True, False)])
    async with ClientPool() as pool:
        with pytest.raises(CallingWebhookError) as failed:
            await _call(BackendCaller(pool, endpoints=router), _service_webhook(ca))
    assert failed.value.kind == "tls"
    assert "hook.team-a.svc" in str(failed.value)


async def test_a_pod_refusing_connections_is_ejected(nursery: trio.Nursery) -> None:
    """Consecutive connection failures eject a pod; later calls go to the healthy one."""
    ca = trustme.CA()
    (pod,) = await _pods(nursery, ca, ["127.0.0.3"])
    dead = trio.socket.socket()
    await dead.bind(("127.0.0.2", 0))  # bound, never listening: connections are refused
    dead_port = dead.getsockname()[1]
    router = EndpointRouter(trio.current_time, rng=random.Random(5), eject_after=2)
    router.update(
        SERVICE,
        [
            ServiceEndpoint("127.0.0.2", dead_port, True, False),
            ServiceEndpoint(pod.host, pod.port, True, False),
        ],
    )
    webhook = _service_webhook(ca)
    failures: list[str] = []
    async with ClientPool() as pool:
        caller = BackendCaller(pool, endpoints=router)
        for _ in range(30):
            try:
                await _call(caller, webhook)
            except CallingWebhookError as exc:
                failures.append(exc.kind)
    assert failures == ["connect", "connect"]
    assert router.pickers[SERVICE].endpoints[("127.0.0.2", dead_port)].ejected_until > trio.current_time()
    assert len(pod.requests) == 28
    dead.close()
