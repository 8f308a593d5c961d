"""The webhook-gateway.io/backend-policy annotation: parsed, merged field by field, validated with
field paths naming the annotation and the key, attached to each webhook, and shown by `check`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.backend_policy import ANNOTATION, DEFAULT_POLICY, BackendPolicy, CircuitBreakerPolicy
from tests.configs.builders import config, errors_of, hook, load, warnings_of

ROOT = f"metadata.annotations[{ANNOTATION}]"


def annotated(policy: str, *names: str, kind: str = "MutatingWebhookConfiguration") -> dict[str, Any]:
    doc = config(*(hook(n) for n in names or ("a.b.c",)), kind=kind)
    doc["metadata"]["annotations"] = {ANNOTATION: policy}
    return doc


POLICIES = [
    pytest.param(
        '"*": {circuitBreaker: {consecutiveFailures: 5, openSeconds: 10}, maxInFlight: 200}\n'
        "new-check.team-a.example.com: {mode: Shadow}",
        {
            "a.b.c": BackendPolicy(circuit_breaker=CircuitBreakerPolicy(), max_in_flight=200),
            "new-check.team-a.example.com": BackendPolicy(
                circuit_breaker=CircuitBreakerPolicy(), max_in_flight=200, mode="Shadow"
            ),
        },
        id="the documented example: a named entry adds its fields to those of *",
    ),
    pytest.param(
        '{"*": {"maxInFlight": 10}, "a.b.c": {"maxInFlight": 3, "mode": "Warn"}}',
        {
            "a.b.c": BackendPolicy(max_in_flight=3, mode="Warn"),
            "new-check.team-a.example.com": BackendPolicy(max_in_flight=10),
        },
        id="JSON works too; a named field overrides the same field of *",
    ),
    pytest.param(
        '"*": {circuitBreaker: {consecutiveFailures: 2, openSeconds: 30}}\n'
        "a.b.c: {circuitBreaker: {openSeconds: 1.5}}",
        {
            "a.b.c": BackendPolicy(
                circuit_breaker=CircuitBreakerPolicy(consecutive_failures=2, open_seconds=1.5)
            ),
            "new-check.team-a.example.com": BackendPolicy(
                circuit_breaker=CircuitBreakerPolicy(consecutive_failures=2, open_seconds=30)
            ),
        },
        id="field by field inside circuitBreaker too",
    ),
    pytest.param(
        '"*": {circuitBreaker: {}, maxInFlight: 5}\na.b.c: {circuitBreaker: null, maxInFlight: null}',
        {
            "a.b.c": DEFAULT_POLICY,
            "new-check.team-a.example.com": BackendPolicy(
                circuit_breaker=CircuitBreakerPolicy(), max_in_flight=5
            ),
        },
        id="an explicit null turns an inherited protection off; an empty circuitBreaker takes the defaults",
    ),
    pytest.param(
        "",
        {"a.b.c": DEFAULT_POLICY, "new-check.team-a.example.com": DEFAULT_POLICY},
        id="an empty annotation is no policy",
    ),
]


@pytest.mark.parametrize(("policy", "expected"), POLICIES)
def test_policy_in_the_snapshot(policy: str, expected: dict[str, BackendPolicy]) -> None:
    snapshot = load(annotated(policy, "a.b.c", "new-check.team-a.example.com"))
    assert {h.name: h.backend_policy for h in snapshot.mutating} == expected


def test_without_the_annotation_every_webhook_has_the_default_policy() -> None:
    snapshot = load(config(hook("a.b.c"), kind="ValidatingWebhookConfiguration"))
    assert snapshot.validating[0].backend_policy == DEFAULT_POLICY
    assert DEFAULT_POLICY.mode == "Enforce"


ERRORS = [
    pytest.param(
        '"*": {maxInFlight: 0}',
        [f"{ROOT}[*].maxInFlight: Invalid value: 0: must be between 1 and 1000000"],
        id="maxInFlight below 1",
    ),
    pytest.param(
        '"*": {maxInFlight: "many"}',
        [f"{ROOT}[*].maxInFlight: Invalid value: must be an integer, not string"],
        id="maxInFlight not an integer",
    ),
    pytest.param(
        "a.b.c: {mode: Audit}",
        [f'{ROOT}[a.b.c].mode: Unsupported value: "Audit": supported values: "Enforce", "Shadow", "Warn"'],
        id="an unknown mode",
    ),
    pytest.param(
        '"*": {circuitBreaker: {consecutiveFailures: true, openSeconds: 0}}',
        [
            f"{ROOT}[*].circuitBreaker.consecutiveFailures: Invalid value: must be an integer, not boolean",
            f"{ROOT}[*].circuitBreaker.openSeconds: Invalid value: 0: must be more than 0 and at most 3600",
        ],
        id="every bad circuitBreaker field is reported",
    ),
    pytest.param(
        '"*": {circuitBreaker: 5}',
        [f"{ROOT}[*].circuitBreaker: Invalid value: must be an object or null, not number"],
        id="circuitBreaker not an object",
    ),
    pytest.param(
        "x.y.z: {mode: Warn}",
        [f'{ROOT}[x.y.z]: Invalid value: "x.y.z": no webhook of this name in this configuration (use "*" for all of them)'],
        id="a key naming no webhook of this object (a typo would silently apply nothing)",
    ),
    pytest.param(
        "[a, b]",
        [f'{ROOT}: Invalid value: must map webhook names or "*" to settings, not be array'],
        id="not a mapping",
    ),
    pytest.param(
        '"*": [1]',
        [f"{ROOT}[*]: Invalid value: must be an object, not array"],
        id="settings not an object",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "expected"), ERRORS)
def test_invalid_policy_refuses_the_configuration(policy: str, expected: list[str]) -> None:
    assert errors_of(annotated(policy)) == expected


def test_value_that_is_not_yaml_names_line_and_column() -> None:
    (error,) = errors_of(annotated('"*": {mode: Warn'))
    assert error.startswith(f"{ROOT}: Invalid value: not valid YAML or JSON at line ")


def test_unknown_fields_warn() -> None:
    """A misspelt setting never passes silently, as for the rest of the configuration."""
    assert warnings_of(annotated('"*": {maxInflight: 3, circuitBreaker: {openSecs: 1}}')) == [
        f"{ROOT}[*].maxInflight: unknown field; known fields: caFrom, circuitBreaker, maxInFlight, mode",
        f"{ROOT}[*].circuitBreaker.openSecs: unknown field; known fields: consecutiveFailures, openSeconds",
    ]


def test_check_shows_the_policy_and_names_the_annotation_in_errors(tmp_path: Path) -> None:
    """`check` prints the policy in force per webhook, and an error names file, object, annotation, key."""
    good = annotated('"*": {circuitBreaker: {consecutiveFailures: 5, openSeconds: 10}, maxInFlight: 200}')
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(good))
    run = subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--config", str(tmp_path)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert (
        "mutating webhook 'a.b.c' (team-a): mode=Enforce circuitBreaker=5/10s maxInFlight=200" in run.stdout
    )
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(annotated('"*": {mode: Loud}')))
    run = subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--config", str(tmp_path)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1
    assert (
        f'a.yaml: MutatingWebhookConfiguration "team-a" {ROOT}[*].mode: Unsupported value: "Loud"'
        in run.stderr
    )


def test_the_backend_down_load_test_configures_a_breaker_and_its_control_none(tmp_path: Path) -> None:
    """`python -m loadtests backend-down` measures the breaker against `backend-down-off`, without it."""
    from gateway.config.load import load_directory
    from loadtests.scenarios import build, write_configs

    for name, expected in (("backend-down", CircuitBreakerPolicy(consecutive_failures=5, open_seconds=10)),
                           ("backend-down-off", None)):  # fmt: skip
        scenario = build(name)
        urls = {b.name: f"http://127.0.0.1:{1000 + k}/allow" for k, b in enumerate(scenario.backends)}
        write_configs(scenario, urls, None, tmp_path / name)
        snapshot = load_directory(tmp_path / name)
        assert {h.backend_policy.circuit_breaker for h in snapshot.validating} == {expected}


_ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "maxInFlight": st.one_of(st.none(), st.integers(1, 1000)),
        "mode": st.sampled_from(["Enforce", "Warn", "Shadow"]),
        "circuitBreaker": st.one_of(
            st.none(),
            st.fixed_dictionaries(
                {}, optional={"consecutiveFailures": st.integers(1, 50), "openSeconds": st.integers(1, 600)}
            ),
        ),
    },
)


@settings(max_examples=200, deadline=None)
@given(default=_ENTRY, named=_ENTRY)
def test_a_named_entry_overrides_star_field_by_field(default: dict[str, Any], named: dict[str, Any]) -> None:
    """For any two entries: each field (and each circuitBreaker field) comes from the named entry when
    it gives it, else from "*", else the default; null switches a protection off."""
    policy = json.dumps({"*": default, "a.b.c": named})
    got = load(annotated(policy, "a.b.c", "d.e.f")).mutating
    mine, other = got[0].backend_policy, got[1].backend_policy

    def expected(entries: list[dict[str, Any]]) -> BackendPolicy:
        merged: dict[str, Any] = {}
        for entry in entries:
            for k, v in entry.items():
                if k == "circuitBreaker" and isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
        cb = merged.get("circuitBreaker")
        return BackendPolicy(
            circuit_breaker=None
            if cb is None
            else CircuitBreakerPolicy(
                consecutive_failures=cb.get("consecutiveFailures", 5), open_seconds=cb.get("openSeconds", 10)
            ),
            max_in_flight=merged.get("maxInFlight"),
            mode=merged.get("mode", "Enforce"),
        )

    assert mine == expected([default, named])
    assert other == expected([default])
