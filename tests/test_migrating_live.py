"""docs/migrating.md's cluster-side steps against the real kube-apiserver (tests/support/controlplane.py).

* Each guide's ``cluster/rbac.yaml``, applied with kubectl, lets the gateway's service account read
  exactly the objects its ``caFrom`` references name — ``get``, and ``list``/``watch`` selecting them by
  ``metadata.name``, as the gateway reads them — and nothing else of those kinds.
* Each guide's parking patch, applied with ``kubectl patch --type strategic`` as the guide says, makes
  the apiserver stop calling the original registration's webhooks (a backend that denies everything
  stops denying), and the rollback patch makes it call them again; a copy taken from the parked
  object with ``kubectl get -o yaml`` earns ``check``'s ``parked`` warning.

Not reproduced here: Kubewarden parks through its policy (its controller writes the webhook), and
Gatekeeper through Helm values (its chart renders the objects); their files are checked in
tests/test_migrating.py.
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.load import load_directory
from gateway.config.trust import watch_plan
from tests.support.controlplane import ControlPlane
from tests.support.processes import Backends, TLSFiles, start_backends

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "config" / "examples"
GATEWAY_SA = "system:serviceaccount:webhook-gateway:webhook-gateway"
RUN = uuid.uuid4().hex[:6]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- RBAC for exactly the referenced names ---------------------------------------------------------


def _object(kind: str, namespace: str, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    if kind == "Secret":
        return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": {"ca.crt": _b64(b"x")}}
    if kind == "ConfigMap":
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"ca.crt": "x"}}
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind, "metadata": meta, "webhooks": []}


@pytest.mark.parametrize(
    "project",
    ["cert-manager", "gatekeeper", "kyverno", "istio", "kubewarden"],
    ids=lambda p: f"issue 34: {p}'s rbac.yaml lets the gateway read exactly its CA references",
)
def test_rbac_allows_exactly_the_referenced_objects(control_plane: ControlPlane, project: str) -> None:
    plan = watch_plan(load_directory(EXAMPLES / project))
    namespaces = {o.namespace for o in plan.objects if o.namespace} | {"webhook-gateway"}
    created = [
        ns for ns in sorted(namespaces) if control_plane.api("GET", f"/api/v1/namespaces/{ns}")[0] == 404
    ]
    for ns in created:
        control_plane.create_namespace(ns)
    objects = [_object(o.kind, o.namespace, o.name) for o in plan.objects]
    decoys = [_object(o.kind, o.namespace, f"{o.name}-other-{RUN}") for o in plan.objects]
    rbac = EXAMPLES / project / "cluster" / "rbac.yaml"
    manifest = yaml.safe_dump_all([*objects, *decoys])
    control_plane.kubectl("apply", "-f", "-", input=manifest)
    control_plane.kubectl("apply", "-f", str(rbac))
    try:
        for obj, decoy in zip(plan.objects, decoys, strict=True):
            where = ["-n", obj.namespace] if obj.namespace else []
            resource = f"{obj.resource}.{obj.api_group}" if obj.api_group else obj.resource

            def as_gateway(*args: str, where: list[str] = where) -> subprocess.CompletedProcess[str]:
                return control_plane.kubectl("--as", GATEWAY_SA, *where, *args, check=False)

            got = as_gateway("get", resource, obj.name, "-o", "name")
            assert got.returncode == 0, got.stderr
            selected = as_gateway(
                "get", resource, "--field-selector", f"metadata.name={obj.name}", "-o", "name"
            )
            kind = f"{obj.kind.lower()}.{obj.api_group}" if obj.api_group else obj.kind.lower()
            assert selected.stdout.split() == [f"{kind}/{obj.name}"], selected.stderr
            watch = as_gateway(
                "get", resource, "--field-selector", f"metadata.name={obj.name}", "--watch", "-o", "name",
                "--request-timeout", "2s",
            )  # fmt: skip
            assert "forbidden" not in watch.stderr.lower(), watch.stderr
            other = as_gateway("get", resource, decoy["metadata"]["name"])
            assert other.returncode != 0
            assert "forbidden" in other.stderr.lower()
            everything = as_gateway("get", resource)
            assert "forbidden" in everything.stderr.lower(), "listing every object of the kind is not allowed"
    finally:
        control_plane.kubectl("delete", "--wait=false", "--ignore-not-found", "-f", str(rbac), check=False)
        control_plane.kubectl(
            "delete", "--wait=false", "--ignore-not-found", "-f", "-", input=manifest, check=False
        )
        for ns in created:
            control_plane.api("DELETE", f"/api/v1/namespaces/{ns}")


# --- parking the original registration ---------------------------------------------------------------


@pytest.fixture(scope="module")
def denying(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backends]:
    """Sample backends over TLS; /deny/... refuses every review with a message naming the path."""
    backends = start_backends(
        tmp_path_factory.mktemp("park-backends"), TLSFiles(tmp_path_factory.mktemp("park-tls"))
    )
    yield backends
    backends.stop()


def _original(copy_doc: dict[str, Any], backends: Backends, namespace: str) -> dict[str, Any]:
    """The project's own registration as it sits in the cluster: the copy's webhook names, calling a
    backend that denies, scoped to one namespace's ConfigMaps so that no other test meets it."""
    original = copy.deepcopy(copy_doc)
    original["metadata"] = {"name": copy_doc["metadata"]["name"]}
    for hook in original["webhooks"]:
        hook["clientConfig"] = {
            "url": backends.url(f"/deny/403/{hook['name']}%20called%20directly"),
            "caBundle": _b64(backends.tls.ca.cert_pem.bytes()),
        }
        hook["rules"] = [
            {"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"]}
        ]
        hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
        hook.pop("objectSelector", None)
        hook["matchPolicy"] = "Exact"
        hook["failurePolicy"] = "Fail"
        hook["timeoutSeconds"] = 5
    return original


PARKING = [
    pytest.param("cert-manager", "cert-manager-webhook.yaml", 0, "park.yaml", id="cert-manager: its validating webhook"),
    pytest.param("cert-manager", "cert-manager-webhook.yaml", 1, "park.yaml", id="cert-manager: its mutating webhook"),
    pytest.param("kyverno", "kyverno-resource-webhooks.yaml", 0, "park-validate.yaml", id="kyverno: resource validating webhooks"),
    pytest.param("kyverno", "kyverno-resource-webhooks.yaml", 1, "park-mutate.yaml", id="kyverno: resource mutating webhooks"),
    pytest.param("istio", "istio-sidecar-injector.yaml", 0, "park-injector.yaml", id="istio: the sidecar injector"),
    pytest.param("istio", "istio-validator.yaml", 0, "park-validator.yaml", id="istio: the config validator"),
]  # fmt: skip


@pytest.mark.parametrize(("project", "file", "document", "patch"), PARKING)
def test_parking_stops_the_direct_calls_and_unparking_restores_them(
    control_plane: ControlPlane,
    kube_namespace: str,
    denying: Backends,
    tmp_path: Path,
    project: str,
    file: str,
    document: int,
    patch: str,
) -> None:
    copied = list(yaml.safe_load_all((EXAMPLES / project / file).read_text()))[document]
    original = _original(copied, denying, kube_namespace)
    kind = original["kind"].lower()
    name = original["metadata"]["name"]
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(original))
    cluster = EXAMPLES / project / "cluster"

    def create(configmap: str) -> subprocess.CompletedProcess[str]:
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": configmap}}
        return control_plane.kubectl(
            "-n", kube_namespace, "create", "-f", "-", input=json.dumps(body), check=False
        )

    try:
        before = create("before")
        assert before.returncode != 0
        assert "called directly" in before.stderr
        control_plane.kubectl(
            "patch", kind, name, "--type", "strategic", "--patch-file", str(cluster / patch)
        )
        parked = create("parked")
        assert parked.returncode == 0, f"a parked webhook was still called: {parked.stderr}"
        # a copy taken from the parked object says so
        taken = control_plane.kubectl("get", kind, name, "-o", "yaml").stdout
        (tmp_path / "copy.yaml").write_text(taken)
        check = subprocess.run(
            [sys.executable, "-m", "gateway", "check", str(tmp_path / "copy.yaml")],
            capture_output=True, text=True, check=False, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert "[parked]" in check.stderr, check.stdout + check.stderr
        control_plane.kubectl(
            "patch", kind, name, "--type", "strategic", "--patch-file", str(cluster / f"un{patch}")
        )
        after = create("after")
        assert after.returncode != 0
        assert "called directly" in after.stderr
    finally:
        control_plane.kubectl("delete", kind, name, "--ignore-not-found", "--wait=false", check=False)
