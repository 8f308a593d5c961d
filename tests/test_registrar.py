"""Self-managed registration against the fake kube-apiserver in its real wire format.

Two replicas compete for a coordination.k8s.io Lease; the ready holder creates and keeps the two
registrations equal to what ``registration`` computes (caBundle included), follows configuration
reloads, survives resourceVersion conflicts (409), hands over when the holder stops renewing, and
relaxes the registrations to failurePolicy Ignore when the Deployment is uninstalled.

These rounds run in process against the fake, because they count and race individual writes (a
second writer between a read and a PUT) that the real apiserver neither reports nor lets a test
time; two real gateway processes against the real apiserver are in tests/test_kube_registrar.py.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trustme

from gateway.config.load import load_directory
from gateway.config.model import Snapshot
from gateway.registration import Settings, compute
from gateway.sources.kube import KubeClient, load_kubeconfig
from gateway.sources.registrar import COLLECTIONS, MANAGED_BY, KubeWriter, LeaderElection, Registrar
from tests.support.gateway import hook, write_config
from tests.support.kubeapi import FakeKubeAPI, kube_api, write_kubeconfig

__all__ = ["kube_api"]  # the fixture

LEASE = "/apis/coordination.k8s.io/v1/namespaces/webhook-gateway/leases/webhook-gateway-registration"
VWC = COLLECTIONS["ValidatingWebhookConfiguration"] + "/webhook-gateway"
MWC = COLLECTIONS["MutatingWebhookConfiguration"] + "/webhook-gateway"
DEPLOYMENT = "/apis/apps/v1/namespaces/webhook-gateway/deployments/webhook-gateway"
CA = trustme.CA().cert_pem.bytes()


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


class Replica:
    """One gateway replica's registrar, with its own readiness and view of the configuration."""

    def __init__(self, api: FakeKubeAPI, tmp_path: Path, identity: str, snapshot: Snapshot) -> None:
        client = KubeClient(load_kubeconfig(write_kubeconfig(api, tmp_path / f"{identity}.kubeconfig")))
        self.writer = KubeWriter(client)
        self.clock = Clock()
        self.is_ready = True
        self.config = snapshot
        self.registrar = Registrar(
            writer=self.writer,
            election=LeaderElection(
                self.writer, "webhook-gateway", "webhook-gateway-registration", identity, clock=self.clock
            ),
            snapshot=lambda: self.config,
            ready=lambda: self.is_ready,
            settings=lambda: Settings(ca_bundle=CA),
        )


def snapshot_of(tmp_path: Path, name: str, **kinds: Any) -> Snapshot:
    write_config(tmp_path / name, **kinds)
    return load_directory(tmp_path / name)


PODS = [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}]


@pytest.fixture
def config(tmp_path: Path) -> Snapshot:
    return snapshot_of(
        tmp_path,
        "c1",
        validating={"v": [hook("a.example.com", "https://a.example.com/v", rules=PODS)]},
        mutating={"m": [hook("b.example.com", "https://b.example.com/m", rules=PODS)]},
    )


def wanted(snapshot: Snapshot) -> dict[str, Any]:
    docs = compute(snapshot, Settings(ca_bundle=CA)).documents()
    return {d["kind"]: d["webhooks"] for d in docs}


def stored(api: FakeKubeAPI) -> dict[str, Any]:
    return {api.objects[p]["kind"]: api.objects[p]["webhooks"] for p in (VWC, MWC) if p in api.objects}


async def test_one_of_two_ready_replicas_creates_the_computed_registrations(
    kube_api: FakeKubeAPI, tmp_path: Path, config: Snapshot
) -> None:
    """Exactly one replica leads; it creates both registrations, caBundle included, labelled as managed."""
    a, b = Replica(kube_api, tmp_path, "gw-a", config), Replica(kube_api, tmp_path, "gw-b", config)
    await a.registrar.round()
    await b.registrar.round()
    assert (a.registrar.leading, b.registrar.leading) == (True, False)
    assert kube_api.objects[LEASE]["spec"]["holderIdentity"] == "gw-a"
    assert stored(kube_api) == wanted(config)
    for path in (VWC, MWC):
        obj = kube_api.objects[path]
        assert base64.b64decode(obj["webhooks"][0]["clientConfig"]["caBundle"]) == CA
        assert obj["metadata"]["labels"].items() >= MANAGED_BY.items()
    writes = [(m, p) for m, p, _ in kube_api.writes]
    assert writes == [
        ("POST", LEASE.rsplit("/", 1)[0]),
        ("POST", VWC.rsplit("/", 1)[0]),
        ("POST", MWC.rsplit("/", 1)[0]),
    ]
    # a steady state writes nothing but the Lease renewal
    kube_api.writes.clear()
    await a.registrar.round()
    await b.registrar.round()
    assert [(m, p) for m, p, _ in kube_api.writes] == [("PUT", LEASE)]


async def test_not_ready_replica_never_registers(
    kube_api: FakeKubeAPI, tmp_path: Path, config: Snapshot
) -> None:
    """Install order: a replica that is not ready neither takes the Lease nor registers anything."""
    a = Replica(kube_api, tmp_path, "gw-a", config)
    a.is_ready = False
    await a.registrar.round()
    assert (a.registrar.leading, kube_api.writes, kube_api.objects) == (False, [], {})


async def test_reload_and_manual_edits_are_reconciled(
    kube_api: FakeKubeAPI, tmp_path: Path, config: Snapshot
) -> None:
    """A configuration reload changes the registrations on the next round; a hand edit is put back."""
    a = Replica(kube_api, tmp_path, "gw-a", config)
    await a.registrar.round()
    kube_api.objects[VWC]["metadata"]["annotations"] = {"cert-manager.io/inject-ca-from": "x/y"}
    a.config = snapshot_of(
        tmp_path,
        "c2",
        validating={"v": [hook("a.example.com", "https://a.example.com/v", rules=PODS, timeoutSeconds=7)]},
    )
    await a.registrar.round()
    assert stored(kube_api) == wanted(a.config)
    assert kube_api.objects[MWC]["webhooks"] == [], "no mutating backend left: registered for nothing"
    assert kube_api.objects[VWC]["webhooks"][0]["timeoutSeconds"] == 8
    assert kube_api.objects[VWC]["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "x/y"}
    kube_api.objects[VWC]["webhooks"][0]["rules"][0]["resources"] = ["*"]  # someone widened it by hand
    await a.registrar.round()
    assert stored(kube_api) == wanted(a.config)


async def test_resource_version_conflicts(kube_api: FakeKubeAPI, tmp_path: Path, config: Snapshot) -> None:
    """A 409 on the Lease means someone else renewed first; a 409 on a registration is retried next round."""
    a = Replica(kube_api, tmp_path, "gw-a", config)
    await a.registrar.round()
    kube_api.interfere[LEASE] = 1
    await a.registrar.round()
    assert ("PUT", LEASE, 409) in kube_api.writes
    assert a.registrar.leading is False
    a.config = snapshot_of(
        tmp_path, "c2", validating={"v": [hook("c.example.com", "https://c.example.com/v")]}
    )
    kube_api.interfere[VWC] = 1
    await a.registrar.round()  # leads again (its own Lease), but the registration write conflicts
    assert a.registrar.leading is True
    assert ("PUT", VWC, 409) in kube_api.writes
    await a.registrar.round()
    assert stored(kube_api) == wanted(a.config)


async def test_lease_renewal_and_takeover(kube_api: FakeKubeAPI, tmp_path: Path, config: Snapshot) -> None:
    """The holder renews; the other replica takes over only after the Lease expires, then reconciles."""
    a, b = Replica(kube_api, tmp_path, "gw-a", config), Replica(kube_api, tmp_path, "gw-b", config)
    await a.registrar.round()
    first = kube_api.objects[LEASE]["spec"]["renewTime"]
    a.clock.now += timedelta(seconds=5)
    await a.registrar.round()
    assert kube_api.objects[LEASE]["spec"]["renewTime"] > first
    b.clock.now = a.clock.now + timedelta(seconds=10)  # 10 s after the last renewal: not expired (15 s)
    await b.registrar.round()
    assert b.registrar.leading is False
    b.config = snapshot_of(
        tmp_path, "c2", validating={"v": [hook("c.example.com", "https://c.example.com/v")]}
    )
    b.clock.now = a.clock.now + timedelta(seconds=16)  # a stopped renewing
    await b.registrar.round()
    assert b.registrar.leading is True
    lease = kube_api.objects[LEASE]["spec"]
    assert (lease["holderIdentity"], lease["leaseTransitions"]) == ("gw-b", 1)
    assert stored(kube_api) == wanted(b.config)
    a.clock.now = b.clock.now
    await a.registrar.round()
    assert a.registrar.leading is False


UNINSTALLS = [
    pytest.param(None, "Ignore", id="Deployment deleted: an uninstall relaxes both registrations to Ignore"),
    pytest.param({"spec": {"replicas": 0}}, "Ignore", id="Deployment scaled to zero: relaxed too"),
    pytest.param(
        {"spec": {"replicas": 3}}, "Fail", id="a rolling update leaves the registrations fail-closed"
    ),
]


@pytest.mark.parametrize(("deployment", "policy"), UNINSTALLS)
async def test_shutdown(
    kube_api: FakeKubeAPI, tmp_path: Path, config: Snapshot, deployment: dict[str, Any] | None, policy: str
) -> None:
    """On SIGTERM the holder relaxes only on uninstall, and always hands the Lease over at once."""
    if deployment is not None:
        kube_api.objects[DEPLOYMENT] = {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "metadata": {"name": "webhook-gateway", "resourceVersion": "1"}, **deployment}  # fmt: skip
    a, b = Replica(kube_api, tmp_path, "gw-a", config), Replica(kube_api, tmp_path, "gw-b", config)
    await a.registrar.round()
    await a.registrar.shutdown()
    assert {h["failurePolicy"] for p in (VWC, MWC) for h in kube_api.objects[p]["webhooks"]} == {policy}
    assert kube_api.objects[LEASE]["spec"]["holderIdentity"] == ""
    await b.registrar.round()  # no waiting for the Lease to expire
    assert b.registrar.leading is True
