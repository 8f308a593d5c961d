"""CEL match conditions: compiling (CFG-22, GW-12) and evaluating (MAT-24..30)."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from gateway.admission import AdmissionAttributes
from gateway.config.cel import compile_condition
from gateway.config.model import FailurePolicy
from gateway.matching.conditions import (
    AUTHORIZER_UNAVAILABLE,
    OUT_OF_BUDGET,
    ConditionError,
    ConditionInputs,
    ConditionResult,
    aggregate,
    evaluate_conditions,
)
from tests.matching_support import attrs, conditions, obj

# --- CFG-22: compile ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression",
    [
        pytest.param('request.operation == "CREATE"', id="CFG-22: request fields compile"),
        pytest.param("has(object.metadata.labels)", id="CFG-22: has() on object compiles"),
        pytest.param('object.metadata.name.startsWith("web")', id="CFG-22: string functions on dyn compile"),
        pytest.param("oldObject == null", id="CFG-22: oldObject is declared"),
        pytest.param("request.dryRun", id="CFG-22: a bool-typed request field alone is a bool"),
        pytest.param(
            'request.userInfo.groups.exists(g, g == "system:masters")', id="CFG-22: macros bind variables"
        ),
        pytest.param(
            'namespaceObject == null || namespaceObject.metadata.name == "x"',
            id="CFG-22: namespaceObject is declared (always null, MAT-25)",
        ),
        pytest.param(
            "size(object.spec.containers) > 0 && !request.dryRun", id="CFG-22: size() and negation compile"
        ),
    ],
)
def test_compiles(expression: str) -> None:
    """CFG-22: expressions over the declared variables with a bool result compile."""
    compiled = compile_condition("c", expression)
    assert compiled.error is None
    assert compiled.program is not None
    assert compiled.uses_authorizer is False


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        pytest.param(
            "1 +",
            "compilation failed: ERROR: <input>:1:3: Syntax error\n | 1 +\n |   ^",
            id="CFG-22: a syntax error is refused with its position",
        ),
        pytest.param(
            "params.x == 1",
            "compilation failed: ERROR: <input>:1:1: undeclared reference to 'params' (in container '')"
            "\n | params.x == 1\n | ^",
            id="CFG-22: there is no params variable",
        ),
        pytest.param(
            "request.foo == 1",
            "compilation failed: ERROR: <input>:1:9: undefined field 'foo'"
            "\n | request.foo == 1\n |         ^",
            id="CFG-22: request has only AdmissionRequest's fields",
        ),
        pytest.param(
            "object.spec.paused",
            "must evaluate to bool but got dyn",
            id="CFG-22: object fields are dyn, which is not bool",
        ),
        pytest.param(
            "request.name", "must evaluate to bool but got string", id="CFG-22: a string result is refused"
        ),
        pytest.param("1 + 2", "must evaluate to bool but got int", id="CFG-22: an int result is refused"),
        pytest.param(
            "[1, 2]", "must evaluate to bool but got list(int)", id="CFG-22: a list result is refused"
        ),
        pytest.param(
            "true ? object.a : false",
            "must evaluate to bool but got dyn",
            id="CFG-22: a conditional joining bool and dyn is dyn",
        ),
        pytest.param(
            'object.metadata.name.lowerAscii() == "a"',
            "compilation failed: ERROR: <input>:1:22: undeclared reference to 'lowerAscii' (in container '')"
            '\n | object.metadata.name.lowerAscii() == "a"'
            "\n |                      ^",
            id="GW-12: a Kubernetes CEL library function the engine lacks does not compile",
        ),
        pytest.param(
            "  ", "compilation failed: empty expression", id="CFG-22: a blank expression is refused"
        ),
    ],
)
def test_refused(expression: str, error: str) -> None:
    """CFG-22: compile problems come back as ``error``, never raised."""
    compiled = compile_condition("c", expression)
    assert compiled.error == error
    assert compiled.program is None


def test_named_variables_are_recorded() -> None:
    """CFG-22: the variables an expression names (not macro-bound names) are recorded for decoding."""
    compiled = compile_condition("c", "object.a == 1 && request.dryRun && [1].all(oldObject, oldObject > 0)")
    assert compiled.variables == {"object", "request"}


def test_authorizer_compiles_and_is_flagged() -> None:
    """CFG-22/MAT-29: authorizer expressions compile and are marked for MAT-29 at evaluation."""
    compiled = compile_condition("c", 'authorizer.group("").resource("pods").check("get").allowed()')
    assert (compiled.error, compiled.uses_authorizer) == (None, True)


# --- MAT-24..30: evaluate -------------------------------------------------------------------------

POD = attrs("CREATE", namespace="ns", name="web-1", object=obj({"app": "web"}, name="web-1"))
MISSING = "object.metadata.missing == 1"
MISSING_ERROR = f"expression '{MISSING}' resulted in error: no such key: missing"
OTHER = "object.spec.other == 2"
OTHER_ERROR = f"expression '{OTHER}' resulted in error: no such key: spec"


def run(
    pairs: list[tuple[str, str]], policy: FailurePolicy = "Fail", a: AdmissionAttributes = POD
) -> ConditionResult:
    return evaluate_conditions(conditions(*pairs), policy, a)


@pytest.mark.parametrize(
    ("pairs", "policy", "matches", "error", "excluded", "errors_counted"),
    [
        pytest.param([], "Fail", True, None, False, 0, id="MAT-24: an empty list matches"),
        pytest.param(
            [("a", "true"), ("b", 'object.metadata.labels.app == "web"')],
            "Fail",
            True,
            None,
            False,
            0,
            id="MAT-26: all true calls",
        ),
        pytest.param(
            [("a", "true"), ("b", "false")], "Fail", False, None, True, 0, id="MAT-26: one false skips"
        ),
        pytest.param(
            [("a", MISSING), ("b", "false")],
            "Fail",
            False,
            None,
            True,
            1,
            id="MAT-26/30: a false skips even under Fail; the error before it is counted",
        ),
        pytest.param(
            [("a", "false"), ("b", MISSING)],
            "Fail",
            False,
            None,
            True,
            0,
            id="MAT-30: errors after the first false are not counted (upstream quirk)",
        ),
        pytest.param(
            [("a", "true"), ("b", MISSING)],
            "Fail",
            False,
            MISSING_ERROR,
            False,
            1,
            id="MAT-26: true and an error under Fail rejects with that error",
        ),
        pytest.param(
            [("a", "true"), ("b", MISSING)],
            "Ignore",
            False,
            None,
            True,
            1,
            id="MAT-26/30: true and an error under Ignore skips and counts an exclusion",
        ),
        pytest.param(
            [("a", MISSING), ("b", OTHER)],
            "Fail",
            False,
            f"[{MISSING_ERROR}, {OTHER_ERROR}]",
            False,
            2,
            id="MAT-28: several errors are joined as [e1, e2] in condition order",
        ),
        pytest.param(
            [("a", MISSING), ("b", MISSING)],
            "Fail",
            False,
            MISSING_ERROR,
            False,
            2,
            id="MAT-28: identical error texts appear once, without brackets",
        ),
        pytest.param(
            [("a", "object.metadata.labels['missing'] == 'x'")],
            "Fail",
            False,
            "expression 'object.metadata.labels['missing'] == 'x'' resulted in error: no such key: missing",
            False,
            1,
            id="MAT-28: an index into a map names the missing key, as cel-go does",
        ),
        pytest.param(
            [("a", "namespaceObject")],
            "Fail",
            False,
            "expression 'namespaceObject' resulted in error: expected a bool result, got null_type",
            False,
            1,
            id="MAT-26: a non-boolean result is an evaluation error",
        ),
    ],
)
def test_evaluation(
    pairs: list[tuple[str, str]],
    policy: FailurePolicy,
    matches: bool,
    error: str | None,
    excluded: bool,
    errors_counted: int,
) -> None:
    """MAT-24/26/28/30: outcome, error text and the facts metrics count."""
    result = run(pairs, policy)
    assert (result.matches, result.error) == (matches, error)
    assert (result.facts.excluded, result.facts.evaluation_errors) == (excluded, errors_counted)


def test_false_condition_is_named() -> None:
    """MAT-30: the skipping condition is named, and every error is kept for the log line."""
    result = run([("a", MISSING), ("b", "false"), ("c", OTHER)])
    assert result.facts.false_condition == "b"
    assert result.facts.errors == (ConditionError("a", MISSING_ERROR), ConditionError("c", OTHER_ERROR))


def test_compile_error_from_lax_source() -> None:
    """MAT-26/28: a CFG-24 condition that did not compile errors with `compilation error: <cause>`."""
    result = run([("a", "1 +")])
    assert (
        result.error
        == "compilation error: compilation failed: ERROR: <input>:1:3: Syntax error\n | 1 +\n |   ^"
    )


@pytest.mark.parametrize(
    ("policy", "matches", "error", "excluded"),
    [
        pytest.param(
            "Fail",
            False,
            "expression 'authorizer.requestResource.check(\"get\").allowed()' resulted in error: "
            + AUTHORIZER_UNAVAILABLE,
            False,
            id="MAT-29/GW-11: authorizer without SubjectAccessReview client is an error; Fail rejects",
        ),
        pytest.param(
            "Ignore", False, None, True, id="MAT-29: authorizer error under Ignore skips the backend"
        ),
    ],
)
def test_authorizer_unavailable(
    policy: FailurePolicy, matches: bool, error: str | None, excluded: bool
) -> None:
    """MAT-29: any use of authorizer is an evaluation error governed by MAT-26."""
    result = run([("authz", 'authorizer.requestResource.check("get").allowed()')], policy)
    assert (result.matches, result.error, result.facts.excluded) == (matches, error, excluded)
    assert [e.name for e in result.facts.errors] == ["authz"]


@pytest.mark.parametrize(
    ("expression", "a", "expected"),
    [
        pytest.param(
            "object == null",
            attrs("DELETE", old_object=obj({})),
            True,
            id="MAT-25: object is null for DELETE",
        ),
        pytest.param(
            "oldObject == null",
            attrs("CREATE", object=obj({})),
            True,
            id="MAT-25: oldObject is null for CREATE",
        ),
        pytest.param(
            'object.metadata.labels.app == "web"', POD, True, id="MAT-25: object is the review's object"
        ),
        pytest.param(
            'request.namespace == "ns" && request.name == "web-1"',
            POD,
            True,
            id="MAT-25: request carries name and namespace",
        ),
        pytest.param(
            'request.kind.kind == "kpods" && request.resource.resource == "pods"',
            POD,
            True,
            id="MAT-25: request carries kind and resource",
        ),
        pytest.param(
            'request.requestResource.resource == "pods" && request.subResource == ""',
            POD,
            True,
            id="MAT-25: requestResource equals resource (no conversion)",
        ),
        pytest.param(
            'request.operation == "CREATE" && !request.dryRun',
            POD,
            True,
            id="MAT-25: request carries operation and dryRun",
        ),
        pytest.param(
            "request.dryRun",
            attrs("CREATE", object=obj({}), dry_run=True),
            True,
            id="MAT-25: dryRun true is visible",
        ),
        pytest.param(
            "namespaceObject == null", POD, True, id="MAT-25: namespaceObject is always null for webhooks"
        ),
    ],
)
def test_variables(expression: str, a: AdmissionAttributes, expected: bool) -> None:
    """MAT-25: the CEL variables bound for a webhook."""
    result = run([("v", expression)], a=a)
    assert result.error is None
    assert result.matches is expected


def test_request_override() -> None:
    """MAT-25: the dispatcher may supply the inbound request (userInfo, options) for ``request``."""
    inputs = ConditionInputs(
        request={"userInfo": {"username": "alice", "groups": ["dev"]}, "operation": "CREATE"}
    )
    result = evaluate_conditions(
        conditions(("u", 'request.userInfo.username == "alice"')), "Fail", POD, inputs
    )
    assert (result.matches, result.error) == (True, None)


def test_conditions_see_current_object() -> None:
    """MAT-20: shared inputs re-decode a patched object; oldObject stays the original."""
    first = attrs("UPDATE", object=obj({"stage": "raw"}), old_object=obj({"stage": "old"}))
    inputs = ConditionInputs()
    conds = conditions(
        ("s", 'object.metadata.labels.stage == "patched" && oldObject.metadata.labels.stage == "old"')
    )
    assert evaluate_conditions(conds, "Fail", first, inputs).matches is False
    assert (
        evaluate_conditions(conds, "Fail", first.with_object(obj({"stage": "patched"})), inputs).matches
        is True
    )


def stepping_clock(step: float) -> itertools.count[float]:
    return itertools.count(0.0, step)


LONG = "[" + ", ".join(str(i) for i in range(200)) + "].all(x, x >= 0)"


@pytest.mark.parametrize(
    ("policy", "error", "excluded"),
    [
        pytest.param(
            "Fail",
            OUT_OF_BUDGET,
            False,
            id="MAT-27: running past the bound fails the whole evaluation; Fail rejects",
        ),
        pytest.param(
            "Ignore", None, True, id="MAT-27: running past the bound under Ignore skips (an exclusion)"
        ),
    ],
)
def test_time_bound(policy: FailurePolicy, error: str | None, excluded: bool) -> None:
    """MAT-26/27: the shared bound discards individual results, including an earlier false one."""
    ticks = stepping_clock(0.01)  # every look at the clock advances it 10 ms: deterministic, not timed
    result = evaluate_conditions(
        conditions(("quick", "false"), ("long", LONG)),
        policy,
        POD,
        time_limit_seconds=0.25,
        clock=lambda: next(ticks),
    )
    assert (result.matches, result.error, result.facts.excluded) == (False, error, excluded)
    assert result.facts.evaluation_errors == 0  # MAT-30: a whole failure is not an evaluation error
    assert result.facts.evaluation_seconds > 0.25


def test_time_bound_not_reached() -> None:
    """MAT-27: the same conditions within the bound evaluate normally (the false one skips)."""
    ticks = stepping_clock(0.01)
    result = evaluate_conditions(
        conditions(("quick", "false"), ("long", LONG)),
        "Fail",
        POD,
        time_limit_seconds=1000,
        clock=lambda: next(ticks),
    )
    assert (result.matches, result.error, result.facts.false_condition) == (False, None, "quick")


@pytest.mark.parametrize(
    ("policy", "error", "excluded"),
    [
        pytest.param(
            "Fail",
            "failed to decode object",
            False,
            id="MAT-26: unusable inputs fail the whole evaluation; Fail rejects",
        ),
        pytest.param("Ignore", None, True, id="MAT-26: unusable inputs under Ignore skip the backend"),
    ],
)
def test_unusable_inputs(policy: FailurePolicy, error: str | None, excluded: bool) -> None:
    """MAT-26: an object that is not JSON makes the evaluation as a whole fail."""
    a = attrs("CREATE", object=msgspec.Raw(b"{not json"))
    result = run([("a", "false"), ("b", "object == null")], policy, a)
    assert result.matches is False
    assert (result.error is None) == (error is None)
    assert (result.error or "").startswith(error or "")
    assert (result.facts.excluded, result.facts.evaluation_errors) == (excluded, 0)


def test_objects_decoded_only_when_named() -> None:
    """Objects are decoded for CEL only when an expression names them (request-only conditions run)."""
    a = attrs("CREATE", object=msgspec.Raw(b"{not json"))
    result = run([("ns", 'request.namespace == "ns"')], "Fail", a)
    assert (result.matches, result.error) == (True, None)


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        pytest.param(["a"], "a", id="MAT-28: one error is its own text"),
        pytest.param(["a", "b"], "[a, b]", id="MAT-28: two errors are bracketed in order"),
        pytest.param(["a", "b", "a"], "[a, b]", id="MAT-28: duplicates appear once, first position kept"),
        pytest.param(["a", "a"], "a", id="MAT-28: a single distinct text has no brackets"),
    ],
)
def test_aggregate(messages: list[str], expected: str) -> None:
    """MAT-28: upstream's aggregate joining of error texts."""
    assert aggregate(messages) == expected
