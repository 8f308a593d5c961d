"""Validating fan-out through the real gateway over real sockets (spec §6 VAL-*, AUD-07/08)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.gateway import Expect, backend, review, run_scenario

CALLERS = [pytest.param("v1", id="v1 caller"), pytest.param("v1beta1", id="v1beta1 caller")]
NOT_PODS = [{"operations": ["*"], "apiGroups": ["apps"], "apiVersions": ["*"], "resources": ["deployments"]}]


SCENARIOS: list[Any] = [
    pytest.param(
        {"a": [backend("deploys.example.com", "/deny", rules=NOT_PODS)]},
        Expect(allowed=True, calls=0),
        id="VAL-02: with no matching backend the review is allowed and nothing is called",
    ),
    pytest.param(
        {"a": [backend("one.example.com", "/allow"), backend("two.example.com", "/allow")]},
        Expect(allowed=True, calls=2),
        id="VAL-03: every matching backend is called and all allowing allows",
    ),
    pytest.param(
        {
            "a": [
                backend("fast-deny.example.com", "/deny/403/nope"),
                backend("slow.example.com", "/sleep/300/warn/slow%20one/allow"),
            ]
        },
        Expect(allowed=False, code=403, calls=2, warnings=["slow one"]),
        id="VAL-04: a rejection does not cancel the others and their warnings are still returned",
    ),
    pytest.param(
        {"a": [backend("deny.example.com", "/deny/403/image%20registry%20not%20allowed")]},
        Expect(
            allowed=False,
            code=403,
            message='admission webhook "deny.example.com" denied the request: image registry not allowed',
        ),
        id="VAL-05, ERR-09/GW-06: a rejection is recorded with the backend's status, prefixed with its name",
    ),
    pytest.param(
        {
            "a": [
                backend("broken.example.com", "/status/500/boom", failurePolicy="Ignore"),
                backend("ok.example.com", "/allow"),
            ]
        },
        Expect(allowed=True, annotations={"failed-open.validating.round_0_index_0": "broken.example.com"}),
        id="VAL-05: a call error under Ignore fails open and is annotated",
    ),
    pytest.param(
        {"a": [backend("broken.example.com", "/status/500/boom", failurePolicy="Fail")]},
        Expect(
            allowed=False,
            code=500,
            reason="InternalError",
            message_prefix='Internal error occurred: failed calling webhook "broken.example.com": ',
        ),
        id="VAL-05: a call error under Fail denies with 500 naming the backend",
    ),
    pytest.param(
        {
            "a": [
                backend("first.example.com", "/sleep/300/deny/422/first%20says%20no"),
                backend("second.example.com", "/deny/429/second%20says%20no"),
            ]
        },
        Expect(
            allowed=False,
            code=422,
            message='admission webhook "first.example.com" denied the request: first says no; '
            'admission webhook "second.example.com" denied the request: second says no',
        ),
        id="VAL-07: denials are reported in configuration order whatever the completion order",
    ),
    pytest.param(
        {
            "b": [backend("later.example.com", "/warn/from%20b/annotate/k/vb/allow")],
            "a": [backend("earlier.example.com", "/sleep/200/warn/from%20a/annotate/k/va/deny")],
        },
        Expect(
            allowed=False,
            warnings=["from a", "from b"],
            annotations={"earlier.example.com_k": "va", "later.example.com_k": "vb"},
        ),
        id="VAL-08: warnings and annotations of every verified reply return, in configuration order",
    ),
    pytest.param(
        {"a": [backend("patcher.example.com", "/patch/x", admissionReviewVersions=["v1beta1"])]},
        Expect(allowed=True, patch=None),
        id="VAL-09: a validating reply never carries a patch, even when a v1beta1 backend sent one",
    ),
]


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("validating", "expect"), SCENARIOS)
async def test_validating(
    nursery: trio.Nursery, tmp_path: Path, caller: str, validating: dict[str, Any], expect: Expect
) -> None:
    """The validating endpoint combines backend outcomes as the VAL statements say."""
    outcome = await run_scenario(nursery, tmp_path, validating=validating, caller_version=caller)
    expect.check(outcome)


async def test_backends_are_called_concurrently(nursery: trio.Nursery, tmp_path: Path) -> None:
    """VAL-03: three backends that each take 0.5 s answer together in far less than 1.5 s."""
    hooks = [backend(f"slow{i}.example.com", "/sleep/500/allow") for i in range(3)]
    outcome = await run_scenario(nursery, tmp_path, validating={"a": hooks})
    assert outcome.allowed
    assert outcome.elapsed < 1.2


async def test_exhausted_budget_calls_nobody(nursery: trio.Nursery, tmp_path: Path) -> None:
    """VAL-10: when the caller's budget is gone before calls start, each backend gets the timeout error."""
    hooks = [backend("a.example.com", "/allow"), backend("b.example.com", "/allow", failurePolicy="Ignore")]
    outcome = await run_scenario(nursery, tmp_path, validating={"a": hooks}, timeout="150ms")
    assert outcome.calls == []
    assert not outcome.allowed
    assert outcome.message.startswith('Internal error occurred: failed calling webhook "a.example.com": ')
    assert outcome.message.endswith("context deadline exceeded")
    assert outcome.annotations["failed-open.validating.round_0_index_1"] == "b.example.com"


async def test_dry_run_refused_for_side_effects(nursery: trio.Nursery, tmp_path: Path) -> None:
    """FPT-09: in a dry run a backend with sideEffects Unknown is not called and the review is denied."""
    hooks = [backend("unsafe.example.com", "/allow", sideEffects="Unknown", failurePolicy="Ignore")]
    doc = review(dry_run=True)
    outcome = await run_scenario(
        nursery,
        tmp_path,
        validating={"a": hooks},
        doc=doc,
        api_version="admissionregistration.k8s.io/v1beta1",
    )
    assert outcome.calls == []
    assert outcome.status["code"] == 400
    assert outcome.message == 'admission webhook "unsafe.example.com" does not support dry run'
