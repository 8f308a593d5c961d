"""A backend's CA from where its owner keeps it (issue 34): the ``caFrom`` field of the backend-policy
annotation parsed, validated with paths naming file, object and field, resolved per webhook and
attached to its client config; the objects to watch and the RBAC for exactly those names; `check`'s
CA warnings (``ca-missing``, ``ca-expiry``); and the gateway's own registration refused as a backend."""

from __future__ import annotations

import base64
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.config.backend_policy import ANNOTATION
from gateway.config.load import load_directory
from gateway.config.trust import CaReference, WatchedObject, rbac_documents, rbac_rules, watch_plan
from tests.configs.builders import MUTATING, VALIDATING, config, errors_of, hook, load, problems_of

REPO = Path(__file__).resolve().parent.parent
ROOT = f"metadata.annotations[{ANNOTATION}]"
THIRD_PARTY = REPO / "tests" / "configs" / "thirdparty"
SERVICE = {"service": {"namespace": "team-a", "name": "policy", "path": "/validate"}}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True, text=True, check=False, timeout=60, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip


def annotated(
    policy: str, *hooks: dict[str, Any], kind: str = MUTATING, name: str = "team-a"
) -> dict[str, Any]:
    doc = config(*(hooks or (hook("a.b.c", clientConfig=SERVICE),)), kind=kind, name=name)
    doc["metadata"]["annotations"] = {ANNOTATION: policy}
    return doc


def ca_pem(*, not_before: dt.datetime, not_after: dt.datetime, cn: str = "backend-ca") -> bytes:
    """A self-signed CA certificate with exactly this validity."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


NOW = dt.datetime.now(dt.UTC)


# --- caFrom: parsed, validated, resolved ----------------------------------------------------------------

REFERENCES = [
    pytest.param(
        '"*": {caFrom: {secret: {namespace: cert-manager, name: cert-manager-webhook-ca}}}',
        CaReference(source="secret", namespace="cert-manager", name="cert-manager-webhook-ca", key="ca.crt"),
        id="a Secret key, ca.crt by default",
    ),
    pytest.param(
        '"*": {caFrom: {secret: {namespace: kyverno, name: kyverno-svc.kyverno.svc.kyverno-tls-ca, key: tls.crt}}}',
        CaReference(source="secret", namespace="kyverno", name="kyverno-svc.kyverno.svc.kyverno-tls-ca", key="tls.crt"),
        id="a Secret key named (tls.crt)",
    ),
    pytest.param(
        '"*": {caFrom: {configMap: {namespace: istio-system, name: istio-ca-root-cert, key: root-cert.pem}}}',
        CaReference(source="configMap", namespace="istio-system", name="istio-ca-root-cert", key="root-cert.pem"),
        id="a ConfigMap key (Istio's root-cert.pem)",
    ),
    pytest.param(
        '"*": {caFrom: {mutatingWebhookConfiguration: {name: istio-sidecar-injector}}}',
        CaReference(source="mutatingWebhookConfiguration", name="istio-sidecar-injector", webhook="a.b.c"),
        id="the caBundle of a live configuration's webhook of the same name, by default",
    ),
    pytest.param(
        'a.b.c: {caFrom: {validatingWebhookConfiguration: {name: clusterwide-x, webhook: clusterwide-x.kubewarden.admission}}}',
        CaReference(source="validatingWebhookConfiguration", name="clusterwide-x", webhook="clusterwide-x.kubewarden.admission"),
        id="the caBundle of a named webhook of a live configuration",
    ),
    pytest.param(
        'a.b.c: {caFrom: {file: /etc/webhook-gateway/ca/team-a.pem}}',
        CaReference(source="file", path="/etc/webhook-gateway/ca/team-a.pem"),
        id="a file (file mode, or a mounted volume)",
    ),
    pytest.param(
        '"*": {caFrom: {file: /a.pem}}\na.b.c: {caFrom: null}',
        None,
        id="an explicit null turns an inherited reference off",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "expected"), REFERENCES)
def test_ca_reference_reaches_the_client_config(policy: str, expected: CaReference | None) -> None:
    (hook_,) = load(annotated(policy)).mutating
    assert hook_.client_config.ca_from == expected
    assert hook_.backend_policy.ca_from == expected


INVALID = [
    pytest.param(
        '"*": {caFrom: {secret: {namespace: cert-manager}}}',
        [f"{ROOT}[*].caFrom.secret.name: Required value"],
        id="a Secret needs a name",
    ),
    pytest.param(
        '"*": {caFrom: {configMap: {name: istio-ca-root-cert}}}',
        [f"{ROOT}[*].caFrom.configMap.namespace: Required value"],
        id="a ConfigMap needs a namespace (the gateway's is not assumed)",
    ),
    pytest.param(
        '"*": {caFrom: {secret: {namespace: a, name: b}, file: /c.pem}}',
        [f"{ROOT}[*].caFrom: Invalid value: must name exactly one of configMap, file, "
         "mutatingWebhookConfiguration, secret, validatingWebhookConfiguration (found secret, file)"],
        id="exactly one source",
    ),
    pytest.param(
        '"*": {caFrom: {}}',
        [f"{ROOT}[*].caFrom: Invalid value: must name exactly one of configMap, file, "
         "mutatingWebhookConfiguration, secret, validatingWebhookConfiguration (found none)"],
        id="an empty reference names nothing",
    ),
    pytest.param(
        '"*": {caFrom: {file: ca.pem}}',
        [f'{ROOT}[*].caFrom.file: Invalid value: "ca.pem": must be an absolute file path'],
        id="a file path is absolute",
    ),
    pytest.param(
        '"*": {caFrom: {secret: {namespace: Team_A, name: b, key: "c/d"}}}',
        [
            f'{ROOT}[*].caFrom.secret.namespace: Invalid value: "Team_A": a lowercase RFC 1123 label must '
            "consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric "
            "character (e.g. 'my-name',  or '123-abc', regex used for validation is "
            "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')",
            f"{ROOT}[*].caFrom.secret.key: Invalid value: \"c/d\": a valid config key must consist of "
            "alphanumeric characters, '-', '_' or '.'",
        ],
        id="names and keys as the apiserver validates them",
    ),
    pytest.param(
        '"*": {caFrom: "cert-manager/cert-manager-webhook-ca"}',
        [f"{ROOT}[*].caFrom: Invalid value: must be an object or null, not string"],
        id="not a string",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "expected"), INVALID)
def test_invalid_reference_refuses_the_configuration(policy: str, expected: list[str]) -> None:
    assert errors_of(annotated(policy)) == expected


def test_misspelt_reference_fields_warn() -> None:
    problems = problems_of(annotated('"*": {caFrom: {secret: {namespace: a, name: b, keys: c}}}'))
    assert [(p.severity, f"{p.path}: {p.message}") for p in problems] == [
        ("warning", f"{ROOT}[*].caFrom.secret.keys: unknown field; known fields: key, name, namespace"),
    ]


def test_check_shows_the_reference_and_names_file_object_and_field(tmp_path: Path) -> None:
    """`check` prints the reference in force; an invalid one is one line naming file, object and field."""
    policy = '"*": {caFrom: {secret: {namespace: cert-manager, name: cert-manager-webhook-ca}}}'
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(annotated(policy)))
    run = run_cli("check", "--warnings-as-errors", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert (
        "mutating webhook 'a.b.c' (team-a): mode=Enforce caFrom=secret cert-manager/cert-manager-webhook-ca[ca.crt]"
        in run.stdout
    )
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(annotated('"*": {caFrom: {configMap: {name: x}}}')))
    run = run_cli("check", str(tmp_path))
    assert run.returncode == 1
    assert run.stderr.splitlines()[0] == (
        f'error: {tmp_path / "a.yaml"}: MutatingWebhookConfiguration "team-a" {ROOT}[*].caFrom.configMap.namespace: '
        "Required value"
    )


# --- what is watched, and the RBAC for exactly that --------------------------------------------------------


def test_watch_plan_names_each_referenced_object_once_and_rbac_allows_exactly_those(tmp_path: Path) -> None:
    """The pure model `registration` generates RBAC from: every referenced object once, per namespace."""
    docs = [
        annotated('"*": {caFrom: {secret: {namespace: cert-manager, name: cert-manager-webhook-ca}}}',
                  hook("a.b.c", clientConfig=SERVICE), hook("d.e.f", clientConfig=SERVICE), name="cm"),
        annotated('"*": {caFrom: {configMap: {namespace: istio-system, name: istio-ca-root-cert, key: root-cert.pem}}}',
                  name="istio"),
        annotated('"*": {caFrom: {mutatingWebhookConfiguration: {name: istio-sidecar-injector}}}',
                  hook("x.sidecar-injector.istio.io", clientConfig=SERVICE),
                  hook("y.sidecar-injector.istio.io", clientConfig=SERVICE), name="injector"),
        annotated('"*": {caFrom: {secret: {namespace: cert-manager, name: other-ca, key: tls.crt}}}', name="other"),
        annotated('"*": {caFrom: {file: /etc/ca/team.pem}}', kind=VALIDATING, name="file"),
    ]  # fmt: skip
    plan = watch_plan(load(*docs))
    assert plan.objects == (
        WatchedObject("", "v1", "configmaps", "ConfigMap", "istio-system", "istio-ca-root-cert"),
        WatchedObject("", "v1", "secrets", "Secret", "cert-manager", "cert-manager-webhook-ca"),
        WatchedObject("", "v1", "secrets", "Secret", "cert-manager", "other-ca"),
        WatchedObject("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations",
                      "MutatingWebhookConfiguration", "", "istio-sidecar-injector"),
    )  # fmt: skip
    assert plan.files == ("/etc/ca/team.pem",)
    verbs = ["get", "list", "watch"]
    assert rbac_rules(plan) == {
        "": [{"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
              "resourceNames": ["istio-sidecar-injector"], "verbs": verbs}],
        "cert-manager": [{"apiGroups": [""], "resources": ["secrets"],
                          "resourceNames": ["cert-manager-webhook-ca", "other-ca"], "verbs": verbs}],
        "istio-system": [{"apiGroups": [""], "resources": ["configmaps"],
                          "resourceNames": ["istio-ca-root-cert"], "verbs": verbs}],
    }  # fmt: skip
    documents = rbac_documents(plan)
    assert [(d["kind"], d["metadata"].get("namespace", "")) for d in documents] == [
        ("ClusterRole", ""), ("ClusterRoleBinding", ""),
        ("Role", "cert-manager"), ("RoleBinding", "cert-manager"),
        ("Role", "istio-system"), ("RoleBinding", "istio-system"),
    ]  # fmt: skip
    for doc in documents:  # each is a valid Kubernetes object
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_without_references_nothing_is_watched() -> None:
    plan = watch_plan(load(config(hook("a.b.c"))))
    assert (plan.objects, plan.files, rbac_documents(plan)) == ((), (), [])


# --- check: ca-missing --------------------------------------------------------------------------------------


def test_check_warns_for_istios_injector_without_a_ca() -> None:
    """Issue 34: `check --warnings-as-errors` on Istio's sidecar injector said OK, 0 warnings, while every
    call to it would fail TLS. Each service backend without caBundle or caFrom now earns `ca-missing`."""
    run = run_cli("check", "--warnings-as-errors", str(THIRD_PARTY / "istio.yaml"))
    assert run.returncode == 1
    warnings = [line for line in run.stderr.splitlines() if line.startswith("warning:")]
    assert warnings, run.stderr
    assert all(line.endswith("[ca-missing]") for line in warnings), warnings
    assert (
        'MutatingWebhookConfiguration "istio-sidecar-injector" webhooks[0].clientConfig: a service backend with '
        "neither caBundle nor a caFrom reference" in run.stderr
    )


def test_the_hint_names_cert_managers_secret() -> None:
    """For a configuration cert-manager injects from a Secret, the hint is that Secret."""
    (problem,) = problems_of(yaml.safe_load((THIRD_PARTY / "cert-manager.yaml").read_text().split("---")[1]))
    assert problem.code == "ca-missing"
    assert problem.message.endswith(
        '"*": {caFrom: {secret: {namespace: cert-manager, name: cert-manager-webhook-ca, key: ca.crt}}}'
    )


MISSING = [
    pytest.param({"clientConfig": SERVICE}, None, ["ca-missing"], id="a service backend without caBundle warns"),
    pytest.param({"clientConfig": SERVICE}, '"*": {caFrom: {file: /ca.pem}}', [],
                 id="a service backend with caFrom does not"),
    pytest.param({"clientConfig": {"url": "https://policy.example.com/v"}}, None, [],
                 id="an https URL without caBundle uses the system roots, as upstream: no warning"),
]  # fmt: skip


@pytest.mark.parametrize(("hook_fields", "policy", "codes"), MISSING)
def test_missing_ca(hook_fields: dict[str, Any], policy: str | None, codes: list[str]) -> None:
    doc = config(hook("a.b.c", **hook_fields))
    if policy:
        doc["metadata"]["annotations"] = {ANNOTATION: policy}
    assert [p.code for p in problems_of(doc)] == codes


# --- check: ca-expiry ---------------------------------------------------------------------------------------

DAY = dt.timedelta(days=1)
EXPIRY = [
    pytest.param(NOW - 400 * DAY, NOW - DAY, "expired on", id="an expired caBundle warns"),
    pytest.param(NOW - 300 * DAY, NOW + 10 * DAY, "expires on", id="a caBundle expiring within 30 days warns"),
    pytest.param(NOW + 2 * DAY, NOW + 400 * DAY, "is not valid before", id="a caBundle not valid yet warns"),
    pytest.param(NOW - DAY, NOW + 31 * DAY, None, id="a caBundle valid for more than 30 days does not"),
]  # fmt: skip


@pytest.mark.parametrize(("not_before", "not_after", "says"), EXPIRY)
def test_ca_bundle_expiry(not_before: dt.datetime, not_after: dt.datetime, says: str | None) -> None:
    bundle = base64.b64encode(ca_pem(not_before=not_before, not_after=not_after)).decode()
    doc = config(hook("a.b.c", clientConfig={**SERVICE, "caBundle": bundle}))
    problems = problems_of(doc)
    if says is None:
        assert problems == []
        return
    (problem,) = problems
    assert (problem.code, problem.path, problem.severity) == (
        "ca-expiry",
        "webhooks[0].clientConfig.caBundle",
        "warning",
    )
    assert f'certificate "CN=backend-ca" {says} ' in problem.message


def test_every_certificate_of_a_bundle_is_judged() -> None:
    """A bundle of two CAs (a rotation in progress, copied by hand) warns for the one that expires."""
    good = ca_pem(not_before=NOW - DAY, not_after=NOW + 400 * DAY, cn="new")
    old = ca_pem(not_before=NOW - 400 * DAY, not_after=NOW + 3 * DAY, cn="old")
    doc = config(hook("a.b.c", clientConfig={**SERVICE, "caBundle": base64.b64encode(good + old).decode()}))
    assert [p.message.split(" expires")[0] for p in problems_of(doc)] == ['certificate "CN=old"']


def test_check_gates_on_an_expiring_bundle_and_accepts_it_when_reviewed(tmp_path: Path) -> None:
    pem = ca_pem(not_before=NOW - 300 * DAY, not_after=NOW + 5 * DAY)
    doc = config(hook("a.b.c", clientConfig={**SERVICE, "caBundle": base64.b64encode(pem).decode()}))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(doc))
    strict = run_cli("check", "--warnings-as-errors", str(tmp_path))
    assert strict.returncode == 1
    assert strict.stderr.splitlines()[0].endswith("[ca-expiry]")
    reviewed = run_cli("check", "--warnings-as-errors", "--ignore-warning", "ca-expiry", str(tmp_path))
    assert reviewed.returncode == 0, reviewed.stderr
    assert "0 warning(s) (1 ignored)" in reviewed.stdout


def test_a_referenced_ca_makes_the_static_bundle_irrelevant() -> None:
    """With caFrom the copied caBundle is not used, so its expiry is not a warning."""
    pem = ca_pem(not_before=NOW - 400 * DAY, not_after=NOW - DAY)
    doc = annotated('"*": {caFrom: {file: /ca.pem}}',
                    hook("a.b.c", clientConfig={**SERVICE, "caBundle": base64.b64encode(pem).decode()}))  # fmt: skip
    assert problems_of(doc) == []


# --- the gateway's own registration is never a backend ---------------------------------------------------------


def _registration(tmp_path: Path, *args: str) -> str:
    backends = tmp_path / "backends"
    backends.mkdir()
    (backends / "a.yaml").write_text(yaml.safe_dump(config(hook("a.b.c"))))
    run = run_cli("registration", "--config", str(backends), *args)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize(
    "args",
    [pytest.param([], id="issue 34: check refuses a directory holding `registration`'s output"),
     pytest.param(["--name", "gw", "--namespace", "gw-system", "--service", "gw"],
                  id="issue 34: also when registration was given another name, namespace and service")],
)  # fmt: skip
def test_check_refuses_the_gateways_own_registration(tmp_path: Path, args: list[str]) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "backend.yaml").write_text(yaml.safe_dump(config(hook("a.b.c"))))
    (config_dir / "webhooks.yaml").write_text(_registration(tmp_path, *args))
    run = run_cli("check", str(config_dir))
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors
    assert all("the gateway would call itself for every review" in line for line in errors)
    assert f"{config_dir / 'webhooks.yaml'}: ValidatingWebhookConfiguration " in errors[0]
    assert run.stderr.splitlines()[-1].endswith("configuration refused")


SELF = [
    pytest.param({"service": {"namespace": "webhook-gateway", "name": "webhook-gateway", "path": "/validate"}},
                 "webhooks[0].clientConfig.service", id="a backend that is the gateway's Service is refused"),
    pytest.param({"url": "https://webhook-gateway.webhook-gateway.svc:443/validate"},
                 "webhooks[0].clientConfig.url", id="a backend URL naming the gateway's Service is refused"),
]  # fmt: skip


@pytest.mark.parametrize(("client_config", "path"), SELF)
def test_a_backend_pointing_at_the_gateway_is_refused(client_config: dict[str, Any], path: str) -> None:
    (error,) = errors_of(config(hook("a.b.c", clientConfig=client_config)))
    assert error.startswith(
        f"{path}: Forbidden: points at the gateway's own Service webhook-gateway/webhook-gateway"
    )


def test_a_backend_in_the_gateways_namespace_is_not_the_gateway(tmp_path: Path) -> None:
    """Only the gateway's Service is the gateway: another service of its namespace is an ordinary backend."""
    doc = config(hook("a.b.c", clientConfig={"service": {"namespace": "webhook-gateway", "name": "other"}}))
    assert errors_of(doc) == []
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(doc))
    assert load_directory(tmp_path).mutating


def test_a_copy_that_kept_the_parking_condition_warns() -> None:
    """A copy taken from a parked original would never run behind the gateway either: `parked`."""
    parked = {"name": "webhook-gateway.io/parked", "expression": "false"}
    doc = config(hook("a.b.c", matchConditions=[{"name": "other", "expression": "true"}, parked]))
    (problem,) = problems_of(doc)
    assert (problem.code, problem.path, problem.severity) == (
        "parked",
        "webhooks[0].matchConditions[1]",
        "warning",
    )
