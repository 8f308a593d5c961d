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
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.load import load_directory
from gateway.config.trust import watch_plan
from tests.support.controlplane import ControlPlane
from tests.support.processes import Backends, TLSFiles, start_backends, start_gateway_process

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


# --- the gateway following its owner's CA rotation, through the real apiserver ------------------------------

FOLLOW = [
    pytest.param("mutatingWebhookConfiguration", id="issue 34 §1: a live webhook configuration's caBundle, patched by a cainjector"),
    pytest.param("secret", id="issue 34 §1: a Secret key, rotated by its owner"),
    pytest.param("configMap", id="issue 34 §1: a ConfigMap key, rotated by its owner"),
]  # fmt: skip


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("source", FOLLOW)
def test_the_gateway_follows_the_owners_ca_rotation_without_a_restart(
    control_plane: ControlPlane, tmp_path: Path, source: str
) -> None:
    """The migration's end state: the original registration parked where its owner keeps its CA fresh,
    the gateway's copy naming that place. A real TLS backend's certificate changes CA; the owner (a
    kubectl patch standing in for cainjector, istiod or a cert controller) publishes the new CA; the
    gateway verifies the backend with it from then on, without a restart. A bad value published later
    is refused and the last good CA stays in force."""
    run = uuid.uuid4().hex[:6]
    namespace = control_plane.create_namespace(f"follow-{run}")
    old_tls, new_tls = TLSFiles(tmp_path / "old-ca"), TLSFiles(tmp_path / "new-ca")
    backends = start_backends(tmp_path / "backends-old", old_tls)
    webhook = f"inject.follow-{run}.example.com"
    url = backends.url("/deny/403/reached%20the%20backend")
    holder = f"holder-{run}"

    def publish(pem: bytes) -> None:
        """The owner writes its CA where it keeps it."""
        if source == "secret":
            body: dict[str, Any] = {"data": {"ca.crt": _b64(pem)}}
            control_plane.kubectl(
                "-n", namespace, "patch", "secret", holder, "--type", "merge", "-p", json.dumps(body)
            )
        elif source == "configMap":
            body = {"data": {"ca.crt": pem.decode()}}
            control_plane.kubectl(
                "-n", namespace, "patch", "configmap", holder, "--type", "merge", "-p", json.dumps(body)
            )
        else:
            body = {"webhooks": [{"name": webhook, "clientConfig": {"caBundle": _b64(pem)}}]}
            control_plane.kubectl(
                "patch", "mutatingwebhookconfiguration", holder, "--type", "strategic", "-p", json.dumps(body)
            )

    if source == "secret":
        control_plane.kubectl(
            "-n", namespace, "create", "secret", "generic", holder, "--from-literal=ca.crt=x"
        )
        reference = {"secret": {"namespace": namespace, "name": holder}}
    elif source == "configMap":
        control_plane.kubectl("-n", namespace, "create", "configmap", holder, "--from-literal=ca.crt=x")
        reference = {"configMap": {"namespace": namespace, "name": holder}}
    else:  # the original registration, parked: its owner keeps its caBundle fresh
        original = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": holder},
            "webhooks": [{
                "name": webhook, "clientConfig": {"url": url}, "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "matchConditions": [{"name": "webhook-gateway.io/parked", "expression": "false"}],
            }],
        }  # fmt: skip
        control_plane.kubectl("apply", "-f", "-", input=json.dumps(original))
        reference = {"mutatingWebhookConfiguration": {"name": holder}}
    publish(old_tls.ca.cert_pem.bytes())

    config_dir = tmp_path / "config"
    config_dir.mkdir()
    copy_doc = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": f"copy-{run}", "annotations": {
            "webhook-gateway.io/backend-policy": json.dumps({"*": {"caFrom": reference}})}},
        "webhooks": [{
            "name": webhook, "clientConfig": {"url": url}, "sideEffects": "None", "admissionReviewVersions": ["v1"],
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"]}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "failurePolicy": "Fail", "timeoutSeconds": 5,
        }],
    }  # fmt: skip
    (config_dir / "copy.yaml").write_text(yaml.safe_dump(copy_doc))
    gateway_tls = TLSFiles(tmp_path / "gateway-tls")
    gateway = start_gateway_process(
        tmp_path / "gateway", config_dir, gateway_tls,
        "--namespace-source", "cluster", "--kubeconfig", str(control_plane.kubeconfig),
    )  # fmt: skip
    registration = subprocess.run(
        [sys.executable, "-m", "gateway", "registration", "--config", str(config_dir), "--name", f"gw-{run}",
         "--url", gateway.url, "--ca-bundle", str(gateway_tls.ca_path)],
        capture_output=True, text=True, check=True, timeout=60, cwd=REPO,
    ).stdout  # fmt: skip
    (tmp_path / "registration.yaml").write_text(registration)
    control_plane.kubectl("apply", "-f", str(tmp_path / "registration.yaml"))

    def create(name: str) -> str:
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}
        proc = control_plane.kubectl(
            "-n", namespace, "create", "-f", "-", input=json.dumps(body), check=False
        )
        assert proc.returncode != 0, "every review reaches the backend, which denies it"
        return proc.stderr

    def in_force() -> int:
        return sum(1 for e in gateway.log_events() if e.get("event") == "backend CA in force")

    try:
        assert "reached the backend" in create("first"), "verified with the CA read from the reference"

        # the backend's certificate changes CA (the owner re-issued it); until the owner publishes
        # the new CA, the gateway cannot verify it
        backends.stop()
        backends = start_backends(tmp_path / "backends-new", new_tls, port=backends.port)
        assert "x509: certificate signed by unknown authority" in create("before-publish")
        before = in_force()
        publish(new_tls.ca.cert_pem.bytes())
        _wait_for(lambda: in_force() > before, "the gateway to put the new CA in force")
        assert "reached the backend" in create("after-publish"), "followed without a restart"

        # a bad value: refused, logged, and the last good CA stays in force
        publish(b"-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
        _wait_for(
            lambda: any(e.get("event") == "backend CA refused; the last good one stays in force" for e in gateway.log_events()),
            "the gateway to refuse the bad value",
        )  # fmt: skip
        assert "reached the backend" in create("after-bad-value")
        assert gateway.proc.poll() is None
    finally:
        control_plane.kubectl(
            "delete",
            "--wait=false",
            "--ignore-not-found",
            "-f",
            str(tmp_path / "registration.yaml"),
            check=False,
        )
        control_plane.kubectl(
            "delete",
            "mutatingwebhookconfiguration",
            holder,
            "--ignore-not-found",
            "--wait=false",
            check=False,
        )
        control_plane.api("DELETE", f"/api/v1/namespaces/{namespace}")
        gateway.stop()
        backends.stop()


def test_the_guides_order_of_steps_never_leaves_a_review_undecided(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    """docs/migrating.md's steps with a real original registration, a real gateway and kubectl: the copy
    in Shadow (the original decides), the copy enforcing (both decide, the same way), the original
    parked (the gateway alone decides), and the rollback in reverse. At every step a review the backend
    denies is denied; only the webhook named in the denial changes."""
    run = uuid.uuid4().hex[:6]
    namespace = control_plane.create_namespace(f"steps-{run}")
    backend_tls = TLSFiles(tmp_path / "backend-ca")
    backends = start_backends(tmp_path / "backends", backend_tls)
    webhook = f"check.steps-{run}.example.com"
    original_name = f"original-{run}"
    ca = _b64(backend_tls.ca.cert_pem.bytes())
    webhook_doc = {
        "name": webhook, "clientConfig": {"url": backends.url("/deny/403/refused%20by%20the%20backend"), "caBundle": ca},
        "sideEffects": "None", "admissionReviewVersions": ["v1"], "failurePolicy": "Fail", "timeoutSeconds": 5,
        "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"]}],
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
    }  # fmt: skip
    original = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": original_name}, "webhooks": [webhook_doc]}  # fmt: skip
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(original))  # the project, registered directly

    config_dir = tmp_path / "config"
    config_dir.mkdir()

    def write_copy(mode: str) -> None:
        copy_doc = copy.deepcopy(original)
        copy_doc["metadata"] = {"name": original_name, "annotations": {
            "webhook-gateway.io/backend-policy": json.dumps(
                {"*": {"mode": mode, "caFrom": {"validatingWebhookConfiguration": {"name": original_name}}}})}}  # fmt: skip
        (config_dir / "copy.yaml").write_text(yaml.safe_dump(copy_doc))

    write_copy("Shadow")
    gateway_tls = TLSFiles(tmp_path / "gateway-tls")
    gateway = start_gateway_process(
        tmp_path / "gateway", config_dir, gateway_tls,
        "--namespace-source", "cluster", "--kubeconfig", str(control_plane.kubeconfig), "--config-poll-seconds", "0.2",
    )  # fmt: skip
    registration = tmp_path / "registration.yaml"
    registration.write_text(
        subprocess.run(
            [sys.executable, "-m", "gateway", "registration", "--config", str(config_dir), "--name", f"gw-{run}",
             "--url", gateway.url, "--ca-bundle", str(gateway_tls.ca_path)],
            capture_output=True, text=True, check=True, timeout=60, cwd=REPO,
        ).stdout
    )  # fmt: skip
    control_plane.kubectl("apply", "-f", str(registration))
    created = 0

    def denied_by() -> str:
        """Create a ConfigMap: it must be denied; the webhook the apiserver names."""
        nonlocal created
        created += 1
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"cm-{created}"}}
        proc = control_plane.kubectl(
            "-n", namespace, "create", "-f", "-", input=json.dumps(body), check=False
        )
        assert proc.returncode != 0, "a review was admitted: no webhook decided it"
        assert "refused by the backend" in proc.stderr, proc.stderr
        return proc.stderr.split('admission webhook "', 1)[1].split('"', 1)[0]

    def reloaded(mode: str) -> None:
        before = sum(1 for e in gateway.log_events() if e.get("event") == "configuration loaded")
        write_copy(mode)
        _wait_for(
            lambda: sum(1 for e in gateway.log_events() if e.get("event") == "configuration loaded") > before,
            "the gateway to reload its configuration",
        )

    park = {
        "webhooks": [
            {
                "name": webhook,
                "matchConditions": [{"name": "webhook-gateway.io/parked", "expression": "false"}],
            }
        ]
    }
    unpark = {
        "webhooks": [
            {"name": webhook, "matchConditions": [{"name": "webhook-gateway.io/parked", "$patch": "delete"}]}
        ]
    }
    vwc = ("validatingwebhookconfiguration", original_name)
    try:
        # 1-3: the copy in Shadow: the original decides (the gateway's shadow call never changes the answer)
        assert denied_by() == webhook
        # 4: enforce: both decide the same way; the apiserver reports the first that denied
        reloaded("Enforce")
        assert denied_by() in (webhook, "validate.webhook-gateway.io-fail", "validate.webhook-gateway.io")
        # 5: park the original: the gateway alone decides
        control_plane.kubectl("patch", *vwc, "--type", "strategic", "-p", json.dumps(park))
        assert denied_by().startswith("validate.webhook-gateway.io")
        # the parked original still holds the CA the gateway reads (its owner keeps it there)
        # rollback: unpark first, then the copy back to Shadow
        control_plane.kubectl("patch", *vwc, "--type", "strategic", "-p", json.dumps(unpark))
        denied_by()
        reloaded("Shadow")
        assert denied_by() == webhook
    finally:
        control_plane.kubectl(
            "delete", "--wait=false", "--ignore-not-found", "-f", str(registration), check=False
        )
        control_plane.kubectl("delete", *vwc, "--ignore-not-found", "--wait=false", check=False)
        control_plane.api("DELETE", f"/api/v1/namespaces/{namespace}")
        gateway.stop()
        backends.stop()
