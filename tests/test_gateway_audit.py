"""Audit annotations and warnings through the real gateway (spec §9 AUD-*)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import trio

from tests.support.gateway import Expect, backend, review, run_scenario

LONG_KEY = "k" * 60
LONG_NAME = "images.policy.example.com"
HASHED = "ann-" + hashlib.sha256(f"{LONG_NAME}/{LONG_KEY}".encode()).hexdigest()[:12]

SCENARIOS: list[Any] = [
    pytest.param(
        {"a": [backend("images.policy.example.com", "/annotate/violation/registry/deny")]},
        Expect(allowed=False, annotations={"images.policy.example.com_violation": "registry"}),
        id="AUD-01/04: a rejection's annotations are returned renamed <name>_<key>",
    ),
    pytest.param(
        {"a": [backend(LONG_NAME, f"/annotate/{LONG_KEY}/v/allow")]},
        Expect(
            allowed=True,
            annotations={
                HASHED: json.dumps({"key": f"{LONG_NAME}/{LONG_KEY}", "value": "v"}, separators=(",", ":"))
            },
        ),
        id="AUD-04: a renamed key over 63 characters becomes ann-<hash> with the original in the value",
    ),
    pytest.param(
        {"a": [backend("b.example.com", "/annotate/" + quote("bad key!", safe="") + "/v/allow")]},
        Expect(allowed=True, no_annotations=("b.example.com_bad key!",)),
        id="AUD-02: an annotation whose key is not a qualified name is dropped and the review goes on",
    ),
    pytest.param(
        {
            "a": [
                backend("same.example.com", "/annotate/k/first/allow"),
                backend("same.example.com", "/annotate/k/second/allow"),
            ]
        },
        Expect(allowed=True, annotations={"same.example.com_k": "first"}),
        id="AUD-03: within one review an annotation key keeps its first value",
    ),
    pytest.param(
        {
            "a": [
                backend("one.example.com", "/warn/w1/warn/shared/allow"),
                backend("two.example.com", "/warn/shared/warn/w2/allow"),
            ]
        },
        Expect(allowed=True, warnings=["w1", "shared", "w2"]),
        id="AUD-07: warnings return in configuration order with exact duplicates dropped",
    ),
    pytest.param(
        {"a": [backend("b.example.com", "/warn/" + quote("bell\x07", safe="") + "/warn/fine/allow")]},
        Expect(allowed=True, warnings=["fine"]),
        id="AUD-09: warnings with control characters are dropped as the caller would",
    ),
]


@pytest.mark.parametrize(
    "caller", [pytest.param("v1", id="v1 caller"), pytest.param("v1beta1", id="v1beta1 caller")]
)
@pytest.mark.parametrize(("validating", "expect"), SCENARIOS)
async def test_audit_annotations_and_warnings(
    nursery: trio.Nursery, tmp_path: Path, validating: Any, expect: Expect, caller: str
) -> None:
    """Backend annotations and warnings reach the caller as AUD statements say."""
    outcome = await run_scenario(
        nursery,
        tmp_path,
        validating=validating,
        api_version="admissionregistration.k8s.io/v1beta1",  # v1beta1 allows the AUD-03 duplicate names
        caller_version=caller,
    )
    expect.check(outcome)
    assert all("/" not in key for key in outcome.annotations)  # AUD-04/06: keys survive the caller's prefix


async def test_mutation_annotations(nursery: trio.Nursery, tmp_path: Path) -> None:
    """AUD-05/06: every invoked mutating backend gets a mutation.round_<r>_index_<i> annotation."""
    hooks = {"cfg": [backend("noop.example.com", "/allow"), backend("labeler.example.com", "/patch/x")]}
    outcome = await run_scenario(nursery, tmp_path, endpoint="mutate", mutating=hooks)
    assert json.loads(outcome.annotations["mutation.round_0_index_0"]) == {
        "configuration": "cfg",
        "webhook": "noop.example.com",
        "mutated": False,
    }
    assert json.loads(outcome.annotations["mutation.round_0_index_1"]) == {
        "configuration": "cfg",
        "webhook": "labeler.example.com",
        "mutated": True,
    }
    assert not any(k.startswith("patch.") for k in outcome.annotations)


async def test_audit_patches_option(nursery: trio.Nursery, tmp_path: Path) -> None:
    """AUD-06: --audit-patches adds patch.round_<r>_index_<i> with the applied patch."""
    hooks = {"cfg": [backend("labeler.example.com", "/patch/x")]}
    outcome = await run_scenario(
        nursery, tmp_path, endpoint="mutate", mutating=hooks, gateway_args=("--audit-patches",)
    )
    value = json.loads(outcome.annotations["patch.round_0_index_0"])
    assert value["webhook"] == "labeler.example.com"
    assert value["patch"] == [{"op": "add", "path": "/metadata/labels/x", "value": "true"}]


REFUSING_SIDE_EFFECTS = [
    pytest.param(
        {"sideEffects": "Unknown"},
        id="AUD-05/06, FPT-09: sideEffects Unknown refused on dry run is annotated",
    ),
    pytest.param(
        {"sideEffects": "Some"}, id="AUD-05/06, FPT-09: sideEffects Some refused on dry run is annotated"
    ),
    pytest.param(
        {"sideEffects": None},
        id="AUD-05/06, FPT-09: v1beta1's default sideEffects (Unknown) refused on dry run is annotated",
    ),
]


@pytest.mark.parametrize("side_effects", REFUSING_SIDE_EFFECTS)
async def test_dry_run_refusal_is_annotated(
    nursery: trio.Nursery, tmp_path: Path, side_effects: dict[str, str | None]
) -> None:
    """A mutating backend refused on a dry run gets mutation.round_0_index_<i> with mutated: false."""
    refused = backend("refused.example.com", "/patch/x", **side_effects)
    if side_effects["sideEffects"] is None:
        del refused["sideEffects"]
    hooks = {"cfg": [backend("safe.example.com", "/allow", sideEffects="NoneOnDryRun"), refused]}
    outcome = await run_scenario(
        nursery,
        tmp_path,
        endpoint="mutate",
        mutating=hooks,
        api_version="admissionregistration.k8s.io/v1beta1",  # Unknown/Some are refused in v1 files
        doc=review(dry_run=True),
    )
    Expect(allowed=False, code=400, calls=1).check(outcome)
    assert json.loads(outcome.annotations["mutation.round_0_index_0"]) == {
        "configuration": "cfg",
        "webhook": "safe.example.com",
        "mutated": False,
    }
    assert json.loads(outcome.annotations["mutation.round_0_index_1"]) == {
        "configuration": "cfg",
        "webhook": "refused.example.com",
        "mutated": False,
    }
