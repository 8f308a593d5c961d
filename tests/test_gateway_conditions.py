"""CEL matchConditions through the real gateway (MAT-24..28), with the caller's request fields (MAT-25)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.gateway import Expect, backend, run_scenario


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
