"""CEL matchConditions through the real gateway (MAT-24..28), with the caller's request fields (MAT-25)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.gateway import Expect, backend, review, run_scenario


def conditions(*expressions: str) -> list[dict[str, str]]:
    return [{"name": f"c{i}", "expression": e} for i, e in enumerate(expressions)]


SCENARIOS: list[Any] = [
    pytest.param(
        conditions("request.userInfo.username == 'alice'", "object.metadata.labels.app == 'web'"),
        "Fail",
        Expect(allowed=False, calls=1),
        id="MAT-25/26: every condition true, from the caller's userInfo and the object, calls the backend",
    ),
    pytest.param(
        conditions("request.userInfo.username == 'bob'"),
        "Fail",
        Expect(allowed=True, calls=0),
        id="MAT-26: a false condition skips the backend",
    ),
    pytest.param(
        conditions(
            "'system:authenticated' in request.userInfo.groups && request.options.kind == 'CreateOptions'"
        ),
        "Fail",
        Expect(allowed=False, calls=1),
        id="MAT-25: request.userInfo.groups and request.options are the caller's",
    ),
    pytest.param(
        conditions("object.metadata.labels.missing == 'x'"),
        "Fail",
        Expect(
            allowed=False,
            code=403,
            reason="Forbidden",
            calls=0,
            message_prefix=(
                "pods \"web-1\" is forbidden: expression 'object.metadata.labels.missing == 'x'' resulted in error: "
            ),
        ),
        id="MAT-26/28: an evaluation error under Fail rejects the review with 403 naming the resource",
    ),
    pytest.param(
        conditions("object.metadata.labels.missing == 'x'"),
        "Ignore",
        Expect(allowed=True, calls=0),
        id="MAT-26: an evaluation error under Ignore skips the backend",
    ),
]


@pytest.mark.parametrize(("match_conditions", "policy", "expect"), SCENARIOS)
async def test_match_conditions(
    nursery: trio.Nursery, tmp_path: Path, match_conditions: list[dict[str, str]], policy: str, expect: Expect
) -> None:
    """Match conditions decide whether a backend is called, as MAT-24..28 say."""
    hooks = {
        "a": [backend("cel.example.com", "/deny", matchConditions=match_conditions, failurePolicy=policy)]
    }
    outcome = await run_scenario(nursery, tmp_path, validating=hooks)
    expect.check(outcome)


def _review_with(change: str) -> dict[str, Any]:
    """A review carrying input CEL cannot be given (MAT-26: the evaluation fails as a whole)."""
    doc = review()
    req = doc["request"]
    if change == "deep object":
        deep: Any = 1
        for _ in range(1_500):
            deep = [deep]
        req["object"]["spec"]["deep"] = deep
    elif change == "huge int in object":
        req["object"]["spec"]["replicas"] = 2**64
    elif change == "huge int in options":
        req["options"]["gracePeriodSeconds"] = 2**70
    elif change == "deep options":
        deep = 1
        for _ in range(2_000):
            deep = [deep]
        req["options"]["deep"] = deep
    return doc


UNUSABLE_INPUTS = [
    pytest.param(
        change, condition, id=f"MAT-26: {change} is an evaluation failure under the backend's policy"
    )
    for change, condition in (
        ("deep object", "object.metadata.labels.app == 'web'"),
        ("huge int in object", "object.metadata.labels.app == 'web'"),
        ("huge int in options", "request.options.kind == 'CreateOptions'"),
        ("deep options", "request.options.kind == 'CreateOptions'"),
    )
]


@pytest.mark.parametrize(("change", "condition"), UNUSABLE_INPUTS)
@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
async def test_input_cel_cannot_use_goes_to_failure_policy(
    nursery: trio.Nursery,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: str,
    condition: str,
    policy: str,
) -> None:
    """MAT-26: Fail rejects with MAT-28's 403, Ignore skips; one log line names backend and condition."""
    hooks = {
        "a": [
            backend(
                "cel.example.com",
                "/deny",
                matchConditions=[{"name": "reads-input", "expression": condition}],
                failurePolicy=policy,
            )
        ]
    }
    outcome = await run_scenario(nursery, tmp_path, validating=hooks, doc=_review_with(change))
    if policy == "Fail":
        Expect(
            allowed=False, code=403, reason="Forbidden", calls=0, message_prefix='pods "web-1" is forbidden: '
        ).check(outcome)
        assert "for CEL" in outcome.message
    else:
        Expect(allowed=True, calls=0).check(outcome)
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() + out.err.splitlines() if "match condition failed" in line]
    assert len(lines) == 1, lines
    assert "cel.example.com" in lines[0] and "reads-input" in lines[0]
    assert "Traceback" not in out.out + out.err


REQUEST_FIELDS = [
    pytest.param(expression, id=f"MAT-25/REV-06: request.{field} is the caller's {field}, not the {source}")
    for field, source, expression in (
        (
            "requestKind",
            "kind",
            "request.requestKind.group == 'apps' && request.requestKind.version == 'v1beta1'"
            " && request.requestKind.kind == 'Deployment'",
        ),
        (
            "requestResource",
            "resource",
            "request.requestResource.group == 'apps'"
            " && request.requestResource.version == 'v1beta1' && request.requestResource.resource == 'deployments'",
        ),
        ("requestSubResource", "subResource", "request.requestSubResource == 'status'"),
        ("kind", "requestKind", "request.kind.version == 'v1' && request.kind.kind == 'Deployment'"),
        (
            "resource",
            "requestResource",
            "request.resource.version == 'v1' && request.resource.resource == 'deployments'",
        ),
        ("subResource", "requestSubResource", "request.subResource == 'scale'"),
    )
]


@pytest.mark.parametrize("expression", REQUEST_FIELDS)
async def test_cel_request_fields_are_the_requests_own(
    nursery: trio.Nursery, tmp_path: Path, expression: str
) -> None:
    """A Deployment requested as apps/v1beta1 deployments/status, sent as apps/v1 deployments/scale."""
    doc = review(
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web-1", "namespace": "shop"}},
        resource=("apps", "v1", "deployments"),
        kind=("apps", "v1", "Deployment"),
        sub_resource="scale",
    )
    req = doc["request"]
    req["requestKind"] = {"group": "apps", "version": "v1beta1", "kind": "Deployment"}
    req["requestResource"] = {"group": "apps", "version": "v1beta1", "resource": "deployments"}
    req["requestSubResource"] = "status"
    hooks = {"a": [backend("cel.example.com", "/deny", matchConditions=conditions(expression))]}
    outcome = await run_scenario(nursery, tmp_path, validating=hooks, doc=doc)
    Expect(allowed=False, calls=1).check(outcome)  # the condition held: the (denying) backend was called
