"""The gateway's own registration, computed from its configuration (GW-05, GW-07..10).

The computed registration must deliver exactly the reviews some backend's rules match (MAT-03..08),
minus the infrastructure the gateway must never stand in front of. The apiserver's matching of the
gateway's registration is the same algorithm as the gateway's own rule matching, so the tests judge
"delivered" with the gateway's real matcher (``gateway.matching.rules``) on the printed rules, and
"needed" with the same matcher on the backends' rules.
"""

from __future__ import annotations

import base64
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import trustme
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gateway.admission import AdmissionAttributes, GroupVersionKind, GroupVersionResource
from gateway.config import defaults, schema, types
from gateway.config.load import load_directory
from gateway.config.model import Rule
from gateway.config.validation import validate_configuration
from gateway.errors import ConfigError
from gateway.matching.rules import CompiledRule, is_cluster_scoped
from gateway.registration import DEFAULT_EXCLUDED_RESOURCES, Settings, compare, compute
from tests.support.gateway import hook, write_config

REPO = Path(__file__).resolve().parent.parent
K8S_VERSIONS = ["1.29", "1.37"]
EXCLUDED = {(e.group, e.resource) for e in DEFAULT_EXCLUDED_RESOURCES}
URL = "https://backend.example.com/hook"

Doc = dict[str, Any]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        cwd=REPO,
        env=dict(os.environ),
    )


def rule(
    ops: list[str], groups: list[str], versions: list[str], resources: list[str], scope: str = "*"
) -> Doc:
    return {
        "operations": ops,
        "apiGroups": groups,
        "apiVersions": versions,
        "resources": resources,
        "scope": scope,
    }


def attrs(op: str, group: str, version: str, resource: str, sub: str, namespace: str) -> AdmissionAttributes:
    return AdmissionAttributes(
        uid="u",
        operation=op,
        kind=GroupVersionKind(group=group, version=version, kind="Thing"),
        resource=GroupVersionResource(group=group, version=version, resource=resource),
        sub_resource=sub,
        namespace=namespace,
    )


def model_rules(webhook: Doc) -> list[Rule]:
    return [
        Rule(
            operations=tuple(r["operations"]),
            api_groups=tuple(r["apiGroups"]),
            api_versions=tuple(r["apiVersions"]),
            resources=tuple(r["resources"]),
            scope=r.get("scope", "*"),
        )
        for r in webhook["rules"]
    ]


def _matches(rules: list[CompiledRule], a: AdmissionAttributes) -> bool:
    cluster = is_cluster_scoped(a.resource, a.namespace)
    return any(r.matches(a.operation, a.resource, a.sub_resource, cluster) for r in rules)


def delivered(registration: Doc, a: AdmissionAttributes) -> bool:
    """Would the apiserver send this review to the gateway (rules, then the exclusion conditions)?"""
    for webhook in registration["webhooks"]:
        if not _matches([CompiledRule(r) for r in model_rules(webhook)], a):
            continue
        conditions = [c["expression"] for c in webhook.get("matchConditions", [])]
        shape = f'"{a.resource.group}" && request.resource.resource == "{a.resource.resource}"'
        if any(shape in c for c in conditions):  # each condition excludes one (group, resource)
            continue
        return True
    return False


def needed(backends: list[Doc], a: AdmissionAttributes) -> bool:
    rules = [CompiledRule(r) for b in backends for r in model_rules(b)]
    return (a.resource.group, a.resource.resource) not in EXCLUDED and _matches(rules, a)


def agree(registration: Doc, backends: list[Doc]) -> list[tuple[Any, ...]]:
    """Request shapes where delivery by the registration and need by the backends differ."""
    have = [CompiledRule(r) for w in registration["webhooks"] for r in model_rules(w)]
    want = [CompiledRule(r) for b in backends for r in model_rules(b)]
    conditions = [c["expression"] for w in registration["webhooks"] for c in w.get("matchConditions", [])]
    wrong = []
    for a in probes(backends):
        shape = f'"{a.resource.group}" && request.resource.resource == "{a.resource.resource}"'
        got = _matches(have, a) and not any(shape in c for c in conditions)
        if got != ((a.resource.group, a.resource.resource) not in EXCLUDED and _matches(want, a)):
            wrong.append((a.operation, a.resource, a.sub_resource, a.namespace))
    return wrong


def probes(backends: list[Doc]) -> list[AdmissionAttributes]:
    groups = {"", "apps", "unlisted.example.com"} | {g for _, g in EXCLUDED}
    versions = {"v1", "v2", "v9"}
    resources = {"pods", "deployments", "unlisted"} | {r for r, _ in EXCLUDED}
    subs = {"", "status", "exec", "other"}
    for b in backends:
        for r in b["rules"]:
            groups |= set(r["apiGroups"]) - {"*"}
            versions |= set(r["apiVersions"]) - {"*"}
            for entry in r["resources"]:
                res, _, sub = entry.partition("/")
                resources |= {res} - {"*"}
                subs |= {sub} - {"*"}
    return [
        attrs(op, g, v, r, s, ns)
        for op, g, v, r, s, ns in itertools.product(
            ["CREATE", "UPDATE", "DELETE", "CONNECT"],
            sorted(groups),
            sorted(versions),
            sorted(resources),
            sorted(subs),
            ["", "shop"],
        )
    ]


def computed(
    tmp_path: Path, validating: list[Doc] | None = None, mutating: list[Doc] | None = None, **kw: Any
) -> tuple[Doc, Doc]:
    write_config(
        tmp_path,
        validating={"v": validating} if validating else None,
        mutating={"m": mutating} if mutating else None,
    )
    registration = compute(load_directory(tmp_path), Settings(**kw))
    return registration.validating, registration.mutating


# --- exactly the reviews some backend needs ---------------------------------------------------------

UNIONS = [
    pytest.param(
        [rule(["CREATE", "UPDATE"], [""], ["v1"], ["pods"])],
        id="MAT-03: one backend on pods: registered for CREATE/UPDATE of v1 pods only",
    ),
    pytest.param(
        [
            rule(["CREATE"], [""], ["v1"], ["pods"]),
            rule(["UPDATE"], ["apps"], ["v1"], ["deployments/scale"], "Namespaced"),
        ],
        id="MAT-03/06/08: the union of two backends' rules, scope and subresources kept",
    ),
    pytest.param(
        [rule(["*"], ["*"], ["*"], ["*/*"])],
        id="MAT-07: a full wildcard backend is delivered everything but the excluded infrastructure",
    ),
    pytest.param(
        [rule(["*"], [""], ["*"], ["*"]), rule(["CONNECT"], [""], ["v1"], ["pods/exec"])],
        id="MAT-06: core wildcard without subresources, plus pods/exec CONNECT",
    ),
    pytest.param(
        [rule(["CREATE"], ["", "coordination.k8s.io"], ["v1"], ["leases", "pods"])],
        id="an entry naming an excluded resource in some group only is kept, the exclusion removes the rest",
    ),
    pytest.param(
        [rule(["UPDATE"], [""], ["v1"], ["nodes/status", "pods/*"], "Cluster")],
        id="MAT-08: cluster scope kept; nodes/status dropped from the rule",
    ),
]


@pytest.mark.parametrize("rules", UNIONS)
@pytest.mark.parametrize("kind", ["validating", "mutating"])
def test_registration_delivers_exactly_what_backends_need(
    tmp_path: Path, rules: list[Doc], kind: str
) -> None:
    """Every probed request shape reaches the gateway iff some backend's rules match and it is not excluded."""
    backends = [hook(f"b{i}.example.com", URL, rules=[r]) for i, r in enumerate(rules)]
    validating, mutating = computed(tmp_path, **{kind: backends})
    registration = validating if kind == "validating" else mutating
    other = mutating if kind == "validating" else validating
    assert other["webhooks"] == [], "no backend of the other kind: the gateway is not registered for it"
    assert agree(registration, backends) == []


def _wild_or(values: list[str]) -> st.SearchStrategy[list[str]]:
    """A wildcard alone, or specific values (CFG-18/19 refuse a wildcard listed with others)."""
    return st.one_of(st.just(["*"]), st.lists(st.sampled_from(values), min_size=1, max_size=2, unique=True))


RULE_VALUES = st.fixed_dictionaries(
    {
        "operations": _wild_or(["CREATE", "UPDATE", "DELETE", "CONNECT"]),
        "apiGroups": _wild_or(["", "apps", "coordination.k8s.io", "events.k8s.io"]),
        "apiVersions": _wild_or(["v1", "v2"]),
        "resources": st.one_of(
            st.just(["*/*"]),
            st.lists(
                st.sampled_from(
                    ["pods", "pods/*", "pods/exec", "nodes", "nodes/status", "leases", "*/status", "events"]
                ),
                min_size=1,
                max_size=3,
                unique=True,
            ),
            st.just(["*", "*/status"]),
        ),
        "scope": st.sampled_from(["*", "Cluster", "Namespaced"]),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rules=st.lists(RULE_VALUES, min_size=1, max_size=3))
def test_registration_union_property(tmp_path: Path, rules: list[Doc]) -> None:
    """MAT-03..08: for arbitrary backend rules, the merged and pruned registration delivers exactly the union."""
    backends = [hook(f"b{i}.example.com", URL, rules=[r]) for i, r in enumerate(rules)]
    try:
        validating, _ = computed(tmp_path, validating=backends)
    except ConfigError:
        assume(False)  # rules the apiserver would refuse (CFG-18/19)
    assert agree(validating, backends)[:5] == []
    # and the apiserver would accept the merged rules (the gateway validates like it does; loading it
    # as a backend configuration is refused, as the gateway's own registration)
    decoded = schema.decode(validating, types.ValidatingWebhookConfiguration)
    assert decoded.errors == []
    assert validate_configuration(defaults.default_configuration(decoded.value)).errors == []


# --- fields --------------------------------------------------------------------------------------


def test_fixed_fields(tmp_path: Path) -> None:
    """GW-07..10: NoneOnDryRun, Exact, Never, both review versions, three-segment names, own namespace excluded."""
    backend = [hook("a.example.com", URL, rules=[rule(["CREATE"], [""], ["v1"], ["pods"])])]
    validating, mutating = computed(tmp_path, validating=backend, mutating=backend, namespace="gw-system")
    for doc in (validating, mutating):
        (w,) = doc["webhooks"]
        assert (w["sideEffects"], w["matchPolicy"], w["failurePolicy"]) == ("NoneOnDryRun", "Exact", "Fail")
        assert w["admissionReviewVersions"] == ["v1", "v1beta1"]
        assert len(w["name"].split(".")) == 3
        assert w["namespaceSelector"]["matchExpressions"] == [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": ["gw-system", "kube-system", "kube-node-lease"],
            }
        ]
        assert w["clientConfig"]["service"]["namespace"] == "gw-system"
        assert "matchConditions" not in w, "pods alone needs no exclusion condition"
    assert mutating["webhooks"][0]["reinvocationPolicy"] == "Never"
    assert "reinvocationPolicy" not in validating["webhooks"][0]
    assert validating["webhooks"][0]["clientConfig"]["service"]["path"] == "/validate/fail"
    assert mutating["webhooks"][0]["clientConfig"]["service"]["path"] == "/mutate"


TIMEOUTS = [
    pytest.param(
        [5, 3],
        [],
        6,
        None,
        id="GW-05: validating backends run in parallel: the longest timeout plus the margin",
    ),
    pytest.param([], [5, 3], None, 9, id="GW-05: mutating backends run in turn: the sum plus the margin"),
    pytest.param(
        [],
        [5, (3, "IfNeeded")],
        None,
        12,
        id="GW-05/MUT-15: an IfNeeded backend may run twice and counts twice",
    ),
    pytest.param([30], [20, 20], 30, 30, id="GW-05: never more than the 30 s the apiserver allows"),
]


@pytest.mark.parametrize(("vt", "mt", "want_v", "want_m"), TIMEOUTS)
def test_timeout_from_backend_budgets(
    tmp_path: Path, vt: list[Any], mt: list[Any], want_v: int | None, want_m: int | None
) -> None:
    def backends(ts: list[Any], mutating: bool) -> list[Doc]:
        out = []
        for i, t in enumerate(ts):
            seconds, policy = t if isinstance(t, tuple) else (t, "Never")
            extra = {"reinvocationPolicy": policy} if mutating else {}
            out.append(hook(f"b{i}.example.com", URL, timeoutSeconds=seconds, **extra))
        return out

    validating, mutating = computed(tmp_path, validating=backends(vt, False), mutating=backends(mt, True))
    got_v = validating["webhooks"][0]["timeoutSeconds"] if validating["webhooks"] else None
    got_m = mutating["webhooks"][0]["timeoutSeconds"] if mutating["webhooks"] else None
    assert (got_v, got_m) == (want_v, want_m)


EXCLUSIONS = [
    pytest.param(
        {},
        {"nodes", "leases", "events", "tokenreviews", "subjectaccessreviews", "certificatesigningrequests"},
        {"webhook-gateway", "kube-system", "kube-node-lease"},
        id="by default: infrastructure resources and namespaces are excluded",
    ),
    pytest.param(
        {"excluded_resources": tuple(e for e in DEFAULT_EXCLUDED_RESOURCES if e.resource != "events")},
        {"nodes", "leases"},
        {"webhook-gateway", "kube-system", "kube-node-lease"},
        id="overridable: events delivered when the operator drops that exclusion",
    ),
    pytest.param(
        {"excluded_namespaces": ("webhook-gateway",)},
        {"nodes"},
        {"webhook-gateway"},
        id="overridable: kube-system delivered when the operator drops that exclusion",
    ),
    pytest.param(
        {"excluded_namespaces": (), "excluded_resources": ()},
        set(),
        None,
        id="overridable: no exclusions at all",
    ),
]


@pytest.mark.parametrize(("kw", "excluded_subset", "namespaces"), EXCLUSIONS)
def test_exclusions(
    tmp_path: Path, kw: dict[str, Any], excluded_subset: set[str], namespaces: set[str] | None
) -> None:
    """A full wildcard backend: exclusions become matchConditions and a namespaceSelector, each overridable."""
    validating, _ = computed(tmp_path, validating=[hook("a.example.com", URL)], **kw)
    (w,) = validating["webhooks"]
    named = {c["name"].removeprefix("exclude-").partition(".")[0] for c in w.get("matchConditions", [])}
    assert excluded_subset <= named
    if "excluded_resources" in kw:
        assert named == {e.resource for e in kw["excluded_resources"]}
    ns = {v for e in w["namespaceSelector"].get("matchExpressions", []) for v in e["values"]}
    assert ns == (namespaces or set())


def test_backend_only_on_excluded_resources_is_not_registered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A backend asking only for Nodes and Leases: no registration at all, and a note says so."""
    backend = [
        hook(
            "nodes.example.com",
            URL,
            rules=[
                rule(["*"], [""], ["v1"], ["nodes", "nodes/*"]),
                rule(["*"], ["coordination.k8s.io"], ["*"], ["leases"]),
            ],
        )
    ]
    write_config(tmp_path, validating={"v": backend})
    registration = compute(load_directory(tmp_path))
    assert registration.validating["webhooks"] == []
    assert any("nodes.example.com" in n and "never see" in n for n in registration.notes)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_output_validates_against_kubernetes_schemas(tmp_path: Path, version: str) -> None:
    """The printed objects (with caBundle and exclusion conditions) pass the API's schemas, strictly."""
    ca = trustme.CA()
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    write_config(
        tmp_path / "cfg",
        validating={"v": [hook("a.example.com", URL)]},
        mutating={"m": [hook("b.example.com", URL)]},
    )
    result = run_cli(
        "registration", "--config", str(tmp_path / "cfg"), "--ca-bundle", str(tmp_path / "ca.pem")
    )
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert [d["kind"] for d in docs] == ["ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
        assert base64.b64decode(doc["webhooks"][0]["clientConfig"]["caBundle"]) == ca.cert_pem.bytes()
    assert "kube-node-lease: node heartbeats" in result.stdout, "each exclusion is documented with its reason"


CLI_ERRORS = [
    pytest.param(
        ["--exclude-resources", "pods/exec"],
        "--exclude-resources/--include-resources: 'pods/exec': expected RESOURCE or RESOURCE.GROUP",
        id="a bad resource name is one clear line",
    ),
    pytest.param(
        ["--ca-bundle", "/nonexistent/ca.pem"],
        "--ca-bundle /nonexistent/ca.pem: No such file or directory",
        id="a missing CA file is one clear line",
    ),
    pytest.param(
        ["--url", "http://127.0.0.1:8443"],
        "--url: Invalid value: \"http\": 'https' is the only allowed URL scheme",
        id="--url: the apiserver calls webhooks over https only (CFG-14)",
    ),
    pytest.param(
        ["--url", "https://gw:secret@127.0.0.1:8443"],
        '--url: Invalid value: "gw:xxxxx": user information is not permitted in the URL',
        id="--url: no user information, and the password is never echoed (CFG-14)",
    ),
]


@pytest.mark.parametrize(("args", "message"), CLI_ERRORS)
def test_cli_errors(tmp_path: Path, args: list[str], message: str) -> None:
    write_config(tmp_path, validating={"v": [hook("a.example.com", URL)]})
    result = run_cli("registration", "--config", str(tmp_path), *args)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"webhook-gateway: error: {message}") and result.stderr.count("\n") == 1


def test_url_registers_client_config_url_instead_of_the_service(tmp_path: Path) -> None:
    """--url: both webhooks call HOST:PORT plus their endpoint path; no service reference is left."""
    write_config(
        tmp_path, validating={"v": [hook("a.example.com", URL)]}, mutating={"m": [hook("b.example.com", URL)]}
    )
    result = run_cli("registration", "--config", str(tmp_path), "--url", "https://127.0.0.1:8443/")
    assert result.returncode == 0, result.stderr
    configs = [d["webhooks"][0]["clientConfig"] for d in yaml.safe_load_all(result.stdout) if d]
    assert configs == [
        {"url": "https://127.0.0.1:8443/validate/fail"},
        {"url": "https://127.0.0.1:8443/mutate"},
    ]


def test_cli_refuses_a_bad_configuration(tmp_path: Path) -> None:
    """CFG-23: nothing printed on stdout for a configuration the gateway would refuse."""
    write_config(tmp_path, validating={"v": [hook("bad", URL)]})
    result = run_cli("registration", "--config", str(tmp_path))
    assert (result.returncode, result.stdout) == (2, "")
    assert "webhooks[0].name" in result.stderr and "no registration printed" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_overrides(tmp_path: Path) -> None:
    """--include-resources/--include-namespaces/--exclude-namespaces reach the printed registration."""
    write_config(tmp_path, validating={"v": [hook("a.example.com", URL)]})
    result = run_cli(
        "registration",
        "--config",
        str(tmp_path),
        "--include-resources",
        "events,events.events.k8s.io",
        "--include-namespaces",
        "kube-system",
        "--exclude-namespaces",
        "legacy",
        "--namespace",
        "gw",
        "--output",
        "json",
    )
    assert result.returncode == 0, result.stderr
    (w,) = yaml.safe_load(result.stdout)["items"][0]["webhooks"]
    assert w["namespaceSelector"]["matchExpressions"][0]["values"] == ["gw", "kube-node-lease", "legacy"]
    names = {c["name"] for c in w["matchConditions"]}
    assert "exclude-nodes" in names and not {"exclude-events", "exclude-events.events.k8s.io"} & names


# --- check --registration ----------------------------------------------------------------------------


def _write(path: Path, docs: list[Doc]) -> str:
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def test_compare_finds_nothing_for_the_computed_registration(tmp_path: Path) -> None:
    validating, mutating = computed(
        tmp_path,
        validating=[hook("a.example.com", URL), hook("i.example.com", URL, failurePolicy="Ignore")],
        mutating=[hook("b.example.com", URL, rules=[rule(["CREATE"], [""], ["v1"], ["pods"])])],
    )
    assert compare([validating, mutating], load_directory(tmp_path)) == []


CHECK_REGISTRATIONS = [
    pytest.param(
        lambda: list(
            yaml.safe_load_all((REPO / "tests" / "configs" / "wildcard-registration.yaml").read_text())
        ),
        [
            "ValidatingWebhookConfiguration: broader than the configuration needs",
            "MutatingWebhookConfiguration: broader than the configuration needs",
        ],
        id="GW-08: the old register-everything registration is broader than a pods-only config needs",
    ),
    pytest.param(
        lambda: [
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": "webhook-gateway"},
                "webhooks": [
                    {
                        "name": "validate.webhook-gateway.io",
                        "clientConfig": {
                            "service": {
                                "namespace": "webhook-gateway",
                                "name": "webhook-gateway",
                                "path": "/validate",
                            }
                        },
                        "rules": [rule(["CREATE"], [""], ["v1"], ["pods"])],
                        "matchPolicy": "Exact",
                        "namespaceSelector": {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/metadata.name",
                                    "operator": "NotIn",
                                    "values": ["webhook-gateway", "kube-system", "kube-node-lease", "shop"],
                                }
                            ]
                        },
                        "sideEffects": "Some",
                        "timeoutSeconds": 1,
                        "admissionReviewVersions": ["v1"],
                    }
                ],
            }
        ],
        [
            "stricter than the configuration needs: the validating backends with failurePolicy Fail never "
            "see reviews their rules match, e.g. UPDATE pods (v1)",
            "stricter: webhook validate.webhook-gateway.io excludes namespaces shop",
            "stricter: webhook validate.webhook-gateway.io has timeoutSeconds 1, less than the 6s",
            "sideEffects 'Some'",
            "MutatingWebhookConfiguration: missing, but some backend needs it (stricter)",
            "hint: regenerate it: webhook-gateway registration --config",
        ],
        id="GW-05/09: a hand-narrowed registration misses UPDATE, a namespace and time, and blocks dry runs",
    ),
]


@pytest.mark.parametrize(("registration", "findings"), CHECK_REGISTRATIONS)
def test_check_warns_about_a_registration_file(
    tmp_path: Path, registration: Any, findings: list[str]
) -> None:
    """`check --registration FILE` warns where FILE is broader or stricter; --warnings-as-errors fails."""
    pods = [rule(["CREATE", "UPDATE"], [""], ["v1"], ["pods"])]
    write_config(
        tmp_path / "cfg",
        validating={"v": [hook("a.example.com", URL, rules=pods)]},
        mutating={"m": [hook("b.example.com", URL, rules=pods)]},
    )
    path = _write(tmp_path / "reg.yaml", registration())
    result = run_cli("check", "--config", str(tmp_path / "cfg"), "--registration", path)
    assert result.returncode == 0, result.stderr
    for finding in findings:
        assert finding in result.stderr
    assert (
        run_cli(
            "check", "--config", str(tmp_path / "cfg"), "--registration", path, "--warnings-as-errors"
        ).returncode
        == 1
    )


def test_check_accepts_the_printed_registration(tmp_path: Path) -> None:
    """What `registration` prints passes `check --registration` without a warning."""
    write_config(
        tmp_path / "cfg",
        validating={"v": [hook("a.example.com", URL)]},
        mutating={
            "m": [
                hook(
                    "b.example.com",
                    URL,
                    matchPolicy="Exact",
                    rules=[rule(["CREATE"], [""], ["v1"], ["pods/*"])],
                )
            ]
        },
    )
    printed = run_cli("registration", "--config", str(tmp_path / "cfg"))
    (tmp_path / "reg.yaml").write_text(printed.stdout)
    result = run_cli(
        "check",
        "--config",
        str(tmp_path / "cfg"),
        "--registration",
        str(tmp_path / "reg.yaml"),
        "--warnings-as-errors",
    )
    assert (result.returncode, "warning" in result.stderr) == (0, False), result.stderr


MERGES = [
    pytest.param(
        [rule(["CREATE"], [""], ["v1"], ["pods"]), rule(["*"], [""], ["v1"], ["pods"])],
        [rule(["*"], [""], ["v1"], ["pods"])],
        id="a rule another covers is dropped",
    ),
    pytest.param(
        [rule(["CREATE"], [""], ["v1"], ["pods"]), rule(["UPDATE"], [""], ["v1"], ["pods"])],
        [rule(["CREATE", "UPDATE"], [""], ["v1"], ["pods"])],
        id="rules differing only in operations merge",
    ),
    pytest.param(
        [
            rule(["CREATE"], [""], ["v1"], ["pods"]),
            rule(["CREATE"], [""], ["v1"], ["configmaps", "pods/status"]),
        ],
        [rule(["CREATE"], [""], ["v1"], ["pods", "configmaps", "pods/status"])],
        id="rules differing only in resources merge",
    ),
    pytest.param(
        [rule(["CREATE"], [""], ["v1"], ["pods", "pods/*"])],
        [rule(["CREATE"], [""], ["v1"], ["pods/*"])],
        id="MAT-07: pods/* covers pods",
    ),
]


@pytest.mark.parametrize(("rules", "want"), MERGES)
def test_rules_are_merged_where_exact(tmp_path: Path, rules: list[Doc], want: list[Doc]) -> None:
    """The printed rules are as few as an exact union allows."""
    backends = [hook(f"b{i}.example.com", URL, rules=[r]) for i, r in enumerate(rules)]
    validating, _ = computed(tmp_path, validating=backends)
    assert validating["webhooks"][0]["rules"] == want


# --- each backend's failure semantics (issue 33 §3) --------------------------------------------------

PODS = [rule(["CREATE"], [""], ["v1"], ["pods"])]
CONFIGMAPS = [rule(["CREATE"], [""], ["v1"], ["configmaps"])]

SPLITS = [
    pytest.param(
        [
            hook("a.example.com", URL, rules=PODS, timeoutSeconds=5),
            hook("b.example.com", URL, rules=CONFIGMAPS, failurePolicy="Ignore", timeoutSeconds=3),
        ],
        [
            ("validate.webhook-gateway.io-fail", "/validate/fail", "Fail", 6, ["pods"]),
            ("validate.webhook-gateway.io-ignore", "/validate/ignore", "Ignore", 4, ["configmaps"]),
        ],
        id="VAL: Fail and Ignore backends are served by two registrations, each with its own path, "
        "failurePolicy, rules and timeout",
    ),
    pytest.param(
        [hook("g.example.com", URL, failurePolicy="Ignore", timeoutSeconds=3)],
        [("validate.webhook-gateway.io-ignore", "/validate/ignore", "Ignore", 4, ["*/*"])],
        id="VAL: wildcard backends that all fail open (Gatekeeper) are registered fail-open only",
    ),
    pytest.param(
        [hook("a.example.com", URL, rules=PODS, timeoutSeconds=2)],
        [("validate.webhook-gateway.io-fail", "/validate/fail", "Fail", 3, ["pods"])],
        id="VAL: fail-closed backends only: one -fail registration",
    ),
]


@pytest.mark.parametrize(("backends", "want"), SPLITS)
def test_validating_backends_split_by_failure_policy(
    tmp_path: Path, backends: list[Doc], want: list[tuple[Any, ...]]
) -> None:
    """A gateway outage fails open exactly where the backends registered directly would."""
    validating, _ = computed(tmp_path, validating=backends)
    got = [
        (
            w["name"],
            w["clientConfig"]["service"]["path"],
            w["failurePolicy"],
            w["timeoutSeconds"],
            [res for r in w["rules"] for res in r["resources"]],
        )
        for w in validating["webhooks"]
    ]
    assert got == want
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(validating, version, strict=True)


MUTATING_POLICIES = [
    pytest.param(
        ["Ignore", "Ignore"], "Ignore", [], id="MUT: a chain of Ignore backends is registered Ignore"
    ),
    pytest.param(
        ["Fail", "Ignore", "Ignore"],
        "Fail",
        ["m1.example.com", "m2.example.com"],
        id="MUT: one Fail backend makes the chain Fail; the note names every Ignore backend made fail-closed",
    ),
    pytest.param(["Fail"], "Fail", [], id="MUT: a chain of Fail backends is registered Fail, no note"),
]


@pytest.mark.parametrize(("policies", "want", "named"), MUTATING_POLICIES)
def test_mutating_registration_fails_closed_only_for_a_fail_backend(
    tmp_path: Path, policies: list[str], want: str, named: list[str]
) -> None:
    backends = [hook(f"m{i}.example.com", URL, failurePolicy=p) for i, p in enumerate(policies)]
    write_config(tmp_path / "cfg", mutating={"m": backends})
    result = run_cli("registration", "--config", str(tmp_path / "cfg"))
    assert result.returncode == 0, result.stderr
    mutating = [d for d in yaml.safe_load_all(result.stdout) if d][1]
    assert [w["failurePolicy"] for w in mutating["webhooks"]] == [want]
    notes = [line for line in result.stderr.splitlines() if "made fail-closed" in line]
    if named:
        (note,) = notes
        assert note.startswith("note: ") and all(f"{n} (m)" in note for n in named)
        assert "m0.example.com (m)" not in note.split("made fail-closed")[1]
    else:
        assert notes == []


def test_forced_failure_policy_is_one_registration_with_a_note(tmp_path: Path) -> None:
    """--failure-policy Fail: one validating registration on /validate, and a note per backend it changes."""
    write_config(
        tmp_path / "cfg",
        validating={"v": [hook("a.example.com", URL), hook("i.example.com", URL, failurePolicy="Ignore")]},
    )
    result = run_cli("registration", "--config", str(tmp_path / "cfg"), "--failure-policy", "Fail")
    assert result.returncode == 0, result.stderr
    (w,) = next(d for d in yaml.safe_load_all(result.stdout) if d)["webhooks"]
    assert (w["clientConfig"]["service"]["path"], w["failurePolicy"]) == ("/validate", "Fail")
    assert "made fail-closed" in result.stderr and "i.example.com (v)" in result.stderr


def _one_webhook(path: str, policy: str) -> Doc:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "webhook-gateway"},
        "webhooks": [
            {
                "name": "validate.webhook-gateway.io",
                "clientConfig": {
                    "service": {"namespace": "webhook-gateway", "name": "webhook-gateway", "path": path}
                },
                "rules": [rule(["*"], ["*"], ["*"], ["*/*"])],
                "matchPolicy": "Exact",
                "failurePolicy": policy,
                "namespaceSelector": {
                    "matchExpressions": [
                        {
                            "key": "kubernetes.io/metadata.name",
                            "operator": "NotIn",
                            "values": ["webhook-gateway", "kube-system", "kube-node-lease"],
                        }
                    ]
                },
                "sideEffects": "NoneOnDryRun",
                "timeoutSeconds": 30,
                "admissionReviewVersions": ["v1"],
            }
        ],
    }


REGISTRATION_POLICIES = [
    pytest.param(
        _one_webhook("/validate", "Fail"),
        "stricter: webhook validate.webhook-gateway.io is failurePolicy Fail, so these backends with "
        "failurePolicy Ignore fail closed while no gateway replica answers: g.example.com (v)",
        id="an old single Fail registration makes Gatekeeper-like Ignore backends fail closed",
    ),
    pytest.param(
        _one_webhook("/validate/ignore", "Fail"),
        "stricter: webhook validate.webhook-gateway.io is failurePolicy Fail, so these backends with "
        "failurePolicy Ignore fail closed",
        id="the -ignore half registered Fail",
    ),
    pytest.param(
        _one_webhook("/validate/fail", "Ignore"),
        "stricter than the configuration needs: the validating backends with failurePolicy Ignore never "
        "see reviews their rules match",
        id="the -ignore half missing: its backends never see their reviews",
    ),
    pytest.param(
        _one_webhook("/validate/ignore", "Ignore")
        | {
            "webhooks": [
                *_one_webhook("/validate/ignore", "Ignore")["webhooks"],
                _one_webhook("/elsewhere", "Ignore")["webhooks"][0] | {"name": "other.webhook-gateway.io"},
            ]
        },
        "webhook other.webhook-gateway.io sends reviews to /elsewhere, which the gateway does not serve "
        "(/validate/fail, /validate/ignore)",
        id="a path the gateway does not serve",
    ),
]


@pytest.mark.parametrize(("written", "finding"), REGISTRATION_POLICIES)
def test_check_warns_where_a_registration_changes_failure_semantics(
    tmp_path: Path, written: Doc, finding: str
) -> None:
    write_config(tmp_path / "cfg", validating={"v": [hook("g.example.com", URL, failurePolicy="Ignore")]})
    path = _write(tmp_path / "reg.yaml", [written])
    result = run_cli("check", "--config", str(tmp_path / "cfg"), "--registration", path)
    assert result.returncode == 0, result.stderr
    assert finding in " ".join(result.stderr.split())


HALF_PATHS = [
    pytest.param(
        "/validate/fail", ["fail-closed.example.com"], id="/validate/fail runs only the Fail backends"
    ),
    pytest.param(
        "/validate/ignore", ["fail-open.example.com"], id="/validate/ignore runs only the Ignore backends"
    ),
    pytest.param(
        "/validate",
        ["fail-closed.example.com", "fail-open.example.com"],
        id="/validate runs every validating backend (a registration made with --failure-policy)",
    ),
]


@pytest.mark.parametrize(("path", "called"), HALF_PATHS)
async def test_each_half_path_runs_only_its_backends(
    nursery: Any, tmp_path: Path, path: str, called: list[str]
) -> None:
    """The gateway serves each registration's path with only that half's backends, over real sockets."""
    import json

    from gateway.devtools.backends import serve_backend
    from tests.support.gateway import gateway_client, review, start_gateway

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    base = f"http://127.0.0.1:{server.port}"
    write_config(
        tmp_path / "cfg",
        validating={
            "v": [
                hook("fail-closed.example.com", f"{base}/deny/403/closed", failurePolicy="Fail"),
                hook("fail-open.example.com", f"{base}/deny/403/open", failurePolicy="Ignore"),
            ]
        },
    )
    running = await start_gateway(nursery, tmp_path / "cfg")
    client = await gateway_client(running)
    got = await client.post(f"{path}?timeout=5s", json.dumps(review()).encode())
    assert got is not None and got.status == 200
    response = got.json["response"]
    assert response["allowed"] is False
    assert called[0] in response["status"]["message"]
    paths = {"/deny/403/closed": "fail-closed.example.com", "/deny/403/open": "fail-open.example.com"}
    assert sorted(paths[c.path.split("?")[0]] for c in server.calls) == called


def test_check_registration_examples_are_real_requests(tmp_path: Path) -> None:
    """Issue 33 §5: check --registration names request shapes that can happen — no placeholder version,
    no namespaced resource called cluster-scoped, no resource in a group that does not serve it, nothing the
    computed registration excludes on purpose — and says how to regenerate the file."""
    empty = REPO / "deploy" / "registration" / "webhooks.yaml"  # registers nothing
    gatekeeper = REPO / "tests" / "configs" / "thirdparty" / "gatekeeper.yaml"
    result = run_cli("check", str(gatekeeper), "--registration", str(empty))
    assert result.returncode == 0, result.stderr
    findings = [line for line in result.stderr.splitlines() if line.endswith("[registration]")]
    assert findings and all("stricter than the configuration needs" in f for f in findings)
    text = "\n".join(findings)
    for impossible in ("v0", "unlisted", "pods (cluster-scoped)", "certificatesigningrequests ", "leases",
                       "nodes", "tokenreviews", "events"):  # fmt: skip
        assert impossible not in text, impossible
    assert "CREATE pods" in text
    assert (
        f"hint: regenerate it: webhook-gateway registration --config {gatekeeper} > {empty}" in result.stderr
    )
