"""Defaults per apiVersion (CFG-03/04) and the single internal model both versions map to (CFG-05)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import selectors
from gateway.config.model import ClientConfig, Rule, ServiceReference, Webhook
from tests.configs.builders import MUTATING, V1, V1BETA1, VALIDATING, config, errors_of, load

# A webhook with only the fields neither version defaults (v1 additionally needs sideEffects and
# admissionReviewVersions, CFG-04).
MINIMAL: dict[str, Any] = {
    "name": "a.b.c",
    "clientConfig": {"service": {"namespace": "ns", "name": "svc"}},
    "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
}
V1_REQUIRED: dict[str, Any] = {"sideEffects": "None", "admissionReviewVersions": ["v1"]}


def defaulted(api_version: str, kind: str = MUTATING, **fields: Any) -> Webhook:
    """The model of a minimal webhook of ``api_version`` with ``fields`` added."""
    required = V1_REQUIRED if api_version == V1 else {}
    (webhook,) = load(config(MINIMAL | required | fields, kind=kind, api_version=api_version)).webhooks(
        "validating" if kind == VALIDATING else "mutating"
    )
    return webhook


@pytest.mark.parametrize(
    ("attribute", "v1", "v1beta1"),
    [
        pytest.param(
            "failure_policy", "Fail", "Ignore", id="CFG-03: failurePolicy defaults to Fail / Ignore"
        ),
        pytest.param(
            "match_policy", "Equivalent", "Exact", id="CFG-03: matchPolicy defaults to Equivalent / Exact"
        ),
        pytest.param("timeout_seconds", 10, 30, id="CFG-03: timeoutSeconds defaults to 10 / 30"),
        pytest.param(
            "reinvocation_policy", "Never", "Never", id="CFG-03: reinvocationPolicy defaults to Never"
        ),
        pytest.param(
            "namespace_selector",
            selectors.EVERYTHING,
            selectors.EVERYTHING,
            id="CFG-03: namespaceSelector {}",
        ),
        pytest.param(
            "object_selector", selectors.EVERYTHING, selectors.EVERYTHING, id="CFG-03: objectSelector {}"
        ),
        pytest.param("side_effects", "None", "Unknown", id="CFG-03: v1beta1 sideEffects defaults to Unknown"),
        pytest.param(
            "admission_review_versions",
            ("v1",),
            ("v1beta1",),
            id="CFG-03: v1beta1 admissionReviewVersions defaults to [v1beta1]",
        ),
    ],
)
def test_cfg03_defaults_per_version(attribute: str, v1: object, v1beta1: object) -> None:
    """CFG-03: table 1.2, applied per the document's own apiVersion (v1 rows set CFG-04's required fields)."""
    assert getattr(defaulted(V1), attribute) == v1
    assert getattr(defaulted(V1BETA1), attribute) == v1beta1


@pytest.mark.parametrize("api_version", [V1, V1BETA1])
def test_cfg03_rule_scope_and_service_port(api_version: str) -> None:
    """CFG-03: rules[].scope defaults to "*" and clientConfig.service.port to 443 in both versions."""
    webhook = defaulted(api_version)
    assert webhook.rules[0].scope == "*"
    assert webhook.client_config.service == ServiceReference(namespace="ns", name="svc", path=None, port=443)


@pytest.mark.parametrize(
    ("api_version", "fields", "attribute", "expected"),
    [
        pytest.param(
            V1, {"failurePolicy": None}, "failure_policy", "Fail", id="CFG-03: null is defaulted like absent"
        ),
        pytest.param(
            V1, {"timeoutSeconds": None}, "timeout_seconds", 10, id="CFG-03: a null timeout is defaulted"
        ),
        pytest.param(
            V1BETA1,
            {"admissionReviewVersions": []},
            "admission_review_versions",
            ("v1beta1",),
            id="CFG-03: v1beta1 also defaults an empty admissionReviewVersions",
        ),
        pytest.param(
            V1BETA1,
            {"admissionReviewVersions": None},
            "admission_review_versions",
            ("v1beta1",),
            id="CFG-03: v1beta1 defaults a null admissionReviewVersions",
        ),
        pytest.param(
            V1, {"failurePolicy": "Ignore"}, "failure_policy", "Ignore", id="CFG-03: explicit values stay"
        ),
        pytest.param(
            V1BETA1, {"matchPolicy": "Equivalent"}, "match_policy", "Equivalent", id="CFG-03: v1beta1 too"
        ),
        pytest.param(
            V1BETA1, {"timeoutSeconds": 3}, "timeout_seconds", 3, id="CFG-03: an explicit timeout stays"
        ),
        pytest.param(
            V1,
            {"namespaceSelector": None},
            "namespace_selector",
            selectors.EVERYTHING,
            id="CFG-03/MAT-22: a null selector becomes {} (selects everything)",
        ),
    ],
)
def test_cfg03_absent_or_null_only(
    api_version: str, fields: dict[str, Any], attribute: str, expected: object
) -> None:
    """CFG-03: a field is defaulted only when absent or null; explicit values are never replaced."""
    assert getattr(defaulted(api_version, **fields), attribute) == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(
            {"timeoutSeconds": 0},
            "webhooks[0].timeoutSeconds: Invalid value: 0: the timeout value must be between 1 and 30 seconds",
            id="CFG-03: timeoutSeconds 0 is kept and fails validation",
        ),
        pytest.param(
            {"clientConfig": {"service": {"namespace": "ns", "name": "svc", "port": 0}}},
            "webhooks[0].clientConfig.service.port: Invalid value: 0: port is not valid: "
            "must be between 1 and 65535, inclusive",
            id="CFG-03: port 0 is kept and fails validation",
        ),
    ],
)
@pytest.mark.parametrize("api_version", [V1, V1BETA1])
def test_cfg03_explicit_zero_is_not_defaulted(
    api_version: str, fields: dict[str, Any], expected: str
) -> None:
    """CFG-03: explicit zero values stay and then fail validation, in both versions."""
    required = V1_REQUIRED if api_version == V1 else {}
    assert errors_of(config(MINIMAL | required | fields, api_version=api_version)) == [expected]


@pytest.mark.parametrize(
    ("missing", "expected"),
    [
        pytest.param(
            "sideEffects",
            "webhooks[0].sideEffects: Required value: must specify one of None, NoneOnDryRun",
            id="CFG-04: v1 has no sideEffects default",
        ),
        pytest.param(
            "admissionReviewVersions",
            "webhooks[0].admissionReviewVersions: Required value: must specify one of v1, v1beta1",
            id="CFG-04: v1 has no admissionReviewVersions default",
        ),
    ],
)
def test_cfg04_v1_required_fields(missing: str, expected: str) -> None:
    """CFG-04: in v1, leaving out sideEffects or admissionReviewVersions is a validation error."""
    fields = {k: v for k, v in V1_REQUIRED.items() if k != missing}
    assert errors_of(config(MINIMAL | fields, api_version=V1)) == [expected]


def test_cfg04_v1beta1_needs_neither() -> None:
    """CFG-04: the same minimal webhook loads as v1beta1, where both fields have defaults."""
    assert errors_of(config(MINIMAL, api_version=V1BETA1)) == []


EXPLICIT: dict[str, Any] = {
    "name": "full.example.com",
    "clientConfig": {"url": "https://backend.example.com/mutate"},
    "rules": [
        {
            "operations": ["CREATE", "UPDATE"],
            "apiGroups": ["apps"],
            "apiVersions": ["v1"],
            "resources": ["deployments", "deployments/scale"],
            "scope": "Namespaced",
        }
    ],
    "failurePolicy": "Ignore",
    "matchPolicy": "Exact",
    "namespaceSelector": {"matchLabels": {"env": "prod"}},
    "objectSelector": {"matchExpressions": [{"key": "skip", "operator": "DoesNotExist"}]},
    "sideEffects": "NoneOnDryRun",
    "timeoutSeconds": 7,
    "admissionReviewVersions": ["v1", "v1beta1"],
    "reinvocationPolicy": "IfNeeded",
}


def test_cfg05_both_versions_map_to_one_model() -> None:
    """CFG-05: with every field explicit, a v1 and a v1beta1 document give the same Webhook."""
    from_v1 = load(config(EXPLICIT, api_version=V1)).mutating[0]
    from_v1beta1 = load(config(EXPLICIT, api_version=V1BETA1)).mutating[0]
    assert from_v1 == from_v1beta1
    assert from_v1 == Webhook(
        name="full.example.com",
        configuration="team-a",
        kind="mutating",
        identity="team-a/full.example.com/0",
        index=0,
        client_config=ClientConfig(url="https://backend.example.com/mutate"),
        rules=(
            Rule(
                operations=("CREATE", "UPDATE"),
                api_groups=("apps",),
                api_versions=("v1",),
                resources=("deployments", "deployments/scale"),
                scope="Namespaced",
            ),
        ),
        failure_policy="Ignore",
        match_policy="Exact",
        namespace_selector=selectors.LabelSelector(
            (selectors.Requirement("env", "In", frozenset({"prod"})),)
        ),
        object_selector=selectors.LabelSelector((selectors.Requirement("skip", "DoesNotExist"),)),
        side_effects="NoneOnDryRun",
        timeout_seconds=7,
        admission_review_versions=("v1", "v1beta1"),
        reinvocation_policy="IfNeeded",
        source="t.yaml",
    )


def test_cfg05_validating_webhooks_never_reinvoke() -> None:
    """CFG-05: validating webhooks carry reinvocation policy Never in the model."""
    assert defaulted(V1, kind=VALIDATING).reinvocation_policy == "Never"


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        pytest.param(
            {"matchLabels": {"env": "prod"}}, {"env": "prod"}, True, id="CFG-05: matchLabels is In one value"
        ),
        pytest.param(
            {"matchLabels": {"env": "prod"}}, {"env": "dev"}, False, id="CFG-05: matchLabels other value"
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["dev"]}]},
            {},
            True,
            id="CFG-05: NotIn is compiled as NotIn",
        ),
        pytest.param(
            {"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"}]},
            {"a": "1"},
            False,
            id="CFG-05: requirements are ANDed",
        ),
    ],
)
def test_cfg05_selectors_are_compiled(
    selector: dict[str, Any], labels: dict[str, str], matches: bool
) -> None:
    """CFG-05: selectors are compiled once at load into gateway.config.selectors."""
    assert defaulted(V1, objectSelector=selector).object_selector.matches(labels) is matches
