"""Objects read from a live cluster: the apiserver's update ratchets become warnings (CFG-24)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.load import load_documents
from gateway.errors import ConfigError
from tests.configs.builders import V1, config, errors_of, hook, problems_of

LABEL_VALUE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
    "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
    "regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


@pytest.mark.parametrize(
    ("doc", "warning"),
    [
        pytest.param(
            config(hook(sideEffects="Some")),
            'webhooks[0].sideEffects: Unsupported value: "Some": supported values: "None", "NoneOnDryRun"',
            id="CFG-24: v1 sideEffects Some is a warning",
        ),
        pytest.param(
            config(hook(sideEffects="Unknown")),
            'webhooks[0].sideEffects: Unsupported value: "Unknown": supported values: "None", "NoneOnDryRun"',
            id="CFG-24: v1 sideEffects Unknown is a warning",
        ),
        pytest.param(
            config(hook("a.b.c"), hook("a.b.c")),
            'webhooks[1].name: Duplicate value: "a.b.c"',
            id="CFG-24: duplicate webhook names are a warning",
        ),
        pytest.param(
            config(hook(admissionReviewVersions=["v2"])),
            'webhooks[0].admissionReviewVersions: Invalid value: []string{"v2"}: must include at least one of v1, v1beta1',
            id="CFG-24: no recognised admissionReviewVersions entry is a warning",
        ),
        pytest.param(
            config(
                hook(
                    objectSelector={"matchExpressions": [{"key": "env", "operator": "In", "values": ["a b"]}]}
                )
            ),
            f'webhooks[0].objectSelector.matchExpressions[0].values[0]: Invalid value: "a b": {LABEL_VALUE}',
            id="CFG-24: an invalid matchExpressions value is a warning",
        ),
    ],
)
def test_cfg24_ratchets_are_warnings_for_cluster_objects(doc: dict[str, Any], warning: str) -> None:
    """CFG-24: under lax loading each ratcheted rule is a warning; file sources refuse the same object."""
    assert errors_of(doc) == [warning]
    problems = problems_of(doc, lax=True)
    assert [(f"{p.path}: {p.message}", p.severity) for p in problems] == [(warning, "warning")]


def test_cfg24_lax_objects_load_as_written() -> None:
    """CFG-24: the ratcheted values reach the model unchanged (identities tell duplicates apart)."""
    doc = config(hook("a.b.c", sideEffects="Some"), hook("a.b.c", admissionReviewVersions=["v2", "v3"]))
    snapshot = load_documents([("cluster", doc)], lax=True)
    assert [(h.identity, h.side_effects, h.admission_review_versions) for h in snapshot.mutating] == [
        ("team-a/a.b.c/0", "Some", ("v1",)),
        ("team-a/a.b.c/1", "None", ("v2", "v3")),
    ]


def test_cfg24_invalid_selector_value_errors_when_consulted() -> None:
    """CFG-24/MAT-23: a laxly accepted selector carries upstream's construction error instead of requirements."""
    selector = {
        "matchLabels": {"team": "a"},
        "matchExpressions": [
            {"key": "tier", "operator": "Exists"},
            {"key": "env", "operator": "In", "values": ["prod", "not valid", "-x"]},
        ],
    }
    snapshot = load_documents([("cluster", config(hook(namespaceSelector=selector)))], lax=True)
    built = snapshot.mutating[0].namespace_selector
    assert built.error == (
        f'[values[1][env]: Invalid value: "not valid": {LABEL_VALUE}, '
        f'values[2][env]: Invalid value: "-x": {LABEL_VALUE}]'
    )
    assert not built.is_empty


def test_cfg24_single_selector_error_has_no_brackets() -> None:
    """MAT-23: one failing value gives the bare field error text."""
    selector = {"matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["a b"]}]}
    snapshot = load_documents([("cluster", config(hook(objectSelector=selector)))], lax=True)
    assert (
        snapshot.mutating[0].object_selector.error == f'values[0][env]: Invalid value: "a b": {LABEL_VALUE}'
    )


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        pytest.param(
            config(hook(objectSelector={"matchLabels": {"env": "a b"}})),
            f'webhooks[0].objectSelector.matchLabels: Invalid value: "a b": {LABEL_VALUE}',
            id="CFG-24: matchLabels values stay strict",
        ),
        pytest.param(
            config(hook(sideEffects="Bogus")),
            'webhooks[0].sideEffects: Unsupported value: "Bogus": supported values: "None", "NoneOnDryRun"',
            id="CFG-24: a sideEffects value no version allows stays an error",
        ),
        pytest.param(
            config(hook(timeoutSeconds=45)),
            "webhooks[0].timeoutSeconds: Invalid value: 45: the timeout value must be between 1 and 30 seconds",
            id="CFG-24: rules without a ratchet stay errors",
        ),
        pytest.param(
            config(hook(admissionReviewVersions=["v1", "v1"])),
            'webhooks[0].admissionReviewVersions[1]: Invalid value: "v1": duplicate version',
            id="CFG-24: duplicate review versions stay errors",
        ),
    ],
)
def test_cfg24_other_rules_stay_strict(doc: dict[str, Any], error: str) -> None:
    """CFG-24: only the listed ratchets are relaxed."""
    assert errors_of(doc, lax=True) == [error]


def test_cfg24_uncompilable_match_condition_is_kept_with_its_error() -> None:
    """CFG-24: a match condition that does not compile is a warning and carries its error for evaluation."""
    conditions = [{"name": "broken", "expression": "object.metadata.("}]
    doc = config(hook(matchConditions=conditions))
    with pytest.raises(ConfigError) as exc:
        load_documents([("file.yaml", doc)])
    assert [p.path for p in exc.value.errors] == ["webhooks[0].matchConditions[0].expression"]
    snapshot = load_documents([("cluster", doc)], lax=True)
    assert [(w.path, w.severity) for w in snapshot.warnings] == [
        ("webhooks[0].matchConditions[0].expression", "warning")
    ]
    (condition,) = snapshot.mutating[0].match_conditions
    assert (condition.name, condition.expression) == ("broken", "object.metadata.(")
    assert condition.error is not None
    assert snapshot.warnings[0].message == f'Invalid value: "object.metadata.(": {condition.error}'


def test_cfg24_v1_strict_for_files() -> None:
    """CFG-24: file sources get the strict rules: the same cluster-acceptable object is refused."""
    doc = config(hook(sideEffects="Some"), api_version=V1)
    with pytest.raises(ConfigError):
        load_documents([("file.yaml", doc)])
