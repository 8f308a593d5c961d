"""namespaceSelector (MAT-11..17, GW-01), objectSelector (MAT-18..20) and label selectors (MAT-21..23),
with upstream's predicates/namespace and predicates/object matcher tests ported as data."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.admission import AdmissionAttributes
from gateway.config.model import Webhook
from gateway.config.selectors import EVERYTHING, LabelSelector, Requirement
from gateway.errors import MatchingError
from gateway.matching.namespace import (
    NamespaceLabels,
    NamespaceLookupFailed,
    NamespaceNotFound,
    labels_from_map,
    match_namespace_selector,
    namespace_to_look_up,
)
from gateway.matching.objects import match_object_selector
from tests.matching_support import attrs, broken_selector, hook, obj, raw, rule, selector

RUNLEVEL_1 = {"runlevel": "1"}
RUNLEVEL_2 = {"runlevel": "2"}
STORED = {"1": RUNLEVEL_1}  # upstream's fakeNamespaceLister holds namespace "1" only


def resolve(
    a: AdmissionAttributes, store: Mapping[str, Mapping[str, str]] = STORED
) -> NamespaceLabels | None:
    """What a dispatcher does: look up the name matching asks for, once, in a label source."""
    name = namespace_to_look_up(a)
    return None if name is None else labels_from_map(store, name)


def runlevel_is(value: str) -> LabelSelector:
    return selector(None, ("runlevel", "In", (value,)))


# --- upstream predicates/namespace/matcher_test.go TestGetNamespaceLabels -------------------------


@pytest.mark.parametrize(
    ("a", "expected_runlevel"),
    [
        pytest.param(
            attrs("CREATE", "", "", "namespaces", namespace="", name="2", object=obj(RUNLEVEL_2, name="2")),
            "2",
            id=(
                "MAT-13: upstream 'request is for creating namespace, "
                "the labels should be from the object itself'"
            ),
        ),
        pytest.param(
            attrs("UPDATE", "", "", "namespaces", namespace="2", name="2", object=obj(RUNLEVEL_2, name="2")),
            "2",
            id=(
                "MAT-13: upstream 'request is for updating namespace, "
                "the labels should be from the new object'"
            ),
        ),
        pytest.param(
            attrs("DELETE", "", "", "namespaces", namespace="1", name="1", object=obj(RUNLEVEL_2, name="2")),
            "1",
            id="MAT-14: upstream 'request is for deleting namespace, the labels should be from the cache'",
        ),
        pytest.param(
            attrs("CREATE", "", "", "namespaces", "finalizers", namespace="1", name="mock-name"),
            "1",
            id="MAT-14: upstream 'request is for namespace/finalizer' uses the stored namespace",
        ),
        pytest.param(
            attrs("CREATE", "", "", "pods", namespace="1", name="mock-name"),
            "1",
            id="MAT-13: upstream 'request is for pod' uses the stored labels of request.namespace",
        ),
    ],
)
def test_upstream_namespace_labels(a: AdmissionAttributes, expected_runlevel: str) -> None:
    """The labels a namespaceSelector tests are the ones upstream's GetNamespaceLabels returns."""
    looked_up = resolve(a)
    assert match_namespace_selector(runlevel_is(expected_runlevel), a, looked_up) is True
    other = "2" if expected_runlevel == "1" else "1"
    assert match_namespace_selector(runlevel_is(other), a, looked_up) is False


def test_upstream_cluster_scoped_not_exempt() -> None:
    """MAT-11/12: upstream TestNotExemptClusterScopedResource — a node passes an empty selector."""
    a = attrs("CREATE", "", "v1", "nodes", namespace="", name="mock-name")
    assert match_namespace_selector(EVERYTHING, a, None) is True


# --- MAT-11..17 -----------------------------------------------------------------------------------

NEVER = selector({"never": "true"})


@pytest.mark.parametrize(
    ("sel", "a", "looked_up", "expected"),
    [
        pytest.param(
            NEVER,
            attrs("CREATE", "", "v1", "nodes", namespace=""),
            None,
            True,
            id="MAT-11: a cluster-scoped node passes a selector that matches nothing",
        ),
        pytest.param(
            broken_selector(),
            attrs("CREATE", "", "v1", "nodes", namespace=""),
            None,
            True,
            id="MAT-11: the exemption comes before building the selector, so a broken one does not matter",
        ),
        pytest.param(
            NEVER,
            attrs("CREATE", "", "v1", "namespaces", namespace="", name="x", object=obj({"never": "true"})),
            None,
            True,
            id="MAT-11: a Namespace with empty request.namespace is not exempt (its own labels are tested)",
        ),
        pytest.param(
            EVERYTHING,
            attrs("CREATE", namespace="gone"),
            NamespaceNotFound("gone"),
            True,
            id="MAT-12: an empty selector passes without consulting a failed lookup",
        ),
        pytest.param(
            EVERYTHING,
            attrs("CREATE", namespace="ns"),
            None,
            True,
            id="MAT-12: an empty selector passes when nothing was looked up",
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs("CREATE", namespace="ns"),
            {"team": "a"},
            True,
            id="MAT-13: a pod is tested against its namespace's stored labels (match)",
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs("CREATE", namespace="ns"),
            {"team": "b"},
            False,
            id="MAT-13: a pod is tested against its namespace's stored labels (no match)",
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs("UPDATE", "", "v1", "namespaces", namespace="ns", object=obj({"team": "a"})),
            {"team": "b"},
            True,
            id="MAT-13: Namespace UPDATE tests the new object's labels, not the stored ones",
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs("CREATE", "apps", "v1", "namespaces", namespace="", object=obj({"team": "a"})),
            None,
            True,
            id="MAT-14: any group's 'namespaces' resource counts as a Namespace (object labels used)",
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs("UPDATE", "", "v1", "namespaces", "status", namespace="ns", object=obj({"team": "b"})),
            {"team": "a"},
            True,
            id="MAT-14: namespaces/status uses the stored namespace, not the request body",
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs("DELETE", "", "v1", "namespaces", namespace="ns", old_object=obj({"team": "a"})),
            NamespaceNotFound("ns"),
            True,
            id="MAT-15: Namespace DELETE uses oldObject labels without a lookup",
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs(
                "UPDATE",
                "",
                "v1",
                "namespaces",
                "finalize",
                namespace="ns",
                object=obj({"team": "a"}),
                old_object=obj({"team": "b"}),
            ),
            None,
            False,
            id="MAT-15: a namespace subresource uses oldObject labels when present",
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs("CREATE", namespace="gone"),
            NamespaceNotFound("gone"),
            MatchingError(
                code=404,
                reason="NotFound",
                message='namespaces "gone" not found',
                details={"name": "gone", "kind": "namespaces"},
            ),
            id='MAT-16: a missing namespace is a 404 namespaces "<ns>" not found',
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs("CREATE", namespace="ns"),
            NamespaceLookupFailed("connection refused"),
            MatchingError(
                code=500, reason="InternalError", message="Internal error occurred: connection refused"
            ),
            id="MAT-17: a failed lookup is a 500 Internal error occurred: <error>",
        ),
        pytest.param(
            selector({"team": "a"}),
            attrs("CREATE", "", "v1", "namespaces", namespace="", object=raw({"kind": "Namespace"})),
            None,
            MatchingError(
                code=500,
                reason="InternalError",
                message="Internal error occurred: object does not implement the Object interfaces",
            ),
            id="MAT-13: Namespace CREATE without object metadata is a 500 like upstream's accessor error",
        ),
        pytest.param(
            broken_selector('values[0][env]: Invalid value: "a b": bad'),
            attrs("CREATE", namespace="ns"),
            {"env": "x"},
            MatchingError(
                code=500,
                reason="InternalError",
                message='Internal error occurred: values[0][env]: Invalid value: "a b": bad',
            ),
            id="MAT-23: a namespaceSelector that cannot be built is a 500 carrying the construction error",
        ),
    ],
)
def test_namespace_selector(
    sel: LabelSelector,
    a: AdmissionAttributes,
    looked_up: NamespaceLabels | None,
    expected: bool | MatchingError,
) -> None:
    """MAT-11..17/23: which labels are tested, and what a failed lookup becomes."""
    result = match_namespace_selector(sel, a, looked_up)
    if isinstance(expected, MatchingError):
        assert isinstance(result, MatchingError)
        assert (result.code, result.status_reason, result.message, result.details) == (
            expected.code,
            expected.status_reason,
            expected.message,
            expected.details,
        )
    else:
        assert result is expected


@pytest.mark.parametrize(
    ("a", "expected"),
    [
        pytest.param(
            attrs("CREATE", namespace="team-a"),
            "team-a",
            id="MAT-13: a namespaced request looks up request.namespace",
        ),
        pytest.param(
            attrs("CREATE", "", "v1", "nodes", namespace=""),
            None,
            id="MAT-11: a cluster-scoped request needs no lookup",
        ),
        pytest.param(
            attrs("CREATE", "", "v1", "namespaces", namespace="", object=obj({})),
            None,
            id="MAT-13: Namespace CREATE needs no lookup",
        ),
        pytest.param(
            attrs("UPDATE", "", "v1", "namespaces", namespace="x", object=obj({})),
            None,
            id="MAT-13: Namespace UPDATE needs no lookup",
        ),
        pytest.param(
            attrs("DELETE", "", "v1", "namespaces", namespace="x", old_object=obj({})),
            None,
            id="MAT-15: Namespace DELETE with oldObject needs no lookup",
        ),
        pytest.param(
            attrs("DELETE", "", "v1", "namespaces", namespace="x"),
            "x",
            id="MAT-15: Namespace DELETE without oldObject looks up request.namespace",
        ),
        pytest.param(
            attrs("DELETE", "", "v1", "namespaces", namespace="", name="y"),
            "y",
            id="MAT-15: with empty request.namespace the lookup falls back to request.name",
        ),
        pytest.param(
            attrs("CONNECT", "", "v1", "namespaces", "proxy", namespace="z", object=raw({"kind": "Opts"})),
            "z",
            id="MAT-14: a namespace subresource without oldObject looks up the stored namespace",
        ),
    ],
)
def test_namespace_to_look_up(a: AdmissionAttributes, expected: str | None) -> None:
    """The one name the dispatcher must resolve before matching (or None)."""
    assert namespace_to_look_up(a) == expected


@pytest.mark.parametrize(
    ("hooks", "expected"),
    [
        pytest.param([hook()], None, id="MAT-12: only empty namespaceSelectors: no lookup"),
        pytest.param(
            [hook(rules=(rule(resources=("deployments",)),), namespace_selector=NEVER)],
            None,
            id="MAT-02: a non-empty selector whose rules do not match needs no lookup",
        ),
        pytest.param(
            [hook(), hook(namespace_selector=NEVER)],
            "ns",
            id="MAT-13: one non-empty selector with matching rules needs the lookup",
        ),
    ],
)
def test_namespace_to_look_up_for_hooks(hooks: list[Webhook], expected: str | None) -> None:
    """With the backend list, a lookup is asked for only when some result could matter."""
    assert namespace_to_look_up(attrs("CREATE", namespace="ns"), hooks) == expected


@pytest.mark.parametrize(
    ("unknown", "name", "expected"),
    [
        pytest.param(
            "notFound", "a", {"team": "a"}, id="GW-01: file mode returns a known namespace's labels"
        ),
        pytest.param(
            "notFound",
            "b",
            NamespaceNotFound("b"),
            id="GW-01: file mode unknownNamespace notFound gives MAT-16's not-found",
        ),
        pytest.param(
            "emptyLabels", "b", {}, id="GW-01: file mode unknownNamespace emptyLabels gives no labels"
        ),
    ],
)
def test_file_mode_labels(unknown: str, name: str, expected: NamespaceLabels) -> None:
    """GW-01: the static namespace map of file mode."""
    assert labels_from_map({"a": {"team": "a"}}, name, unknown_namespace=unknown) == expected  # type: ignore[arg-type]


# --- upstream predicates/object/matcher_test.go TestObjectSelector + MAT-18..20 -------------------

RUNLEVEL_1_EXCLUDER = selector(None, ("runlevel", "NotIn", ("1",)))
NODE_1 = obj(RUNLEVEL_1)
NODE_2 = obj(RUNLEVEL_2)
PROXY_OPTIONS = raw({"kind": "NodeProxyOptions", "apiVersion": "v1", "path": "/"})


@pytest.mark.parametrize(
    ("sel", "a", "expected"),
    [
        pytest.param(
            EVERYTHING,
            attrs("CREATE", namespace=""),
            True,
            id="MAT-18: upstream 'empty object selector matches everything'",
        ),
        pytest.param(
            RUNLEVEL_1_EXCLUDER,
            attrs("CREATE", object=NODE_2),
            True,
            id="MAT-19: upstream 'matches new object'",
        ),
        pytest.param(
            RUNLEVEL_1_EXCLUDER,
            attrs("DELETE", old_object=NODE_2),
            True,
            id="MAT-19: upstream 'matches old object'",
        ),
        pytest.param(
            RUNLEVEL_1_EXCLUDER,
            attrs("CREATE", object=NODE_1),
            False,
            id="MAT-19: upstream 'does not match new object'",
        ),
        pytest.param(
            RUNLEVEL_1_EXCLUDER,
            attrs("CREATE", old_object=NODE_1),
            False,
            id="MAT-19: upstream 'does not match old object'",
        ),
        pytest.param(
            RUNLEVEL_1_EXCLUDER,
            attrs("CREATE", object=PROXY_OPTIONS),
            False,
            id="MAT-19: upstream 'does not match object that does not implement Object interface'",
        ),
        pytest.param(
            EVERYTHING,
            attrs("CREATE", object=PROXY_OPTIONS),
            True,
            id=(
                "MAT-18: upstream 'empty selector matches everything, "
                "including object that does not implement Object interface'"
            ),
        ),
        pytest.param(
            RUNLEVEL_1_EXCLUDER,
            attrs("CREATE", object=raw(None)),
            False,
            id="MAT-19: a JSON null object never matches, even NotIn",
        ),
        pytest.param(
            selector(None, ("a", "DoesNotExist", ())),
            attrs("CREATE", object=obj(None, name="x")),
            True,
            id="MAT-19: metadata without labels is the empty label set (DoesNotExist matches)",
        ),
        pytest.param(
            selector(None, ("a", "NotIn", ("1",))),
            attrs("CREATE", object=obj({})),
            True,
            id="MAT-19: empty labels match a NotIn selector",
        ),
        pytest.param(
            selector({"a": "1"}),
            attrs("UPDATE", object=obj({"a": "2"}), old_object=obj({"a": "1"})),
            True,
            id="MAT-19: either object or oldObject matching is enough",
        ),
        pytest.param(
            selector({"app": "web"}),
            attrs(
                "UPDATE",
                "apps",
                "v1",
                "deployments",
                "scale",
                object=raw({"kind": "Scale", "metadata": {"name": "d"}}),
                old_object=raw({"kind": "Scale", "metadata": {"name": "d"}}),
            ),
            False,
            id="MAT-19: a subresource's own object (Scale) is tested, not the parent's labels",
        ),
    ],
)
def test_object_selector(sel: LabelSelector, a: AdmissionAttributes, expected: bool) -> None:
    """MAT-18/19: object or oldObject labels; null and metadata-less values never match."""
    assert match_object_selector(sel, a) is expected


def test_object_selector_sees_current_object() -> None:
    """MAT-20: in the mutating chain the selector sees the patched object; oldObject stays as sent."""
    sel = selector({"stage": "patched"})
    first = attrs("UPDATE", object=obj({"stage": "raw"}), old_object=obj({"stage": "old"}))
    assert match_object_selector(sel, first) is False
    patched = first.with_object(obj({"stage": "patched"}))
    assert match_object_selector(sel, patched) is True
    assert patched.old_object is first.old_object


def test_object_selector_build_error() -> None:
    """MAT-23: an objectSelector that cannot be built is a pending 500 with its construction error."""
    result = match_object_selector(broken_selector("bad value"), attrs("CREATE", object=obj({})))
    assert isinstance(result, MatchingError)
    assert (result.code, result.message) == (500, "Internal error occurred: bad value")


# --- MAT-21/22: label selector semantics, against a reference model --------------------------------

KEYS = ("a", "b", "c")
VALUES = ("1", "2", "3")
label_sets = st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=3)
requirements = st.one_of(
    st.builds(
        Requirement,
        st.sampled_from(KEYS),
        st.sampled_from(("In", "NotIn")),
        st.frozensets(st.sampled_from(VALUES), min_size=1, max_size=2),
    ),
    st.builds(Requirement, st.sampled_from(KEYS), st.sampled_from(("Exists", "DoesNotExist"))),
)


def reference_matches(reqs: tuple[Requirement, ...], labels: dict[str, str]) -> bool:
    """MAT-21 read literally: every requirement holds."""
    for r in reqs:
        present = r.key in labels
        if r.operator == "In" and not (present and labels[r.key] in r.values):
            return False
        if r.operator == "NotIn" and present and labels[r.key] in r.values:
            return False
        if r.operator == "Exists" and not present:
            return False
        if r.operator == "DoesNotExist" and present:
            return False
    return True


@given(st.lists(requirements, max_size=4).map(tuple), label_sets)
def test_label_selector_equals_reference(reqs: tuple[Requirement, ...], labels: dict[str, str]) -> None:
    """MAT-21/22: requirements are ANDed with the documented meanings; `{}` selects everything."""
    sel = LabelSelector(requirements=reqs)
    assert sel.matches(labels) is reference_matches(reqs, labels)
    a = attrs("CREATE", object=obj(labels))
    assert match_object_selector(sel, a) is reference_matches(reqs, labels)
    assert match_namespace_selector(sel, attrs("CREATE", namespace="ns"), labels) is reference_matches(
        reqs, labels
    )


@pytest.mark.parametrize(
    ("sel", "labels", "expected"),
    [
        pytest.param(
            selector({"a": "1"}), {"a": "1", "b": "2"}, True, id="MAT-21: matchLabels needs the exact value"
        ),
        pytest.param(
            selector({"a": "1"}), {"a": "11"}, False, id="MAT-21: matchLabels values are not prefixes"
        ),
        pytest.param(
            selector(None, ("a", "NotIn", ("1",))), {}, True, id="MAT-21: NotIn matches an absent key"
        ),
        pytest.param(selector(None, ("a", "In", ("1",))), {}, False, id="MAT-21: In needs the key to exist"),
        pytest.param(
            selector({"a": "1"}, ("b", "Exists", ())), {"a": "1"}, False, id="MAT-21: requirements are ANDed"
        ),
        pytest.param(EVERYTHING, {}, True, id="MAT-22: {} selects everything"),
    ],
)
def test_label_selector_examples(sel: LabelSelector, labels: dict[str, str], expected: bool) -> None:
    """MAT-21/22 by example."""
    assert sel.matches(labels) is expected
