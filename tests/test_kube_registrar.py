"""Self-managed registration (``--manage-registration``) with two gateway processes, against the real
kube-apiserver: one Lease holder creates and keeps the registrations, puts them back when deleted
with kubectl, the other replica takes over within the Lease duration when the leader is killed, and
an uninstall (the Deployment gone) relaxes them to ``failurePolicy: Ignore``.

The registrations name the gateway's Service, which nothing routes to here, so the backends ask only
for a resource no other test creates: the apiserver never has to call them.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.controlplane import ControlPlane
from tests.support.processes import GatewayProcess, TLSFiles, start_gateway_process

LEASE_SECONDS = 15  # the registrar's Lease (gateway/sources/registrar.py lease_seconds_for(2 s))
NAME = "webhook-gateway"  # both registrations' default name


def _wait(predicate: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while not (found := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.1)
    return found


def _backends(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rules = [
        {
            "operations": ["CREATE"],
            "apiGroups": ["e2e.example.com"],
            "apiVersions": ["v1"],
            "resources": ["registrartests"],
        }
    ]
    hooks = [
        {
            "name": "a.e2e.example.com",
            "clientConfig": {"url": "https://a.e2e.example.com/validate"},
            "rules": rules,
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
        }
    ]
    doc = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "backends"},
        "webhooks": hooks,
    }
    (directory / "webhooks.yaml").write_text(yaml.safe_dump(doc))
    return directory


@pytest.fixture
def replicas(control_plane: ControlPlane, tmp_path: Path) -> Iterator[tuple[str, dict[str, GatewayProcess]]]:
    namespace = control_plane.create_namespace()
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": NAME}},
            "template": {
                "metadata": {"labels": {"app": NAME}},
                "spec": {"containers": [{"name": "gateway", "image": "webhook-gateway:test"}]},
            },
        },
    }
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(deployment))
    tls = TLSFiles(tmp_path / "tls")
    config = _backends(tmp_path / "config")
    running: dict[str, GatewayProcess] = {}
    try:
        for name in ("gw-a", "gw-b"):
            running[name] = start_gateway_process(
                tmp_path, config, tls,
                "--manage-registration", "--kubeconfig", str(control_plane.kubeconfig),
                "--registration-namespace", namespace, "--registration-ca-bundle", str(tls.ca_path),
                env={"POD_NAME": name},
            )  # fmt: skip
        yield namespace, running
    finally:
        for gateway in running.values():
            gateway.stop(signal.SIGKILL)
        for kind in ("validatingwebhookconfiguration", "mutatingwebhookconfiguration"):
            control_plane.kubectl("delete", "--ignore-not-found", kind, NAME)
        control_plane.delete_namespace(namespace)


def _registration(plane: ControlPlane) -> dict[str, Any] | None:
    status, body = plane.api(
        "GET", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{NAME}"
    )
    return body if status == 200 else None


def _holder(plane: ControlPlane, namespace: str) -> str:
    status, lease = plane.api(
        "GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{NAME}-registration"
    )
    return str(lease["spec"].get("holderIdentity") or "") if status == 200 else ""


def test_leader_keeps_the_registration_and_another_replica_takes_over(
    control_plane: ControlPlane, replicas: tuple[str, dict[str, GatewayProcess]]
) -> None:
    namespace, running = replicas
    created = _wait(lambda: _registration(control_plane), 20, "the leader creates the registration")
    service = created["webhooks"][0]["clientConfig"]["service"]
    assert (service["namespace"], service["name"]) == (namespace, NAME)
    assert created["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "webhook-gateway"
    leader = _holder(control_plane, namespace)
    assert leader in running

    control_plane.kubectl("delete", "validatingwebhookconfiguration", NAME)
    _wait(
        lambda: _registration(control_plane), 10, "the leader re-creates a registration deleted with kubectl"
    )

    running[leader].stop(signal.SIGKILL)  # no release of the Lease: the other waits for it to expire
    killed = time.monotonic()
    other = next(name for name in running if name != leader)
    _wait(
        lambda: _holder(control_plane, namespace) == other, LEASE_SECONDS + 5, "the other replica takes over"
    )
    assert time.monotonic() - killed <= LEASE_SECONDS + 5
    control_plane.kubectl("delete", "validatingwebhookconfiguration", NAME)
    _wait(lambda: _registration(control_plane), 10, "the new leader keeps the registration")

    # Uninstall: the Deployment is deleted, then the last replica gets SIGTERM and relaxes both.
    control_plane.kubectl("-n", namespace, "delete", "deployment", NAME)
    assert running[other].stop() == 0
    relaxed = _registration(control_plane)
    assert relaxed is not None and {h["failurePolicy"] for h in relaxed["webhooks"]} == {"Ignore"}
    assert _holder(control_plane, namespace) == "", "the Lease is released"
