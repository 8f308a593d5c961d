"""The operator path end to end against the real kube-apiserver, kubectl as the client.

The same backend webhook configurations are used twice, in two module-scoped phases:

* ``direct``: applied with ``kubectl apply`` (the apiserver calls each backend itself);
* ``gateway``: put in the gateway's configuration directory, the gateway serving on 127.0.0.1 with
  ``--namespace-source cluster``, and ``webhook-gateway registration --url`` applied with kubectl.

Every row of ``OPERATIONS`` runs in both phases and must give the same cluster outcome: kubectl's
exit status, what is stored, the warnings kubectl prints, and the message. Where the wording
differs on purpose, the row names the documented difference (docs/behaviour.md): the apiserver
puts its own prefix naming the webhook it called (GW-06), so behind the gateway the backend's
message is wrapped once more.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.support.controlplane import ControlPlane, free_port
from tests.support.processes import Backends, GatewayProcess, TLSFiles, start_backends, start_gateway_process

RUN = uuid.uuid4().hex[:8]
SCOPE = {"e2e-run": RUN}  # every backend sees only this module's namespaces


def _hook(name: str, backends: Backends, path: str, resources: list[str], **fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name,
        "clientConfig": {"url": backends.url(path), "caBundle": _b64(backends.tls.ca.cert_pem.bytes())},
        "rules": [
            {
                "operations": ["CREATE", "UPDATE", "DELETE"],
                "apiGroups": ["", "e2e.example.com"],
                "apiVersions": ["*"],
                "resources": resources,
            }
        ],
        "namespaceSelector": {"matchLabels": dict(SCOPE)},
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "failurePolicy": "Fail",
        "timeoutSeconds": 5,
    }
    doc.update(fields)
    return doc


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _labelled(key: str) -> dict[str, Any]:
    return {"matchLabels": {key: "yes"}}


def backend_configurations(backends: Backends) -> list[dict[str, Any]]:
    """The backends under test: one Validating- and one MutatingWebhookConfiguration."""
    dead = f"https://127.0.0.1:{free_port()}/allow"  # nothing listens there
    validating = [
        _hook(
            "deny.e2e.example.com", backends, "/deny/403/refused%20by%20policy",
            ["configmaps", "widgets"], objectSelector=_labelled("deny"),
        ),
        _hook(
            "warn.e2e.example.com", backends, "/warn/think%20twice/annotate/team/payments",
            ["configmaps"], objectSelector=_labelled("warn"),
        ),
        _hook(
            "cel-index.e2e.example.com", backends, "/allow", ["configmaps"],
            objectSelector={"matchLabels": {"cel": "index"}},
            matchConditions=[{"name": "needs-missing", "expression": "object.metadata.labels['missing'] == 'x'"}],
        ),
        _hook(
            "cel-field.e2e.example.com", backends, "/allow", ["configmaps"],
            objectSelector={"matchLabels": {"cel": "field"}},
            matchConditions=[{"name": "needs-missing", "expression": "object.metadata.labels.missing == 'x'"}],
        ),
        _hook("dead-fail.e2e.example.com", backends, "/allow", ["configmaps"], objectSelector=_labelled("dead")),
        _hook(
            "dead-ignore.e2e.example.com", backends, "/allow", ["configmaps"],
            objectSelector=_labelled("dead-ignore"), failurePolicy="Ignore",
        ),
        _hook(
            "slow.e2e.example.com", backends, "/sleep/3000/allow", ["configmaps"],
            objectSelector=_labelled("slow"), timeoutSeconds=1,
        ),
        _hook(
            "locked.e2e.example.com", backends, "/deny/403/namespace%20is%20locked", ["pods"],
            namespaceSelector={"matchLabels": {**SCOPE, "tier": "locked"}},
        ),
        _hook(
            "guard-delete.e2e.example.com", backends, "/deny/403/delete%20refused", ["configmaps"],
            objectSelector=_labelled("guard"),
        ),
    ]  # fmt: skip
    validating[-1]["rules"][0]["operations"] = ["DELETE"]
    validating[4]["clientConfig"]["url"] = dead
    validating[5]["clientConfig"]["url"] = dead
    mutating = [
        _hook(
            "label.e2e.example.com", backends, "/patch/checked/annotate/mutator/ran", ["pods", "widgets"],
            sideEffects="NoneOnDryRun", reinvocationPolicy="Never",
        ),
    ]  # fmt: skip
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": f"e2e-validating-{RUN}"},
            "webhooks": validating,
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": f"e2e-mutating-{RUN}"},
            "webhooks": mutating,
        },
    ]


WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.e2e.example.com"},
    "spec": {
        "group": "e2e.example.com",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


@dataclass
class Phase:
    """One way of registering the backends, with a namespace of its own."""

    name: str
    plane: ControlPlane
    namespace: str
    gateway: GatewayProcess | None

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.plane.kubectl("-n", self.namespace, *args, input=input, check=False)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return TLSFiles(tmp_path_factory.mktemp("e2e-tls"))


@pytest.fixture(scope="module")
def backends(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory, tls: TLSFiles
) -> Iterator[Backends]:
    running = start_backends(tmp_path_factory.mktemp("e2e-backends"), tls)
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(WIDGET_CRD))
    control_plane.wait_established("widgets.e2e.example.com")
    yield running
    running.stop()


@pytest.fixture(scope="module", params=["direct", "gateway"])
def phase(
    request: pytest.FixtureRequest,
    control_plane: ControlPlane,
    backends: Backends,
    tls: TLSFiles,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Phase]:
    mode: str = request.param
    namespace = control_plane.create_namespace(f"e2e-{mode}-{RUN}", labels=SCOPE)
    configs = backend_configurations(backends)
    workdir = tmp_path_factory.mktemp(f"e2e-{mode}")
    gateway = None
    if mode == "direct":
        registration = yaml.safe_dump_all(configs)
    else:
        (workdir / "config").mkdir()
        (workdir / "config" / "backends.yaml").write_text(yaml.safe_dump_all(configs))
        gateway = start_gateway_process(
            workdir, workdir / "config", tls,
            "--namespace-source", "cluster", "--kubeconfig", str(control_plane.kubeconfig),
        )  # fmt: skip
        printed = subprocess.run(
            [
                sys.executable, "-m", "gateway", "registration", "--config", str(workdir / "config"),
                "--name", f"e2e-gateway-{RUN}", "--url", gateway.url, "--ca-bundle", str(tls.ca_path),
            ],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        registration = printed.stdout
    (workdir / "registration.yaml").write_text(registration)
    control_plane.kubectl("apply", "-f", str(workdir / "registration.yaml"))
    try:
        yield Phase(mode, control_plane, namespace, gateway)
    finally:
        control_plane.kubectl("delete", "--wait=false", "-f", str(workdir / "registration.yaml"), check=False)
        control_plane.delete_namespace(namespace)
        if gateway is not None:
            gateway.stop()


# --- the table -----------------------------------------------------------------------------------


def configmap(name: str, **labels: str) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}})


def pod(name: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]},
        }
    )


def widget(name: str, **labels: str) -> str:
    return json.dumps(
        {"apiVersion": "e2e.example.com/v1", "kind": "Widget", "metadata": {"name": name, "labels": labels}}
    )


# The denying backends have failurePolicy Fail: behind the gateway they are reached through its -fail
# registration (docs/deploy.md: each backend's failure semantics kept).
GATEWAY_PREFIX = 'admission webhook "validate.webhook-gateway.io-fail" denied the request: '


@dataclass(frozen=True)
class Op:
    """One kubectl invocation and the outcome expected in both phases.

    ``message`` must appear in kubectl's stderr in both phases; ``gateway_message`` is what the
    gateway phase shows instead where the wording differs on purpose (the difference is named in
    the row's id).
    """

    args: tuple[str, ...]
    manifest: str | None = None
    ok: bool = True
    message: str = ""
    gateway_message: str | None = None
    warning: str = ""
    stored: tuple[str, ...] = ()  # `kubectl get` arguments that must find the object afterwards
    absent: tuple[str, ...] = ()  # ... that must not
    labels: dict[str, str] | None = None  # labels the stored object must carry
    before: tuple[tuple[tuple[str, ...], str | None], ...] = ()  # kubectl runs that must succeed first
    unlabelled: str = ""  # a label the stored object must not carry


OPERATIONS = [
    pytest.param(
        Op(("create", "-f", "-"), configmap("plain"), stored=("configmap", "plain")),
        id="a ConfigMap no backend objects to is created",
    ),
    pytest.param(
        Op(
            ("create", "-f", "-"),
            configmap("refused", deny="yes"),
            ok=False,
            message='admission webhook "deny.e2e.example.com" denied the request: refused by policy',
            gateway_message=GATEWAY_PREFIX + 'admission webhook "deny.e2e.example.com" denied the request: '
            "refused by policy",
            absent=("configmap", "refused"),
        ),
        id="a denial names the backend and carries its message (GW-06: the apiserver's prefix names the gateway)",
    ),
    pytest.param(
        Op(
            ("create", "-f", "-"),
            configmap("warned", warn="yes"),
            warning="Warning: think twice",
            stored=("configmap", "warned"),
        ),
        id="a backend's warning is printed by kubectl (AUD-07, AUD-08)",
    ),
    pytest.param(
        Op(("create", "-f", "-"), pod("mutated"), stored=("pod", "mutated"), labels={"checked": "true"}),
        id="a mutating backend's patch is in the stored Pod",
    ),
    pytest.param(
        Op(
            ("create", "-f", "-"),
            widget("w-mutated"),
            stored=("widget", "w-mutated"),
            labels={"checked": "true"},
        ),
        id="a custom resource is mutated like a built-in one",
    ),
    pytest.param(
        Op(
            ("create", "-f", "-"),
            widget("w-refused", deny="yes"),
            ok=False,
            message='admission webhook "deny.e2e.example.com" denied the request: refused by policy',
            gateway_message=GATEWAY_PREFIX + 'admission webhook "deny.e2e.example.com" denied the request: '
            "refused by policy",
            absent=("widget", "w-refused"),
        ),
        id="a custom resource is denied like a built-in one (GW-06 prefix)",
    ),
    pytest.param(
        Op(("create", "--dry-run=server", "-o", "json", "-f", "-"), pod("dry"), absent=("pod", "dry")),
        id="--dry-run=server reaches NoneOnDryRun backends and stores nothing",
    ),
    pytest.param(
        Op(
            ("create", "--dry-run=server", "-f", "-"),
            configmap("dry-refused", deny="yes"),
            ok=False,
            message='admission webhook "deny.e2e.example.com" denied the request: refused by policy',
            gateway_message=GATEWAY_PREFIX + 'admission webhook "deny.e2e.example.com" denied the request: '
            "refused by policy",
        ),
        id="--dry-run=server is denied like a real create (GW-06 prefix)",
    ),
    pytest.param(
        Op(
            ("create", "-f", "-"),
            configmap("cel-index", cel="index"),
            ok=False,
            message="configmaps \"cel-index\" is forbidden: expression 'object.metadata.labels['missing'] == "
            "'x'' resulted in error: no such key: missing\n",
            absent=("configmap", "cel-index"),
        ),
        id="a matchCondition whose index fails under Fail denies, naming the missing key (MAT-28)",
    ),
    pytest.param(
        Op(
            ("create", "-f", "-"),
            configmap("cel-field", cel="field"),
            ok=False,
            message='configmaps "cel-field" is forbidden: expression \'object.metadata.labels.missing == '
            "'x'' resulted in error: no such key: missing\n",
            absent=("configmap", "cel-field"),
        ),
        id="a matchCondition whose field selection fails under Fail denies, naming the missing key (MAT-28)",
    ),
    pytest.param(
        Op(
            ("create", "-f", "-"),
            configmap("dead", dead="yes"),
            ok=False,
            message='failed calling webhook "dead-fail.e2e.example.com": failed to call webhook: Post',
            absent=("configmap", "dead"),
        ),
        id="an unreachable backend under Fail denies with the apiserver's wording",
    ),
    pytest.param(
        Op(
            ("create", "-f", "-"),
            configmap("dead-ignore", **{"dead-ignore": "yes"}),
            stored=("configmap", "dead-ignore"),
        ),
        id="an unreachable backend under Ignore lets the request through",
    ),
    pytest.param(
        Op(
            ("create", "-f", "-"),
            configmap("slow", slow="yes"),
            ok=False,
            message='failed calling webhook "slow.e2e.example.com": failed to call webhook: Post',
            absent=("configmap", "slow"),
        ),
        id="a backend slower than its timeoutSeconds under Fail denies",
    ),
    pytest.param(
        Op(
            ("apply", "-f", "-"),
            configmap("applied", deny="yes"),
            ok=False,
            message='admission webhook "deny.e2e.example.com" denied the request: refused by policy',
            gateway_message=GATEWAY_PREFIX + 'admission webhook "deny.e2e.example.com" denied the request: '
            "refused by policy",
            stored=("configmap", "applied"),
            unlabelled="deny",
            before=((("apply", "-f", "-"), configmap("applied")),),
        ),
        id="kubectl apply that would add a denied label is refused and the stored object is unchanged (GW-06 prefix)",
    ),
    pytest.param(
        Op(
            ("delete", "configmap", "guarded"),
            ok=False,
            message='admission webhook "guard-delete.e2e.example.com" denied the request: delete refused',
            gateway_message=GATEWAY_PREFIX + 'admission webhook "guard-delete.e2e.example.com" denied the '
            "request: delete refused",
            stored=("configmap", "guarded"),
            before=((("create", "-f", "-"), configmap("guarded", guard="yes")),),
        ),
        id="kubectl delete refused by a DELETE-only backend leaves the object (GW-06 prefix)",
    ),
]


@pytest.mark.parametrize("op", OPERATIONS)
def test_same_cluster_outcome_direct_and_behind_the_gateway(phase: Phase, op: Op) -> None:
    for args, manifest in op.before:
        prepared = phase.kubectl(*args, input=manifest)
        assert prepared.returncode == 0, (phase.name, prepared.stderr)
    done = phase.kubectl(*op.args, input=op.manifest)
    assert (done.returncode == 0) is op.ok, (phase.name, done.stdout, done.stderr)
    message = op.gateway_message if phase.gateway is not None and op.gateway_message else op.message
    assert message in done.stderr, (phase.name, done.stderr)
    if op.warning:
        assert op.warning in done.stderr, (phase.name, done.stderr)
    else:
        assert "Warning:" not in done.stderr, (phase.name, done.stderr)
    if op.stored:
        got = phase.kubectl("get", *op.stored, "-o", "json")
        assert got.returncode == 0, got.stderr
        labels = json.loads(got.stdout)["metadata"].get("labels", {})
        for key, value in (op.labels or {}).items():
            assert labels.get(key) == value, labels
        assert op.unlabelled not in labels, labels
    if op.absent:
        got = phase.kubectl("get", *op.absent)
        assert got.returncode == 1 and "NotFound" in got.stderr, got.stderr


def test_relabelling_the_namespace_flips_the_decision(phase: Phase) -> None:
    """MAT-13: a namespaceSelector follows the namespace's labels, behind the gateway through its watch."""
    plane, namespace = phase.plane, phase.namespace

    def outcome(name: str) -> int:
        return phase.kubectl("create", "--dry-run=server", "-f", "-", input=pod(name)).returncode

    try:
        plane.kubectl("label", "namespace", namespace, "tier=locked")
        deadline = time.monotonic() + 10
        while outcome("locked") == 0:
            assert time.monotonic() < deadline, "the label never took effect"
        denied = phase.kubectl("create", "--dry-run=server", "-f", "-", input=pod("locked"))
        assert (
            'admission webhook "locked.e2e.example.com" denied the request: namespace is locked'
            in denied.stderr
        )
    finally:
        plane.kubectl("label", "namespace", namespace, "tier-")
    deadline = time.monotonic() + 10
    while outcome("unlocked") != 0:
        assert time.monotonic() < deadline, "the label's removal never took effect"


# The apiserver records a webhook's annotation as "<webhook>/<key>" (AUD-01); behind the gateway the
# webhook it calls is the gateway, so the gateway returns "<backend>_<key>" (AUD-04) and its facts
# about each invocation under keys without "/" (AUD-05, AUD-06): docs/behaviour.md, audit annotations.
AUDIT = [
    pytest.param(
        configmap("aud-warn", warn="yes"),
        {"warn.e2e.example.com/team": "payments"},
        {"validate.webhook-gateway.io-fail/warn.e2e.example.com_team": "payments"},
        id="a backend's annotation: <backend>/<key> directly, <gateway>/<backend>_<key> behind it (AUD-01, AUD-04)",
    ),
    pytest.param(
        pod("aud-pod"),
        {
            "label.e2e.example.com/mutator": "ran",
            "mutation.webhook.admission.k8s.io/round_0_index_0": '{"configuration":"e2e-mutating-RUN",'
            '"webhook":"label.e2e.example.com","mutated":true}',
        },
        {
            "mutate.webhook-gateway.io/label.e2e.example.com_mutator": "ran",
            "mutate.webhook-gateway.io/mutation.round_0_index_0": '{"configuration":"e2e-mutating-RUN",'
            '"webhook":"label.e2e.example.com","mutated":true}',
        },
        id="each mutating call is recorded, naming the backend, behind the gateway too (AUD-05, AUD-06)",
    ),
    pytest.param(
        configmap("aud-ignore", **{"dead-ignore": "yes"}),
        {"failed-open.validating.webhook.admission.k8s.io/round_0_index_0": "dead-ignore.e2e.example.com"},
        {
            "validate.webhook-gateway.io-ignore/failed-open.validating.round_0_index_0": "dead-ignore.e2e.example.com"
        },
        id="a fail-open call is recorded, naming the backend, behind the gateway too (AUD-05, AUD-06)",
    ),
]


@pytest.mark.parametrize(("manifest", "direct", "behind"), AUDIT)
def test_annotations_in_the_apiservers_audit_log(
    phase: Phase, manifest: str, direct: dict[str, str], behind: dict[str, str]
) -> None:
    name = json.loads(manifest)["metadata"]["name"]
    mark = phase.plane.audit.mark()
    created = phase.kubectl("create", "-f", "-", input=manifest)
    assert created.returncode == 0, created.stderr
    event = phase.plane.audit.wait_for(
        lambda e: (
            e["verb"] == "create"
            and e.get("objectRef", {}).get("namespace") == phase.namespace
            and e["objectRef"].get("name") == name
        ),
        since=mark,
    )
    wanted = behind if phase.gateway is not None else direct
    annotations = event.get("annotations", {})
    for key, value in wanted.items():
        assert annotations.get(key) == value.replace("RUN", RUN), (key, annotations)
