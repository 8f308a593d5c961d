"""Rule matching (MAT-03..08), with upstream's rules_test.go tables ported as data."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.model import Rule
from gateway.config.plan import PlanSet
from gateway.matching.rules import rule_matches, rules_match
from tests.matching_support import attrs, hook, rule

# --- upstream predicates/rules/rules_test.go, as data ---------------------------------------------
# Each upstream case tests one sub-predicate; here the other fields are wildcards, so the whole rule
# decides exactly as that sub-predicate does. Attributes: (group, version, resource, subresource,
# operation, namespaced?) — upstream's a()/namespacedAttributes() use namespace "ns",
# clusterScopedAttributes() uses "".

NS, CL = "ns", ""
UPSTREAM: list[tuple[str, str, str, Rule, list[tuple[tuple[str, str, str, str, str, str], bool]]]] = [
    ("MAT-05", "TestGroup", "wildcard", rule(groups=("*",)), [(("g", "v", "r", "", "CREATE", NS), True)]),
    (
        "MAT-05",
        "TestGroup",
        "exact",
        rule(groups=("g1", "g2")),
        [
            (("g1", "v", "r", "", "CREATE", NS), True),
            (("g2", "v2", "r3", "", "CREATE", NS), True),
            (("g3", "v", "r", "", "CREATE", NS), False),
            (("g4", "v", "r", "", "CREATE", NS), False),
        ],
    ),
    ("MAT-05", "TestVersion", "wildcard", rule(versions=("*",)), [(("g", "v", "r", "", "CREATE", NS), True)]),
    (
        "MAT-05",
        "TestVersion",
        "exact",
        rule(versions=("v1", "v2")),
        [
            (("g1", "v1", "r", "", "CREATE", NS), True),
            (("g2", "v2", "r", "", "CREATE", NS), True),
            (("g1", "v3", "r", "", "CREATE", NS), False),
            (("g2", "v4", "r", "", "CREATE", NS), False),
        ],
    ),
    (
        "MAT-04",
        "TestOperation",
        "wildcard",
        rule(operations=("*",)),
        [((("g", "v", "r", "", op, NS)), True) for op in ("CREATE", "UPDATE", "DELETE", "CONNECT")],
    ),
    *[
        (
            "MAT-04",
            "TestOperation",
            op.lower(),
            rule(operations=(op,)),
            [
                (("g", "v", "r", "", other, NS), other == op)
                for other in ("CREATE", "UPDATE", "DELETE", "CONNECT")
            ],
        )
        for op in ("CREATE", "UPDATE", "DELETE", "CONNECT")
    ],
    (
        "MAT-04",
        "TestOperation",
        "multiple",
        rule(operations=("UPDATE", "DELETE")),
        [
            (("g", "v", "r", "", "UPDATE", NS), True),
            (("g", "v", "r", "", "DELETE", NS), True),
            (("g", "v", "r", "", "CREATE", NS), False),
            (("g", "v", "r", "", "CONNECT", NS), False),
        ],
    ),
    (
        "MAT-06",
        "TestResource",
        "no subresources",
        rule(resources=("*",)),
        [
            (("g", "v", "r", "", "CREATE", NS), True),
            (("2", "v", "r2", "", "CREATE", NS), True),
            (("g", "v", "r", "exec", "CREATE", NS), False),
            (("2", "v", "r2", "proxy", "CREATE", NS), False),
        ],
    ),
    (
        "MAT-07",
        "TestResource",
        "r & subresources",
        rule(resources=("r/*",)),
        [
            (("g", "v", "r", "", "CREATE", NS), True),
            (("g", "v", "r", "exec", "CREATE", NS), True),
            (("2", "v", "r2", "", "CREATE", NS), False),
            (("2", "v", "r2", "proxy", "CREATE", NS), False),
        ],
    ),
    (
        "MAT-06",
        "TestResource",
        "r & subresources or r2",
        rule(resources=("r/*", "r2")),
        [
            (("g", "v", "r", "", "CREATE", NS), True),
            (("g", "v", "r", "exec", "CREATE", NS), True),
            (("2", "v", "r2", "", "CREATE", NS), True),
            (("2", "v", "r2", "proxy", "CREATE", NS), False),
        ],
    ),
    (
        "MAT-06",
        "TestResource",
        "proxy or exec",
        rule(resources=("*/proxy", "*/exec")),
        [
            (("g", "v", "r", "exec", "CREATE", NS), True),
            (("2", "v", "r2", "proxy", "CREATE", NS), True),
            (("2", "v", "r3", "proxy", "CREATE", NS), True),
            (("g", "v", "r", "", "CREATE", NS), False),
            (("2", "v", "r2", "", "CREATE", NS), False),
            (("2", "v", "r4", "scale", "CREATE", NS), False),
        ],
    ),
    (
        "MAT-08",
        "TestScope",
        "cluster scope",
        rule(scope="Cluster"),
        [
            (("g", "v", "r", "", "CREATE", CL), True),
            (("g", "v", "r", "exec", "CREATE", CL), True),
            (("", "v1", "namespaces", "", "CREATE", CL), True),
            (("", "v1", "namespaces", "finalize", "CREATE", CL), True),
            (("", "v1", "namespaces", "", "CREATE", NS), True),
            (("", "v1", "namespaces", "finalize", "CREATE", NS), True),
            (("g", "v", "r", "", "CREATE", NS), False),
            (("g", "v", "r", "exec", "CREATE", NS), False),
        ],
    ),
    (
        "MAT-08",
        "TestScope",
        "namespace scope",
        rule(scope="Namespaced"),
        [
            (("g", "v", "r", "", "CREATE", NS), True),
            (("g", "v", "r", "exec", "CREATE", NS), True),
            (("", "v1", "namespaces", "", "CREATE", CL), False),
            (("", "v1", "namespaces", "finalize", "CREATE", CL), False),
            (("", "v1", "namespaces", "", "CREATE", NS), False),
            (("", "v1", "namespaces", "finalize", "CREATE", NS), False),
            (("g", "v", "r", "", "CREATE", CL), False),
            (("g", "v", "r", "exec", "CREATE", CL), False),
        ],
    ),
    (
        "MAT-08",
        "TestScope",
        "all scopes",
        rule(scope="*"),
        [
            (("g", "v", "r", "", "CREATE", NS), True),
            (("g", "v", "r", "exec", "CREATE", NS), True),
            (("g", "v", "r", "", "CREATE", CL), True),
            (("g", "v", "r", "exec", "CREATE", CL), True),
            (("", "v1", "namespaces", "", "CREATE", CL), True),
            (("", "v1", "namespaces", "finalize", "CREATE", CL), True),
            (("", "v1", "namespaces", "", "CREATE", NS), True),
            (("", "v1", "namespaces", "finalize", "CREATE", NS), True),
        ],
    ),
]


def _describe(row: tuple[str, str, str, str, str, str]) -> str:
    group, version, resource, sub, op, namespace = row
    res = f"{group}/{version}/{resource}" + (f"/{sub}" if sub else "")
    return f"{op} {res} {'in namespace ns' if namespace else 'cluster-scoped'}"


UPSTREAM_ROWS = [
    pytest.param(
        r,
        row,
        expected,
        id=f"{sid}: upstream {test} {case!r}: {_describe(row)} {'matches' if expected else 'does not match'}",
    )
    for sid, test, case, r, rows in UPSTREAM
    for row, expected in rows
]


@pytest.mark.parametrize(("r", "row", "expected"), UPSTREAM_ROWS)
def test_upstream_rules_table(r: Rule, row: tuple[str, str, str, str, str, str], expected: bool) -> None:
    """Each case of upstream's rules_test.go decides the same way here."""
    group, version, resource, sub, op, namespace = row
    a = attrs(op, group, version, resource, sub, namespace=namespace)
    assert rule_matches(r, a) is expected
    assert rules_match((r,), a) is expected


# --- MAT-03: any rule; all fields ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("rules", "expected"),
    [
        pytest.param((), False, id="MAT-03: an empty rules list never matches"),
        pytest.param(
            (rule(resources=("deployments",)), rule(resources=("pods",))),
            True,
            id="MAT-03: the second of two rules matching is enough",
        ),
        pytest.param(
            (rule(operations=("UPDATE",), resources=("pods",)), rule(groups=("apps",))),
            False,
            id="MAT-03: no rule matching in every field (operation in one, group in the other) is no match",
        ),
        pytest.param(
            (
                rule(
                    operations=("CREATE",),
                    groups=("",),
                    versions=("v1",),
                    resources=("pods",),
                    scope="Namespaced",
                ),
            ),
            True,
            id="MAT-03: a rule matching in scope, operation, group, version and resource matches",
        ),
        pytest.param(
            (
                rule(
                    operations=("CREATE",),
                    groups=("",),
                    versions=("v1",),
                    resources=("pods",),
                    scope="Cluster",
                ),
            ),
            False,
            id="MAT-03: a rule differing only in scope does not match",
        ),
    ],
)
def test_any_rule_all_fields(rules: tuple[Rule, ...], expected: bool) -> None:
    """MAT-03: at least one rule, and every field of that rule, must match."""
    assert rules_match(rules, attrs("CREATE", "", "v1", "pods")) is expected


@pytest.mark.parametrize(
    ("r", "operation", "group", "version", "expected"),
    [
        pytest.param(
            rule(operations=("create",)),
            "CREATE",
            "",
            "v1",
            False,
            id="MAT-04: operations compare case-sensitively",
        ),
        pytest.param(rule(groups=("",)), "CREATE", "", "v1", True, id='MAT-05: "" is the core group'),
        pytest.param(
            rule(groups=("",)), "CREATE", "apps", "v1", False, id="MAT-05: the core group does not match apps"
        ),
        pytest.param(
            rule(groups=("app",)), "CREATE", "apps", "v1", False, id="MAT-05: no prefix matching of groups"
        ),
        pytest.param(
            rule(groups=("Apps",)),
            "CREATE",
            "apps",
            "v1",
            False,
            id="MAT-05: groups compare case-sensitively",
        ),
        pytest.param(
            rule(versions=("v1",)),
            "CREATE",
            "",
            "v1beta1",
            False,
            id="MAT-05: no prefix matching of versions",
        ),
        pytest.param(
            rule(versions=("V1",)), "CREATE", "", "v1", False, id="MAT-05: versions compare case-sensitively"
        ),
    ],
)
def test_exact_strings(r: Rule, operation: str, group: str, version: str, expected: bool) -> None:
    """MAT-04/05: plain case-sensitive equality or `*`."""
    assert rules_match((r,), attrs(operation, group, version, "pods")) is expected


# --- MAT-06/07: resource entries ------------------------------------------------------------------

MAT06 = {  # the spec's table: entry -> (pods, pods/status, deployments/scale)
    "*": (True, False, False),
    "*/*": (True, True, True),
    "pods": (True, False, False),
    "pods/*": (True, True, False),
    "pods/status": (False, True, False),
    "*/status": (False, True, False),
    "*/scale": (False, False, True),
}
REQUESTS = (("pods", ""), ("pods", "status"), ("deployments", "scale"))


@pytest.mark.parametrize(
    ("entry", "resource", "sub", "expected"),
    [
        pytest.param(
            entry,
            res,
            sub,
            verdicts[i],
            id=f"MAT-06: entry {entry!r} {'matches' if verdicts[i] else 'does not match'} {res}/{sub or '-'}",
        )
        for entry, verdicts in MAT06.items()
        for i, (res, sub) in enumerate(REQUESTS)
    ],
)
def test_resource_entries(entry: str, resource: str, sub: str, expected: bool) -> None:
    """MAT-06: split at the first slash; `*` on either side is a wildcard; no slash means no subresource."""
    assert rules_match((rule(resources=(entry,)),), attrs("CREATE", "", "v1", resource, sub)) is expected


@pytest.mark.parametrize(
    ("entry", "resource", "sub", "expected"),
    [
        pytest.param("pods/*", "pods", "", True, id="MAT-07: pods/* matches the main pods resource (quirk)"),
        pytest.param("*", "pods", "exec", False, id="MAT-07: * never matches a subresource request"),
        pytest.param("pods/log/x", "pods", "log/x", True, id="MAT-06: only the first slash splits"),
        pytest.param("pods/log", "pods", "log/x", False, id="MAT-06: the subresource compares whole"),
    ],
)
def test_subresource_quirks(entry: str, resource: str, sub: str, expected: bool) -> None:
    """MAT-07: sub `*` also accepts the empty subresource; `*` alone never matches a subresource."""
    assert rules_match((rule(resources=(entry,)),), attrs("CREATE", "", "v1", resource, sub)) is expected


@pytest.mark.parametrize(
    ("scope", "group", "version", "resource", "sub", "namespace", "expected"),
    [
        pytest.param(
            "Cluster",
            "",
            "v1",
            "namespaces",
            "status",
            "ns1",
            True,
            id="MAT-08: namespaces/status takes the Namespace's cluster scope",
        ),
        pytest.param(
            "Namespaced",
            "",
            "v1",
            "pods",
            "status",
            "ns1",
            True,
            id="MAT-08: pods/status takes the pod's namespaced scope",
        ),
        pytest.param(
            "Cluster",
            "",
            "v1",
            "nodes",
            "",
            "",
            True,
            id="MAT-08: Cluster matches a request with empty namespace",
        ),
        pytest.param(
            "Namespaced",
            "",
            "v1",
            "nodes",
            "",
            "",
            False,
            id="MAT-08: Namespaced never matches a request with empty namespace",
        ),
        pytest.param(
            "Cluster",
            "apps",
            "v1",
            "namespaces",
            "",
            "ns1",
            False,
            id="MAT-08: only core v1 namespaces is the Namespace object for scope",
        ),
        pytest.param(
            "Cluster",
            "",
            "v2",
            "namespaces",
            "",
            "ns1",
            False,
            id="MAT-08: core v2 namespaces is not the Namespace object either",
        ),
        pytest.param(
            "Namespaced",
            "",
            "v1",
            "namespaces",
            "",
            "ns1",
            False,
            id="MAT-08: a Namespace carrying its own name as namespace is still cluster-scoped",
        ),
    ],
)
def test_scope(
    scope: str, group: str, version: str, resource: str, sub: str, namespace: str, expected: bool
) -> None:
    """MAT-08: Namespace objects and empty-namespace requests are cluster-scoped; subresources inherit."""
    r = rule(scope=scope)  # type: ignore[arg-type]
    assert rules_match((r,), attrs("UPDATE", group, version, resource, sub, namespace=namespace)) is expected


# --- property: the compiled, memoised matcher equals a plain reading of the spec -------------------

OPS = ("CREATE", "UPDATE", "DELETE", "CONNECT")
GROUPS = ("", "apps", "g")
VERSIONS = ("v1", "v2")
RESOURCES = ("pods", "namespaces", "deployments")
SUBS = ("", "status", "scale")
ENTRIES = (
    "*",
    "*/*",
    "pods",
    "pods/*",
    "pods/status",
    "*/status",
    "*/scale",
    "namespaces",
    "deployments/scale",
)


def _list_or_star(values: tuple[str, ...]) -> st.SearchStrategy[tuple[str, ...]]:
    return st.one_of(
        st.just(("*",)),
        st.lists(st.sampled_from(values), min_size=1, max_size=3, unique=True).map(tuple),
    )


rules_strategy = st.builds(
    Rule,
    operations=_list_or_star(OPS),
    api_groups=_list_or_star(GROUPS),
    api_versions=_list_or_star(VERSIONS),
    resources=st.lists(st.sampled_from(ENTRIES), min_size=1, max_size=3, unique=True).map(tuple),
    scope=st.sampled_from(("*", "Cluster", "Namespaced")),
)
request_strategy = st.tuples(
    st.sampled_from(OPS),
    st.sampled_from(GROUPS),
    st.sampled_from(VERSIONS),
    st.sampled_from(RESOURCES),
    st.sampled_from(SUBS),
    st.sampled_from(("", "ns")),
)


def reference(r: Rule, op: str, group: str, version: str, resource: str, sub: str, namespace: str) -> bool:
    """MAT-03..08 read literally."""
    cluster = namespace == "" or (group, version, resource) == ("", "v1", "namespaces")
    if r.scope == "Cluster" and not cluster:
        return False
    if r.scope == "Namespaced" and cluster:
        return False
    if "*" not in r.operations and op not in r.operations:
        return False
    if "*" not in r.api_groups and group not in r.api_groups:
        return False
    if "*" not in r.api_versions and version not in r.api_versions:
        return False
    for entry in r.resources:
        res, sub_pattern = entry.split("/", 1) if "/" in entry else (entry, "")
        if res in ("*", resource) and sub_pattern in ("*", sub):
            return True
    return False


@given(st.lists(rules_strategy, max_size=3).map(tuple), st.lists(request_strategy, min_size=1, max_size=6))
def test_matcher_equals_reference(rules: tuple[Rule, ...], requests: list[tuple[str, ...]]) -> None:
    """MAT-03..08: for any rules and requests, the memoised matcher agrees with the literal reading."""
    for op, group, version, resource, sub, namespace in requests:
        a = attrs(op, group, version, resource, sub, namespace=namespace)
        expected = any(reference(r, op, group, version, resource, sub, namespace) for r in rules)
        assert rules_match(rules, a) is expected
        assert rules_match(rules, a) is expected  # second time from the memo


@given(
    st.lists(st.lists(rules_strategy, max_size=3).map(tuple), max_size=6),
    st.lists(request_strategy, min_size=1),
)
def test_snapshot_index_finds_exactly_the_backends_whose_rules_match(
    backends: list[tuple[Rule, ...]], requests: list[tuple[str, ...]]
) -> None:
    """MAT-03..08: the Snapshot's plan index (by operation, group, resource) misses no backend and
    adds none, asked twice per request (the second answer from its memo)."""
    plans = PlanSet([hook(f"h{i}.example.com", rules=rules, index=i) for i, rules in enumerate(backends)])
    for op, group, version, resource, sub, namespace in requests:
        a = attrs(op, group, version, resource, sub, namespace=namespace)
        expected = [
            i
            for i, rules in enumerate(backends)
            if any(reference(r, op, group, version, resource, sub, namespace) for r in rules)
        ]
        for _ in range(2):
            found = plans.candidates(a)
            assert all(direct for _, direct in found)
            assert [plan.hook.index for plan, _ in found] == expected
