"""The mutating chain through the real gateway over real sockets (spec §5 MUT-*, ORD-02)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import trio

from gateway.dispatch.jsonpatch import apply_patch
from tests.support.gateway import Expect, backend, pod, review, run_scenario

CALLERS = [pytest.param("v1", id="v1 caller"), pytest.param("v1beta1", id="v1beta1 caller")]


def jsonpatch_path(ops: list[dict[str, Any]], then: str = "allow") -> str:
    return "/jsonpatch/" + quote(json.dumps(ops), safe="") + "/" + then


def label(name: str, value: str = "true") -> dict[str, Any]:
    return {"op": "add", "path": f"/metadata/labels/{name}", "value": value}


SCENARIOS: list[Any] = [
    pytest.param(
        {"a": [backend("one.example.com", "/patch/one"), backend("two.example.com", "/patch/two")]},
        Expect(allowed=True, calls=2, patch=[label("one"), label("two")]),
        id="MUT-22/23: two patches combine into one concatenated patch in invocation order",
    ),
    pytest.param(
        {"a": [backend("noop.example.com", "/allow"), backend("empty.example.com", jsonpatch_path([]))]},
        Expect(allowed=True, calls=2, patch=None),
        id="MUT-03/22: replies without a patch or with [] leave the object unchanged and the reply has no patch",
    ),
    pytest.param(
        {"a": [backend("same.example.com", jsonpatch_path([label("app", "web")]))]},
        Expect(allowed=True, calls=1, patch=None),
        id="MUT-22: a patch that changes nothing gives no patch in the reply",
    ),
    pytest.param(
        {"a": [backend("garbled.example.com", "/undecodable-patch", failurePolicy="Fail")]},
        Expect(
            allowed=False,
            code=500,
            message_prefix='Internal error occurred: failed calling webhook "garbled.example.com": '
            "received undecodable patch in webhook response: ",
        ),
        id="MUT-04: a patch that is not a JSON array is a call error under Fail",
    ),
    pytest.param(
        {
            "a": [
                backend("garbled.example.com", "/undecodable-patch", failurePolicy="Ignore"),
                backend("next.example.com", "/patch/next"),
            ]
        },
        Expect(
            allowed=True,
            calls=2,
            patch=[label("next")],
            annotations={"failed-open.mutation.round_0_index_0": "garbled.example.com"},
        ),
        id="MUT-04/14: an undecodable patch under Ignore is skipped and the chain goes on",
    ),
    pytest.param(
        {
            "a": [
                backend("broken.example.com", "/invalid-patch", failurePolicy="Ignore"),
                backend("never.example.com", "/patch/never"),
            ]
        },
        Expect(
            allowed=False,
            code=500,
            reason="InternalError",
            calls=1,
            message_prefix='Internal error occurred: admission webhook "broken.example.com" returned a patch '
            "that cannot be applied: ",
        ),
        id="MUT-07: a patch that cannot be applied denies with 500 even under Ignore and stops the chain",
    ),
    pytest.param(
        {
            "a": [
                backend(
                    "kind.example.com", jsonpatch_path([{"op": "replace", "path": "/kind", "value": "Job"}])
                )
            ]
        },
        Expect(
            allowed=False,
            code=500,
            message='Internal error occurred: admission webhook "kind.example.com" changed apiVersion/kind '
            "from v1/Pod to v1/Job",
        ),
        id="MUT-10: a patch that changes the kind is an internal error",
    ),
    pytest.param(
        {
            "a": [
                backend("first.example.com", "/patch/first"),
                backend("no.example.com", "/deny/403/no"),
                backend("never.example.com", "/patch/never"),
            ]
        },
        Expect(
            allowed=False,
            code=403,
            calls=2,
            patch=None,
            message='admission webhook "no.example.com" denied the request: no',
        ),
        id="MUT-13: a rejection stops the chain and the deny carries no patch",
    ),
    pytest.param(
        {
            "a": [
                backend("down.example.com", "/status/503", failurePolicy="Fail"),
                backend("never.example.com", "/patch/never"),
            ]
        },
        Expect(
            allowed=False,
            code=500,
            calls=1,
            message_prefix='Internal error occurred: failed calling webhook "down.example.com": ',
        ),
        id="MUT-14/FPT-04: a call error under Fail stops the chain",
    ),
    pytest.param(
        {
            "a": [
                backend("down.example.com", "/status/503", failurePolicy="Ignore"),
                backend("next.example.com", "/patch/next"),
            ]
        },
        Expect(
            allowed=True,
            calls=2,
            patch=[label("next")],
            annotations={"failed-open.mutation.round_0_index_0": "down.example.com"},
        ),
        id="MUT-14/FPT-03: a call error under Ignore is skipped and annotated",
    ),
    pytest.param(
        {"b": [backend("second.example.com", "/patch/b")], "a": [backend("first.example.com", "/patch/a")]},
        Expect(allowed=True, calls=2, patch=[label("a"), label("b")]),
        id="ORD-01/02: configurations run sorted by name, one backend at a time",
    ),
    pytest.param(
        {
            "a": [
                backend("again.example.com", "/allow", reinvocationPolicy="IfNeeded"),
                backend("changer.example.com", "/patch/changed"),
            ]
        },
        Expect(
            allowed=True,
            calls=3,
            patch=[label("changed")],
            annotations={
                "mutation.round_1_index_0": json.dumps(
                    {"configuration": "a", "webhook": "again.example.com", "mutated": False},
                    separators=(",", ":"),
                )
            },
        ),
        id="MUT-19/21: a change by a later Never backend reinvokes an earlier IfNeeded backend once, in round 1",
    ),
    pytest.param(
        {
            "a": [
                backend("changer.example.com", "/patch/x", reinvocationPolicy="IfNeeded"),
                backend("quiet.example.com", "/allow", reinvocationPolicy="IfNeeded"),
            ]
        },
        Expect(allowed=True, calls=2, patch=[label("x")], no_annotations=("mutation.round_1_index_0",)),
        id="MUT-19/20: when nothing changes after an IfNeeded backend, round 1 calls nobody",
    ),
]


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("mutating", "expect"), SCENARIOS)
async def test_mutating(
    nursery: trio.Nursery, tmp_path: Path, caller: str, mutating: dict[str, Any], expect: Expect
) -> None:
    """The mutating endpoint chains backends and answers as the MUT statements say."""
    outcome = await run_scenario(
        nursery, tmp_path, endpoint="mutate", mutating=mutating, caller_version=caller
    )
    expect.check(outcome)
    if outcome.patch:  # MUT-23/25: the reply's patch turns the inbound object into the final one
        final = apply_patch(outcome.sent["request"]["object"], outcome.patch)
        assert isinstance(final, dict)


async def test_each_backend_sees_the_previous_patch(nursery: trio.Nursery, tmp_path: Path) -> None:
    """MUT-01/11, ORD-02: the second backend receives the object as the first one patched it."""
    hooks = [backend("one.example.com", "/patch/one"), backend("two.example.com", "/patch/two")]
    outcome = await run_scenario(nursery, tmp_path, endpoint="mutate", mutating={"a": hooks})
    first, second = (c.review["request"] for c in outcome.calls)
    assert "one" not in first["object"]["metadata"]["labels"]
    assert second["object"]["metadata"]["labels"]["one"] == "true"
    assert second["oldObject"] is None
    assert first["uid"] != second["uid"] != outcome.sent["request"]["uid"]  # REV-06: a fresh uid per call
    assert outcome.response["uid"] == outcome.sent["request"]["uid"]  # REV-15: never a backend's uid


async def test_patch_on_delete_is_refused(nursery: trio.Nursery, tmp_path: Path) -> None:
    """MUT-06: a patch for a request without object (DELETE) is a 500 internal error."""
    doc = review(operation="DELETE", old=pod())
    hooks = [backend("deleter.example.com", "/patch/x", failurePolicy="Ignore")]
    outcome = await run_scenario(nursery, tmp_path, endpoint="mutate", mutating={"a": hooks}, doc=doc)
    Expect(
        allowed=False,
        code=500,
        message='Internal error occurred: admission webhook "deleter.example.com" attempted to modify the '
        "object, which is not supported for this operation",
    ).check(outcome)


async def test_diff_mode_gives_the_net_change(nursery: trio.Nursery, tmp_path: Path) -> None:
    """MUT-24: with --patch-mode diff the reply's patch is a diff that yields exactly the final object."""
    hooks = [
        backend("add.example.com", jsonpatch_path([label("tmp")])),
        backend(
            "remove.example.com",
            jsonpatch_path([{"op": "remove", "path": "/metadata/labels/tmp"}, label("kept")]),
        ),
    ]
    outcome = await run_scenario(
        nursery, tmp_path, endpoint="mutate", mutating={"a": hooks}, gateway_args=("--patch-mode", "diff")
    )
    assert outcome.allowed
    final = apply_patch(outcome.sent["request"]["object"], outcome.patch or [])
    expected = json.loads(json.dumps(outcome.sent["request"]["object"]))
    expected["metadata"]["labels"]["kept"] = "true"
    assert final == expected
    assert all("tmp" not in op["path"] for op in outcome.patch or [])


async def test_objects_are_not_defaulted_or_pruned_between_patches(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """GW-03: a field upstream's typed decoding would drop reaches the next backend unchanged."""
    hooks = [
        backend("adds.example.com", jsonpatch_path([{"op": "add", "path": "/spec/notAField", "value": 1}])),
        backend("sees.example.com", "/allow"),
    ]
    outcome = await run_scenario(nursery, tmp_path, endpoint="mutate", mutating={"a": hooks})
    second = outcome.calls[1].review["request"]["object"]
    assert second["spec"]["notAField"] == 1
    assert "restartPolicy" not in second["spec"]  # nor is anything defaulted
