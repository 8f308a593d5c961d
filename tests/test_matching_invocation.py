"""should_call: upstream's predicate order and error precedence (MAT-01/02), Equivalent without
conversion (MAT-10), match-condition answers (MAT-28), exemptions (MAT-31/32) and not-ready (MAT-33)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.admission import (
    AdmissionAttributes,
    GroupVersionKind,
    GroupVersionResource,
    Status,
    StatusCause,
    StatusDetails,
)
from gateway.config.model import Webhook
from gateway.config.selectors import EVERYTHING, LabelSelector
from gateway.errors import MatchingError
from gateway.matching import (
    Call,
    CallFailure,
    MatchDecision,
    NamespaceLabels,
    NamespaceLookupFailed,
    NamespaceNotFound,
    Refuse,
    Skip,
    decide_all,
    forbidden_message,
    is_exempt,
    matching_error_status,
    not_ready_error,
    should_call,
)
from gateway.matching.invocation import Equivalents
from gateway.matching.namespace import match_namespace_selector
from gateway.matching.objects import match_object_selector
from gateway.matching.rules import rules_match
from tests.matching_support import attrs, broken_selector, conditions, hook, obj, raw, rule, selector

POD = attrs("CREATE", namespace="ns", name="web-1", object=obj({"app": "web"}, name="web-1"))
PODS_ONLY = (rule(resources=("pods",)),)
DEPLOYMENTS_ONLY = (rule(resources=("deployments",)),)
TEAM_A = selector({"team": "a"})
APP_DB = selector({"app": "db"})
NOT_FOUND = NamespaceNotFound("ns")
ERR_404 = ("404", 'namespaces "ns" not found')
BROKEN = 'values[0][env]: Invalid value: "a b": bad'
ERR_500_OBJ = ("500", f"Internal error occurred: {BROKEN}")


def summary(decision: MatchDecision) -> tuple[str, ...]:
    """A decision as comparable plain data."""
    if isinstance(decision, Skip):
        return ("skip", decision.reason)
    if isinstance(decision, Call):
        return ("call",)
    if isinstance(decision, CallFailure):
        return ("call-failure", str(decision.error.status_code), decision.error.reason)
    return ("refuse", str(decision.error.code), decision.error.message)


@pytest.mark.parametrize(
    ("h", "labels", "expected"),
    [
        pytest.param(
            hook(rules=DEPLOYMENTS_ONLY, namespace_selector=TEAM_A),
            NOT_FOUND,
            ("skip", "rules"),
            id="MAT-02: a missing namespace is silent when the rules do not match",
        ),
        pytest.param(
            hook(rules=DEPLOYMENTS_ONLY, object_selector=broken_selector(BROKEN)),
            {},
            ("skip", "rules"),
            id="MAT-02: a broken objectSelector is silent when the rules do not match",
        ),
        pytest.param(
            hook(rules=PODS_ONLY, namespace_selector=TEAM_A),
            NOT_FOUND,
            ("refuse", *ERR_404),
            id="MAT-02/16: with matching rules a missing namespace answers the review with 404",
        ),
        pytest.param(
            hook(rules=PODS_ONLY, namespace_selector=TEAM_A, failure_policy="Ignore"),
            NOT_FOUND,
            ("refuse", *ERR_404),
            id="MAT-16: the 404 is not governed by failurePolicy Ignore",
        ),
        pytest.param(
            hook(namespace_selector=TEAM_A),
            NamespaceLookupFailed("timeout"),
            ("refuse", "500", "Internal error occurred: timeout"),
            id="MAT-17: a failed lookup answers with 500",
        ),
        pytest.param(
            hook(namespace_selector=TEAM_A, object_selector=APP_DB),
            NOT_FOUND,
            ("skip", "objectSelector"),
            id="MAT-02: a cleanly non-matching objectSelector skips despite a namespace error",
        ),
        pytest.param(
            hook(namespace_selector=TEAM_A, object_selector=broken_selector(BROKEN)),
            NOT_FOUND,
            ("refuse", *ERR_404),
            id="MAT-02: the namespaceSelector error wins over the objectSelector error",
        ),
        pytest.param(
            hook(namespace_selector=TEAM_A, object_selector=broken_selector(BROKEN)),
            {"team": "b"},
            ("skip", "namespaceSelector"),
            id="MAT-02: a cleanly non-matching namespaceSelector skips despite an objectSelector error",
        ),
        pytest.param(
            hook(namespace_selector=TEAM_A, object_selector=broken_selector(BROKEN)),
            {"team": "a"},
            ("refuse", *ERR_500_OBJ),
            id="MAT-23: a broken objectSelector answers with 500 when everything else matches",
        ),
        pytest.param(
            hook(namespace_selector=broken_selector(BROKEN)),
            {},
            ("refuse", *ERR_500_OBJ),
            id="MAT-23: a broken namespaceSelector answers with 500 when the rules match",
        ),
        pytest.param(
            hook(namespace_selector=EVERYTHING),
            NOT_FOUND,
            ("call",),
            id="MAT-12: an empty namespaceSelector never consults the failed lookup",
        ),
        pytest.param(
            hook(namespace_selector=TEAM_A, match_conditions=conditions(("no", "false"))),
            NOT_FOUND,
            ("refuse", *ERR_404),
            id="MAT-01: selector errors come before matchConditions",
        ),
        pytest.param(
            hook(namespace_selector=TEAM_A, object_selector=selector({"app": "web"})),
            {"team": "a"},
            ("call",),
            id="MAT-01: rules and both selectors matching calls",
        ),
        pytest.param(
            hook(rules=()), {}, ("skip", "rules"), id="MAT-03: a backend without rules is never called"
        ),
    ],
)
def test_precedence(h: Webhook, labels: NamespaceLabels, expected: tuple[str, ...]) -> None:
    """MAT-01/02: skip, call, or which error answers the review, exactly as upstream's order gives."""
    assert summary(should_call(h, POD, labels)) == expected


DEPLOYMENT = attrs(
    "CREATE", "extensions", "v1beta1", "deployments", namespace="ns", name="d", object=obj({}, name="d")
)
APPS_V1 = GroupVersionResource(group="apps", version="v1", resource="deployments")
EXT_V1BETA1 = GroupVersionResource(group="extensions", version="v1beta1", resource="deployments")
TABLE = {EXT_V1BETA1: {APPS_V1, EXT_V1BETA1}, APPS_V1: {APPS_V1, EXT_V1BETA1}}
APPS_RULE = (rule(groups=("apps",), versions=("v1",), resources=("deployments",)),)
REASON = (
    "matchPolicy Equivalent requires converting extensions/v1beta1/deployments to apps/v1/deployments,"
    " which the gateway cannot do"
)


@pytest.mark.parametrize(
    ("h", "table", "labels", "expected"),
    [
        pytest.param(
            hook(rules=APPS_RULE, match_policy="Equivalent"),
            TABLE,
            {},
            ("call-failure", "500", REASON),
            id="MAT-10: a match only through the equivalence table is a call error, not a call",
        ),
        pytest.param(
            hook(rules=APPS_RULE, match_policy="Exact"),
            TABLE,
            {},
            ("skip", "rules"),
            id="MAT-10: matchPolicy Exact never uses the table",
        ),
        pytest.param(
            hook(rules=APPS_RULE, match_policy="Equivalent"),
            None,
            {},
            ("skip", "rules"),
            id="MAT-10/GW-02: without a table Equivalent behaves as Exact",
        ),
        pytest.param(
            hook(rules=(rule(groups=("extensions",)),), match_policy="Equivalent"),
            TABLE,
            {},
            ("call",),
            id="MAT-10: an exact match is called normally",
        ),
        pytest.param(
            hook(rules=APPS_RULE, match_policy="Equivalent", namespace_selector=TEAM_A),
            TABLE,
            NOT_FOUND,
            ("refuse", *ERR_404),
            id="MAT-02/10: matching through the table still surfaces selector errors first",
        ),
        pytest.param(
            hook(rules=APPS_RULE, match_policy="Equivalent", object_selector=APP_DB),
            TABLE,
            {},
            ("skip", "objectSelector"),
            id="MAT-10: a non-matching selector skips before the fail-safe",
        ),
        pytest.param(
            hook(rules=(rule(groups=("batch",)),), match_policy="Equivalent"),
            TABLE,
            {},
            ("skip", "rules"),
            id="MAT-09: equivalents that match no rule skip",
        ),
    ],
)
def test_equivalent(
    h: Webhook, table: Equivalents | None, labels: NamespaceLabels, expected: tuple[str, ...]
) -> None:
    """MAT-09/10: an unconverted object never goes to a backend registered for another version."""
    assert summary(should_call(h, DEPLOYMENT, labels, equivalents=table)) == expected


def test_equivalent_error_is_a_call_error() -> None:
    """MAT-10/FPT-12: the fail-safe is a CallingWebhookError with status code 500 for metrics."""
    decision = should_call(
        hook(rules=APPS_RULE, match_policy="Equivalent"), DEPLOYMENT, {}, equivalents=TABLE
    )
    assert isinstance(decision, CallFailure)
    assert (decision.error.status_code, decision.error.reason) == (500, REASON)


MISSING = "object.metadata.missing == 1"


@pytest.mark.parametrize(
    ("a", "message", "details"),
    [
        pytest.param(
            POD,
            f"pods \"web-1\" is forbidden: expression '{MISSING}' resulted in error: no such key: missing",
            {"name": "web-1", "group": "", "kind": "pods"},
            id="MAT-28: core resources have no group suffix and the name is quoted",
        ),
        pytest.param(
            attrs("CREATE", "apps", "v1", "deployments", name="", object=obj({})),
            f"deployments.apps is forbidden: expression '{MISSING}' resulted in error: no such key: missing",
            {"name": "", "group": "apps", "kind": "deployments"},
            id="MAT-28: an empty request.name is left out; the group follows the resource",
        ),
    ],
)
def test_condition_error_is_forbidden(a: AdmissionAttributes, message: str, details: dict[str, str]) -> None:
    """MAT-26/28: under Fail an erroring condition answers the review with 403 Forbidden."""
    decision = should_call(hook(match_conditions=conditions(("m", MISSING))), a, {})
    assert isinstance(decision, Refuse)
    assert (decision.error.code, decision.error.status_reason) == (403, "Forbidden")
    assert (decision.error.message, decision.error.details) == (message, details)
    assert decision.conditions is not None
    assert decision.conditions.evaluation_errors == 1


@pytest.mark.parametrize(
    ("h", "expected", "excluded"),
    [
        pytest.param(
            hook(match_conditions=conditions(("web", 'object.metadata.labels.app == "web"'))),
            ("call",),
            False,
            id="MAT-24: conditions all true call the backend",
        ),
        pytest.param(
            hook(match_conditions=conditions(("db", 'object.metadata.labels.app == "db"'))),
            ("skip", "matchConditions"),
            True,
            id="MAT-26: a false condition skips the backend",
        ),
        pytest.param(
            hook(failure_policy="Ignore", match_conditions=conditions(("m", MISSING))),
            ("skip", "matchConditions"),
            True,
            id="MAT-26/30: an error under Ignore skips and is an exclusion",
        ),
    ],
)
def test_condition_facts(h: Webhook, expected: tuple[str, ...], excluded: bool) -> None:
    """MAT-30: decisions that evaluated conditions carry the facts metrics count."""
    decision = should_call(h, POD, {})
    assert summary(decision) == expected
    assert isinstance(decision, Call | Skip)
    assert decision.conditions is not None
    assert decision.conditions.excluded is excluded


def test_objects_decoded_only_for_conditions() -> None:
    """Undecodable objects matter only to backends with conditions (objects decoded only for CEL)."""
    a = attrs("CREATE", object=msgspec.Raw(b"{not json"))
    assert summary(should_call(hook(), a, {})) == ("call",)
    decision = should_call(hook(match_conditions=conditions(("t", "object != null"))), a, {})
    assert isinstance(decision, Refuse)
    assert decision.error.message.startswith('pods "name" is forbidden: failed to decode object')


def test_decide_all_in_order() -> None:
    """VAL-01: one decision per backend, in configuration order, equal to should_call's."""
    hooks = [
        hook("a.example.com", rules=DEPLOYMENTS_ONLY),
        hook("b.example.com", namespace_selector=TEAM_A),
        hook("c.example.com", match_conditions=conditions(("t", "true"))),
        hook("d.example.com", object_selector=APP_DB),
    ]
    decisions = decide_all(hooks, POD, {"team": "a"})
    assert [summary(d) for d in decisions] == [summary(should_call(h, POD, {"team": "a"})) for h in hooks]
    assert [summary(d) for d in decisions] == [
        ("skip", "rules"),
        ("call",),
        ("call",),
        ("skip", "objectSelector"),
    ]


# --- MAT-31/32 ------------------------------------------------------------------------------------


def review(group: str, version: str, resource: str, kind: str) -> AdmissionAttributes:
    return attrs(
        "CREATE", group, version, resource, kind=GroupVersionKind(group=group, version=version, kind=kind)
    )


@pytest.mark.parametrize(
    ("a", "exclude_virtual", "expected"),
    [
        *[
            pytest.param(
                review("admissionregistration.k8s.io", "v1", kind.lower() + "s", kind),
                True,
                True,
                id=f"MAT-31: {kind} reviews never reach a backend",
            )
            for kind in (
                "ValidatingWebhookConfiguration",
                "MutatingWebhookConfiguration",
                "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding",
                "MutatingAdmissionPolicy",
                "MutatingAdmissionPolicyBinding",
            )
        ],
        pytest.param(
            review("admissionregistration.k8s.io", "v1beta1", "x", "ValidatingWebhookConfiguration"),
            True,
            True,
            id="MAT-31: any version of the group",
        ),
        pytest.param(
            review("example.com", "v1", "x", "ValidatingWebhookConfiguration"),
            True,
            False,
            id="MAT-31: the same kind in another group is not exempt",
        ),
        *[
            pytest.param(
                review(group, "v1", res, "X"), True, True, id=f"MAT-32: {group} {res} never reach a backend"
            )
            for group, res in (
                ("authentication.k8s.io", "tokenreviews"),
                ("authentication.k8s.io", "selfsubjectreviews"),
                ("authorization.k8s.io", "subjectaccessreviews"),
                ("authorization.k8s.io", "selfsubjectaccessreviews"),
                ("authorization.k8s.io", "localsubjectaccessreviews"),
                ("authorization.k8s.io", "selfsubjectrulesreviews"),
            )
        ],
        pytest.param(
            review("authorization.k8s.io", "v1", "subjectaccessreviews", "X"),
            False,
            False,
            id="MAT-32: excludeVirtualResources false lets them through",
        ),
        pytest.param(
            review("", "v1", "tokenreviews", "X"),
            True,
            False,
            id="MAT-32: only the authentication group's tokenreviews",
        ),
        pytest.param(POD, True, False, id="MAT-31/32: a pod is not exempt"),
    ],
)
def test_exempt(a: AdmissionAttributes, exclude_virtual: bool, expected: bool) -> None:
    """MAT-31/32: reviews answered allowed without consulting any backend."""
    assert is_exempt(a, exclude_virtual_resources=exclude_virtual) is expected


# --- MAT-33 ---------------------------------------------------------------------------------------

NOT_READY = "is forbidden: not yet ready to handle request"


@pytest.mark.parametrize(
    ("a", "message", "name"),
    [
        pytest.param(POD, f'pods "web-1" {NOT_READY}', "web-1", id="MAT-33: request.name first"),
        pytest.param(
            attrs("CREATE", name="", object=obj({}, name="from-meta")),
            f'pods "from-meta" {NOT_READY}',
            "from-meta",
            id="MAT-33: else the object's metadata.name",
        ),
        pytest.param(
            attrs("CREATE", name="", object=obj({}, generateName="web-")),
            f'pods "web-" {NOT_READY}',
            "web-",
            id="MAT-33: else metadata.generateName",
        ),
        pytest.param(
            attrs("CREATE", name="", object=obj({})),
            f'pods "Unknown" {NOT_READY}',
            "Unknown",
            id="MAT-33: else Unknown",
        ),
        pytest.param(
            attrs("DELETE", name="", object=None),
            f'pods "Unknown" {NOT_READY}',
            "Unknown",
            id="MAT-33: no object gives Unknown",
        ),
        pytest.param(
            attrs(
                "CONNECT",
                "",
                "v1",
                "pods",
                "exec",
                name="",
                object=raw({"kind": "PodExecOptions", "command": ["sh"]}),
            ),
            f'pods "Unknown/errorGettingName" {NOT_READY}',
            "Unknown/errorGettingName",
            id="MAT-33: an object without metadata gives Unknown/errorGettingName",
        ),
        pytest.param(
            attrs("CREATE", "apps", "v1", "deployments", name="d"),
            f'deployments.apps "d" {NOT_READY}',
            "d",
            id="MAT-33: the group follows the resource",
        ),
        pytest.param(
            attrs(
                "CREATE",
                name="",
                object=msgspec.Raw(
                    b'{"spec":' + b"[" * 5_000 + b"]" * 5_000 + b',"metadata":{"name":"deep"}}'
                ),
            ),
            f'pods "deep" {NOT_READY}',
            "deep",
            id="MAT-33: the name of an object nesting 5,000 levels is found like any other",
        ),
    ],
)
def test_not_ready(a: AdmissionAttributes, message: str, name: str) -> None:
    """MAT-33: 403 Forbidden with upstream's name fallbacks."""
    err = not_ready_error(a)
    assert (err.code, err.status_reason, err.message) == (403, "Forbidden", message)
    assert err.details == {"name": name, "group": a.resource.group, "kind": a.resource.resource}


def test_forbidden_message_uses_request_name() -> None:
    """MAT-28: forbidden_message names request.name only (no object fallbacks)."""
    a = attrs("CREATE", name="", object=obj({}, name="from-meta"))
    assert forbidden_message(a, "boom") == "pods is forbidden: boom"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        pytest.param(
            MatchingError(
                code=404,
                reason="NotFound",
                message='namespaces "x" not found',
                details={"name": "x", "kind": "namespaces"},
            ),
            Status(
                status="Failure",
                message='namespaces "x" not found',
                reason="NotFound",
                code=404,
                details=StatusDetails(name="x", kind="namespaces"),
            ),
            id="MAT-16/ERR-10: the 404 Status carries name and kind",
        ),
        pytest.param(
            MatchingError(code=500, reason="InternalError", message="Internal error occurred: timeout"),
            Status(
                status="Failure",
                message="Internal error occurred: timeout",
                reason="InternalError",
                code=500,
                details=StatusDetails(causes=[StatusCause(message="timeout")]),
            ),
            id="MAT-17/ERR-10: the 500 Status carries the cause like upstream's NewInternalError",
        ),
    ],
)
def test_matching_error_status(error: MatchingError, status: Status) -> None:
    """The Status a matching error answers the review with."""
    assert matching_error_status(error) == status


# --- property: the fast path equals upstream's ShouldCallHook order --------------------------------


def upstream_order(h: Webhook, a: AdmissionAttributes, labels: NamespaceLabels | None) -> tuple[str, ...]:
    """generic/webhook.go ShouldCallHook read literally (Exact policy, no conditions)."""
    ns = match_namespace_selector(h.namespace_selector, a, labels)
    if ns is False:
        return ("skip",)
    obj_result = match_object_selector(h.object_selector, a)
    if obj_result is False:
        return ("skip",)
    if not rules_match(h.rules, a):
        return ("skip",)
    if isinstance(ns, MatchingError):
        return ("refuse", str(ns.code), ns.message)
    if isinstance(obj_result, MatchingError):
        return ("refuse", str(obj_result.code), obj_result.message)
    return ("call",)


selectors_strategy = st.sampled_from(
    [
        EVERYTHING,
        selector({"team": "a"}),
        selector(None, ("team", "NotIn", ("a",))),
        selector({"team": "a"}, ("app", "Exists", ())),
        selector(None, ("app", "DoesNotExist", ())),
        broken_selector("ns broken"),
        LabelSelector(error="obj broken"),
    ]
)
rules_choice = st.sampled_from([(rule(),), PODS_ONLY, DEPLOYMENTS_ONLY, (rule(scope="Cluster"),), ()])
label_values = st.one_of(
    st.none(), st.dictionaries(st.sampled_from(["team", "app"]), st.sampled_from(["a", "b"]))
)
objects_strategy = st.one_of(
    st.none(),
    st.just(raw(None)),
    st.just(raw({"kind": "PodExecOptions"})),
    label_values.map(obj),
)
lookups = st.one_of(
    st.none(),
    st.just(NamespaceNotFound("ns")),
    st.just(NamespaceLookupFailed("boom")),
    st.dictionaries(st.sampled_from(["team", "app"]), st.sampled_from(["a", "b"])),
)
requests = st.builds(
    lambda op, resource, namespace, new, old: attrs(
        op, "", "v1", resource, namespace=namespace, object=new, old_object=old
    ),
    st.sampled_from(["CREATE", "UPDATE", "DELETE"]),
    st.sampled_from(["pods", "namespaces", "nodes"]),
    st.sampled_from(["", "ns"]),
    objects_strategy,
    objects_strategy,
)


@given(
    st.lists(st.tuples(rules_choice, selectors_strategy, selectors_strategy), min_size=1, max_size=4),
    requests,
    lookups,
)
def test_fast_path_equals_upstream_order(
    specs: list[tuple[tuple, LabelSelector, LabelSelector]],  # type: ignore[type-arg]
    a: AdmissionAttributes,
    labels: NamespaceLabels | None,
) -> None:
    """MAT-01/02: however predicates are reordered for speed, every outcome equals upstream's order."""
    hooks = [
        hook(f"h{i}.example.com", rules=r, namespace_selector=ns, object_selector=os)
        for i, (r, ns, os) in enumerate(specs)
    ]
    got = [summary(d) for d in decide_all(hooks, a, labels)]
    expected = [upstream_order(h, a, labels) for h in hooks]
    assert [g if g[0] != "skip" else ("skip",) for g in got] == expected
