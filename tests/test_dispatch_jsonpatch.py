"""JSON Patch with upstream semantics (MUT-03/04/07/08/12/23/24/25).

Tables ported as data from evanphx/json-patch v4 ``patch_test.go`` (Cases, BadCases, TestCases,
MutationTestCases, EqualityCases) and from RFC 6902 appendix A, plus the quirks the spec names.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch.jsonpatch import (
    PatchApplyError,
    PatchDecodeError,
    apply_patch,
    concat_patches,
    decode_patch,
    diff_patch,
    json_equal,
)

A48 = "A" * 48
A49 = "A" * 49


def run(doc: str, patch: str, **kwargs: Any) -> Any:
    """Decode both sides, apply, and check the input document was left untouched."""
    document = json.loads(doc)
    before = copy.deepcopy(document)
    try:
        return apply_patch(document, decode_patch(patch.encode()), **kwargs)
    finally:
        assert document == before


# --- upstream Cases: patches that apply ------------------------------------------------------------

# Upstream compares results as objects, so its rows with an array at the top compare nil with nil and
# never fail; the two copy rows below carry the results RFC 6902 and the library actually give.
UPSTREAM_CASES = [
    ('{"foo":"bar"}', '[{"op":"add","path":"/baz","value":"qux"}]', '{"baz":"qux","foo":"bar"}'),
    ('{"foo":["bar","baz"]}', '[{"op":"add","path":"/foo/1","value":"qux"}]', '{"foo":["bar","qux","baz"]}'),
    ('{"foo":["bar","baz"]}', '[{"op":"add","path":"/foo/-1","value":"qux"}]', '{"foo":["bar","baz","qux"]}'),
    ('{"baz":"qux","foo":"bar"}', '[{"op":"remove","path":"/baz"}]', '{"foo":"bar"}'),
    ('{"foo":["bar","qux","baz"]}', '[{"op":"remove","path":"/foo/1"}]', '{"foo":["bar","baz"]}'),
    (
        '{"baz":"qux","foo":"bar"}',
        '[{"op":"replace","path":"/baz","value":"boo"}]',
        '{"baz":"boo","foo":"bar"}',
    ),
    (
        '{"foo":{"bar":"baz","waldo":"fred"},"qux":{"corge":"grault"}}',
        '[{"op":"move","from":"/foo/waldo","path":"/qux/thud"}]',
        '{"foo":{"bar":"baz"},"qux":{"corge":"grault","thud":"fred"}}',
    ),
    (
        '{"foo":["all","grass","cows","eat"]}',
        '[{"op":"move","from":"/foo/1","path":"/foo/3"}]',
        '{"foo":["all","cows","eat","grass"]}',
    ),
    (
        '{"foo":["all","grass","cows","eat"]}',
        '[{"op":"move","from":"/foo/1","path":"/foo/2"}]',
        '{"foo":["all","cows","grass","eat"]}',
    ),
    (
        '{"foo":"bar"}',
        '[{"op":"add","path":"/child","value":{"grandchild":{}}}]',
        '{"foo":"bar","child":{"grandchild":{}}}',
    ),
    (
        '{"foo":["bar"]}',
        '[{"op":"add","path":"/foo/-","value":["abc","def"]}]',
        '{"foo":["bar",["abc","def"]]}',
    ),
    (
        '{"foo":"bar","qux":{"baz":1,"bar":null}}',
        '[{"op":"remove","path":"/qux/bar"}]',
        '{"foo":"bar","qux":{"baz":1}}',
    ),
    ('{"foo":"bar"}', '[{"op":"add","path":"/baz","value":null}]', '{"baz":null,"foo":"bar"}'),
    ('{"foo":["bar"]}', '[{"op":"replace","path":"/foo/0","value":"baz"}]', '{"foo":["baz"]}'),
    ('{"foo":["bar","baz"]}', '[{"op":"replace","path":"/foo/0","value":"bum"}]', '{"foo":["bum","baz"]}'),
    (
        '{"foo":["bar","qux","baz"]}',
        '[{"op":"replace","path":"/foo/1","value":"bum"}]',
        '{"foo":["bar","bum","baz"]}',
    ),
    (
        '[{"foo":["bar","qux","baz"]}]',
        '[{"op":"replace","path":"/0/foo/0","value":"bum"}]',
        '[{"foo":["bum","qux","baz"]}]',
    ),
    (
        '[{"foo":["bar","qux","baz"],"bar":["qux","baz"]}]',
        '[{"op":"copy","from":"/0/foo/0","path":"/0/bar/0"}]',
        '[{"foo":["bar","qux","baz"],"bar":["bar","qux","baz"]}]',
    ),
    (
        '[{"foo":["bar","qux","baz"],"bar":["qux","baz"]}]',
        '[{"op":"copy","from":"/0/foo/0","path":"/0/bar"}]',
        '[{"foo":["bar","qux","baz"],"bar":"bar"}]',
    ),
    (
        '[{"foo":{"bar":["qux","baz"]},"baz":{"qux":"bum"}}]',
        '[{"op":"copy","from":"/0/foo/bar","path":"/0/baz/bar"}]',
        '[{"baz":{"bar":["qux","baz"],"qux":"bum"},"foo":{"bar":["qux","baz"]}}]',
    ),
    ('{"foo":["bar"]}', '[{"op":"copy","path":"/foo/0","from":"/foo"}]', '{"foo":[["bar"],"bar"]}'),
    ('{"foo":["bar","qux","baz"]}', '[{"op":"remove","path":"/foo/-2"}]', '{"foo":["bar","baz"]}'),
    ('{"foo":[]}', '[{"op":"add","path":"/foo/-1","value":"qux"}]', '{"foo":["qux"]}'),
    ('{"bar":[{"baz":null}]}', '[{"op":"replace","path":"/bar/0/baz","value":1}]', '{"bar":[{"baz":1}]}'),
    ('{"bar":[{"baz":1}]}', '[{"op":"replace","path":"/bar/0/baz","value":null}]', '{"bar":[{"baz":null}]}'),
    ('{"bar":[null]}', '[{"op":"replace","path":"/bar/0","value":1}]', '{"bar":[1]}'),
    ('{"bar":[1]}', '[{"op":"replace","path":"/bar/0","value":null}]', '{"bar":[null]}'),
    (
        '{"id":"0","parentID":"0"}',
        '[{"op":"test","path":"","value":{"id":"0","parentID":"0"}},'
        '{"op":"replace","path":"","value":{"id":"7","originalID":"bar","parentID":"0"}}]',
        '{"id":"7","originalID":"bar","parentID":"0"}',
    ),
]


@pytest.mark.parametrize(
    ("doc", "patch", "expected"),
    [
        pytest.param(doc, patch, expected, id=f"MUT-08: upstream case {i}: {patch}")
        for i, (doc, patch, expected) in enumerate(UPSTREAM_CASES)
    ],
)
def test_upstream_cases_apply(doc: str, patch: str, expected: str) -> None:
    """MUT-08: every applying case of upstream's v4 test table gives upstream's result."""
    assert run(doc, patch) == json.loads(expected)


# Two upstream rows apply their test with a copy limit of 100 bytes (each copy of 48 A's adds 50).
def test_upstream_copy_limit_allows_exactly_the_limit() -> None:
    """MUT-08: copies adding exactly the limit (2 × 50 bytes of 100) still apply, as upstream."""
    doc = json.dumps({"foo": ["A", A48]})
    patch = '[{"op":"copy","path":"/foo/-","from":"/foo/1"},{"op":"copy","path":"/foo/-","from":"/foo/1"}]'
    assert run(doc, patch, copy_limit=100) == {"foo": ["A", A48, A48, A48]}


def test_upstream_copy_limit_refuses_beyond_the_limit() -> None:
    """MUT-07/08: copies adding 2 × 51 bytes exceed a 100-byte limit and fail the whole patch."""
    doc = json.dumps({"foo": ["A", A49]})
    patch = '[{"op":"copy","path":"/foo/-","from":"/foo/1"},{"op":"copy","path":"/foo/-","from":"/foo/1"}]'
    with pytest.raises(PatchApplyError, match="over the limit of 100"):
        run(doc, patch, copy_limit=100)


# --- upstream BadCases: patches that fail ----------------------------------------------------------

UPSTREAM_BAD_CASES = [
    ('{"foo":"bar"}', '[{"op":"add","path":"/baz/bat","value":"qux"}]'),
    ('{"a":{"b":{"d":1}}}', '[{"op":"remove","path":"/a/b/c"}]'),
    ('{"a":{"b":{"d":1}}}', '[{"op":"move","from":"/a/b/c","path":"/a/b/e"}]'),
    ('{"a":{"b":[1]}}', '[{"op":"remove","path":"/a/b/1"}]'),
    ('{"a":{"b":[1]}}', '[{"op":"move","from":"/a/b/1","path":"/a/b/2"}]'),
    ('{"foo":"bar"}', '[{"op":"add","pathz":"/baz","value":"qux"}]'),
    ('{"foo":"bar"}', '[{"op":"add","path":"","value":"qux"}]'),
    ('{"foo":["bar","baz"]}', '[{"op":"replace","path":"/foo/2","value":"bum"}]'),
    ('{"foo":["bar","baz"]}', '[{"op":"add","path":"/foo/-4","value":"bum"}]'),
    ('{"name":{"foo":"bat","qux":"bum"}}', '[{"op":"replace","path":"/foo/bar","value":"baz"}]'),
    ('{"foo":["bar"]}', '[{"op":"add","path":"/foo/2","value":"bum"}]'),
    ('{"foo":[]}', '[{"op":"remove","path":"/foo/-"}]'),
    ('{"foo":[]}', '[{"op":"remove","path":"/foo/-1"}]'),
    ('{"foo":["bar"]}', '[{"op":"remove","path":"/foo/-2"}]'),
    ("{}", '[{"op":null,"path":""}]'),
    ("{}", '[{"op":"add","path":null}]'),
    ("{}", '[{"op":"copy","from":null}]'),
    ('{"foo":["bar"]}', '[{"op":"copy","path":"/foo/6666666666","from":"/"}]'),
    ('{"foo":["bar"]}', '[{"op":"copy","path":"/foo/2","from":"/foo/0"}]'),
    ('{"foo":["all","grass","cows","eat"]}', '[{"op":"move","from":"/foo/1","path":"/foo/4"}]'),
]


@pytest.mark.parametrize(
    ("doc", "patch"),
    [
        pytest.param(doc, patch, id=f"MUT-07/08: upstream bad case {i}: {patch}")
        for i, (doc, patch) in enumerate(UPSTREAM_BAD_CASES)
    ],
)
def test_upstream_bad_cases_fail(doc: str, patch: str) -> None:
    """MUT-07/08: every failing case of upstream's v4 test table fails, leaving the input unchanged."""
    with pytest.raises(PatchApplyError):
        run(doc, patch)


# --- upstream TestCases: the test operation --------------------------------------------------------

UPSTREAM_TEST_CASES = [
    (
        '{"baz":"qux","foo":["a",2,"c"]}',
        '[{"op":"test","path":"/baz","value":"qux"},{"op":"test","path":"/foo/1","value":2}]',
        "",
    ),
    ('{"baz":"qux"}', '[{"op":"test","path":"/baz","value":"bar"}]', "/baz"),
    (
        '{"baz":"qux","foo":["a",2,"c"]}',
        '[{"op":"test","path":"/baz","value":"qux"},{"op":"test","path":"/foo/1","value":"c"}]',
        "/foo/1",
    ),
    ('{"baz":"qux"}', '[{"op":"test","path":"/foo","value":42}]', "/foo"),
    ('{"baz":"qux"}', '[{"op":"test","path":"/foo","value":null}]', ""),
    ('{"foo":null}', '[{"op":"test","path":"/foo","value":null}]', ""),
    ('{"foo":{}}', '[{"op":"test","path":"/foo","value":null}]', "/foo"),
    ('{"foo":[]}', '[{"op":"test","path":"/foo","value":null}]', "/foo"),
    ('{"baz/foo":"qux"}', '[{"op":"test","path":"/baz~1foo","value":"qux"}]', ""),
    ('{"foo":[]}', '[{"op":"test","path":"/foo"}]', "/foo"),
    ('{"baz":[]}', '[{"op":"test","path":"/foo"}]', ""),
]


@pytest.mark.parametrize(
    ("doc", "patch", "failed_path"),
    [
        pytest.param(doc, patch, failed, id=f"MUT-08: upstream test-op case {i}: {patch}")
        for i, (doc, patch, failed) in enumerate(UPSTREAM_TEST_CASES)
    ],
)
def test_upstream_test_operation(doc: str, patch: str, failed_path: str) -> None:
    """MUT-08: ``test`` passes or fails as upstream's, a missing member equalling null."""
    if not failed_path:
        assert run(doc, patch) == json.loads(doc)
        return
    with pytest.raises(PatchApplyError, match=f'test "{failed_path}"'):
        run(doc, patch)


@pytest.mark.parametrize(
    ("doc", "patch"),
    [
        pytest.param(
            '{"foo":"bar","qux":{"baz":1,"bar":null}}',
            '[{"op":"remove","path":"/qux/bar"}]',
            id="MUT-12: upstream mutation case 0: removing a null member is a change",
        ),
        pytest.param(
            '{"foo":"bar","qux":{"baz":1,"bar":null}}',
            '[{"op":"replace","path":"/qux/baz","value":null}]',
            id="MUT-12: upstream mutation case 1: replacing a value by null is a change",
        ),
    ],
)
def test_upstream_mutation_cases_change_the_document(doc: str, patch: str) -> None:
    """MUT-12: upstream's mutation cases give a document structurally different from the input."""
    assert not json_equal(run(doc, patch), json.loads(doc))


# --- RFC 6902 appendix A ---------------------------------------------------------------------------

RFC_EXAMPLES = [
    ("A.1 adding an object member", '{"foo":"bar"}', '[{"op":"add","path":"/baz","value":"qux"}]',
     '{"baz":"qux","foo":"bar"}'),
    ("A.2 adding an array element", '{"foo":["bar","baz"]}', '[{"op":"add","path":"/foo/1","value":"qux"}]',
     '{"foo":["bar","qux","baz"]}'),
    ("A.3 removing an object member", '{"baz":"qux","foo":"bar"}', '[{"op":"remove","path":"/baz"}]',
     '{"foo":"bar"}'),
    ("A.4 removing an array element", '{"foo":["bar","qux","baz"]}', '[{"op":"remove","path":"/foo/1"}]',
     '{"foo":["bar","baz"]}'),
    ("A.5 replacing a value", '{"baz":"qux","foo":"bar"}', '[{"op":"replace","path":"/baz","value":"boo"}]',
     '{"baz":"boo","foo":"bar"}'),
    ("A.6 moving a value", '{"foo":{"bar":"baz","waldo":"fred"},"qux":{"corge":"grault"}}',
     '[{"op":"move","from":"/foo/waldo","path":"/qux/thud"}]',
     '{"foo":{"bar":"baz"},"qux":{"corge":"grault","thud":"fred"}}'),
    ("A.7 moving an array element", '{"foo":["all","grass","cows","eat"]}',
     '[{"op":"move","from":"/foo/1","path":"/foo/3"}]', '{"foo":["all","cows","eat","grass"]}'),
    ("A.8 testing a value: success", '{"baz":"qux","foo":["a",2,"c"]}',
     '[{"op":"test","path":"/baz","value":"qux"},{"op":"test","path":"/foo/1","value":2}]',
     '{"baz":"qux","foo":["a",2,"c"]}'),
    ("A.9 testing a value: error", '{"baz":"qux"}', '[{"op":"test","path":"/baz","value":"bar"}]', None),
    ("A.10 adding a nested member object", '{"foo":"bar"}',
     '[{"op":"add","path":"/child","value":{"grandchild":{}}}]', '{"foo":"bar","child":{"grandchild":{}}}'),
    ("A.11 ignoring unrecognized elements", '{"foo":"bar"}',
     '[{"op":"add","path":"/baz","value":"qux","xyz":123}]', '{"foo":"bar","baz":"qux"}'),
    ("A.12 adding to a nonexistent target", '{"foo":"bar"}',
     '[{"op":"add","path":"/baz/bat","value":"qux"}]', None),
    # A.13: upstream decodes operations into a map, so the last "op" wins: a remove of a missing member.
    ("A.13 invalid JSON Patch document (duplicate op)", '{"foo":"bar"}',
     '[{"op":"add","path":"/baz","value":"qux","op":"remove"}]', None),
    ("A.14 ~ escape ordering", '{"/":9,"~1":10}', '[{"op":"test","path":"/~01","value":10}]',
     '{"/":9,"~1":10}'),
    ("A.15 comparing strings and numbers", '{"/":9,"~1":10}', '[{"op":"test","path":"/~01","value":"10"}]',
     None),
    ("A.16 adding an array value", '{"foo":["bar"]}', '[{"op":"add","path":"/foo/-","value":["abc","def"]}]',
     '{"foo":["bar",["abc","def"]]}'),
]  # fmt: skip


@pytest.mark.parametrize(
    ("doc", "patch", "expected"),
    [pytest.param(d, p, e, id=f"MUT-08: RFC 6902 {name}") for name, d, p, e in RFC_EXAMPLES],
)
def test_rfc6902_appendix_a(doc: str, patch: str, expected: str | None) -> None:
    """MUT-08: RFC 6902's examples give the RFC's result or fail, under upstream's semantics."""
    if expected is None:
        with pytest.raises(PatchApplyError):
            run(doc, patch)
    else:
        assert run(doc, patch) == json.loads(expected)


# --- the quirks and rules MUT-08 names -------------------------------------------------------------

QUIRKS = [
    ("[UP-quirk] replace of a missing object member sets it", '{"a":{}}',
     '[{"op":"replace","path":"/a/b","value":1}]', '{"a":{"b":1}}'),
    ("[UP-quirk] replace of a missing top-level member sets it", '{}',
     '[{"op":"replace","path":"/x","value":[1]}]', '{"x":[1]}'),
    ("replace of an array index out of range fails", '{"a":[1]}',
     '[{"op":"replace","path":"/a/1","value":2}]', None),
    ("replace of a negative index out of range fails", '{"a":[1]}',
     '[{"op":"replace","path":"/a/-2","value":2}]', None),
    ("replace of - fails", '{"a":[1]}', '[{"op":"replace","path":"/a/-","value":2}]', None),
    ("replace at -1 replaces the last element", '{"spec":{"containers":[{"n":"a"},{"n":"b"}]}}',
     '[{"op":"replace","path":"/spec/containers/-1","value":{"n":"c"}}]',
     '{"spec":{"containers":[{"n":"a"},{"n":"c"}]}}'),
    ("negative index traverses from the end", '{"spec":{"containers":[{"n":"a"},{"n":"b"}]}}',
     '[{"op":"add","path":"/spec/containers/-1/image","value":"x"}]',
     '{"spec":{"containers":[{"n":"a"},{"n":"b","image":"x"}]}}'),
    ("remove at -1 removes the last element", '{"a":[1,2,3]}', '[{"op":"remove","path":"/a/-1"}]',
     '{"a":[1,2]}'),
    ("[UP-quirk] add at -1 appends (counted on the grown array)", '{"a":[1,2]}',
     '[{"op":"add","path":"/a/-1","value":9}]', '{"a":[1,2,9]}'),
    ("[UP-quirk] add at -2 inserts before the last element", '{"a":[1,2]}',
     '[{"op":"add","path":"/a/-2","value":9}]', '{"a":[1,9,2]}'),
    ("add at -(len+1) inserts first", '{"a":[1,2]}', '[{"op":"add","path":"/a/-3","value":9}]',
     '{"a":[9,1,2]}'),
    ("add at -(len+2) fails", '{"a":[1,2]}', '[{"op":"add","path":"/a/-4","value":9}]', None),
    ("move from -1 moves the last element", '{"a":[1,2,3]}', '[{"op":"move","from":"/a/-1","path":"/a/0"}]',
     '{"a":[3,1,2]}'),
    ("copy from -1 copies the last element", '{"a":[1,2]}', '[{"op":"copy","from":"/a/-1","path":"/b"}]',
     '{"a":[1,2],"b":2}'),
    ("test at -1 looks at the last element", '{"a":[1,2]}', '[{"op":"test","path":"/a/-1","value":2}]',
     '{"a":[1,2]}'),
    ("add at index == length appends", '{"a":[1,2]}', '[{"op":"add","path":"/a/2","value":3}]',
     '{"a":[1,2,3]}'),
    ("add at index > length fails", '{"a":[1,2]}', '[{"op":"add","path":"/a/3","value":3}]', None),
    ("add - appends", '{"a":[]}', '[{"op":"add","path":"/a/-","value":1}]', '{"a":[1]}'),
    ("add of a non-numeric array index fails", '{"a":[]}', '[{"op":"add","path":"/a/x","value":1}]', None),
    ("array indices accept leading zeros and a plus sign like Go's Atoi", '{"a":[1,2,3]}',
     '[{"op":"remove","path":"/a/01"},{"op":"remove","path":"/a/+1"}]', '{"a":[1]}'),
    ("array indices refuse spaces", '{"a":[1,2]}', '[{"op":"remove","path":"/a/ 1"}]', None),
    ("add onto an existing member replaces it", '{"a":{"b":1}}', '[{"op":"add","path":"/a","value":2}]',
     '{"a":2}'),
    ("- is an ordinary member name in an object", '{"a":{}}', '[{"op":"add","path":"/a/-","value":1}]',
     '{"a":{"-":1}}'),
    ("the parent of an add must exist", '{"a":{}}', '[{"op":"add","path":"/a/b/c","value":1}]', None),
    ("the parent must be a container, not a scalar", '{"a":"s"}', '[{"op":"add","path":"/a/b","value":1}]',
     None),
    ("the parent must not be null", '{"a":null}', '[{"op":"add","path":"/a/b","value":1}]', None),
    ("- never names an intermediate element", '{"a":[{}]}', '[{"op":"add","path":"/a/-/b","value":1}]', None),
    ("remove of a missing member fails", '{"a":{}}', '[{"op":"remove","path":"/a/b"}]', None),
    ("remove of a null member succeeds", '{"a":null}', '[{"op":"remove","path":"/a"}]', "{}"),
    ("remove of the whole document fails", '{"a":1}', '[{"op":"remove","path":""}]', None),
    ("~1 and ~0 are unescaped", '{}',
     '[{"op":"add","path":"/a~1b","value":1},{"op":"add","path":"/c~0d","value":2}]',
     '{"a/b":1,"c~d":2}'),
    ("~01 is ~1, not /", '{}', '[{"op":"add","path":"/~01","value":1}]', '{"~1":1}'),
    ("an empty reference token names the member \"\"", '{}', '[{"op":"add","path":"/","value":1}]', '{"":1}'),
    ("[UP-quirk] text before the first / is ignored", '{"a":{}}', '[{"op":"add","path":"x/b","value":1}]',
     '{"a":{},"b":1}'),
    ("a path without / fails", '{}', '[{"op":"add","path":"b","value":1}]', None),
    ("add of the whole document fails", '{}', '[{"op":"add","path":"","value":{"a":1}}]', None),
    ("replace of the whole document with an object replaces it", '{"a":1}',
     '[{"op":"replace","path":"","value":{"b":2}}]', '{"b":2}'),
    ("replace of the whole document with a scalar fails", '{"a":1}',
     '[{"op":"replace","path":"","value":3}]', None),
    ("test of the whole document compares it", '{"a":1}', '[{"op":"test","path":"","value":{"a":1}}]',
     '{"a":1}'),
    ("test of the whole document against another value fails", '{"a":1}',
     '[{"op":"test","path":"","value":{"a":2}}]', None),
    ("[UP-quirk] add without value adds null", '{}', '[{"op":"add","path":"/a"}]', '{"a":null}'),
    ("[UP-quirk] copy from a missing object member copies null", '{}',
     '[{"op":"copy","from":"/x","path":"/a"}]', '{"a":null}'),
    ("copy from a missing array index fails", '{"a":[]}', '[{"op":"copy","from":"/a/0","path":"/b"}]', None),
    ("move from a missing member fails", '{}', '[{"op":"move","from":"/x","path":"/a"}]', None),
    ("move into its own child fails", '{"a":{"b":1}}', '[{"op":"move","from":"/a","path":"/a/c"}]', None),
    ("move onto itself leaves the document as it was", '{"a":{"b":1}}',
     '[{"op":"move","from":"/a","path":"/a"}]', '{"a":{"b":1}}'),
    ("test compares objects regardless of member order", '{"a":{"x":1,"y":[1,{"z":null}]}}',
     '[{"op":"test","path":"/a","value":{"y":[1,{"z":null}],"x":1}}]', '{"a":{"x":1,"y":[1,{"z":null}]}}'),
    ("test compares arrays in order", '{"a":[1,2]}', '[{"op":"test","path":"/a","value":[2,1]}]', None),
    ("test tells 1 from 1.0, as upstream compares the JSON texts", '{"a":1}',
     '[{"op":"test","path":"/a","value":1.0}]', None),
    ("test tells true from 1", '{"a":true}', '[{"op":"test","path":"/a","value":1}]', None),
    ("test of an existing value against a missing value fails", '{"a":1}', '[{"op":"test","path":"/a"}]',
     None),
    ("an unknown op fails", '{}', '[{"op":"merge","path":"/a","value":1}]', None),
    ("a missing op fails", '{}', '[{"path":"/a","value":1}]', None),
    ("a null operation fails", '{}', "[null]", None),
    ("an op that is not a string fails", '{}', '[{"op":1,"path":"/a"}]', None),
    ("a path that is not a string fails", '{}', '[{"op":"add","path":1,"value":1}]', None),
    ("a later failing operation fails the whole patch", '{"a":1}',
     '[{"op":"add","path":"/b","value":2},{"op":"remove","path":"/c"}]', None),
    ("an empty patch leaves the document as it was", '{"a":1}', "[]", '{"a":1}'),
]  # fmt: skip


@pytest.mark.parametrize(
    ("doc", "patch", "expected"),
    [pytest.param(d, p, e, id=f"MUT-03/07/08: {name}") for name, d, p, e in QUIRKS],
)
def test_upstream_semantics_and_quirks(doc: str, patch: str, expected: str | None) -> None:
    """MUT-03/07/08: each rule and quirk of upstream's v4 library, with the input never modified."""
    if expected is None:
        with pytest.raises(PatchApplyError):
            run(doc, patch)
    else:
        assert run(doc, patch) == json.loads(expected)


@pytest.mark.parametrize(
    ("doc", "patch", "message"),
    [
        pytest.param(
            '{"a":[1]}',
            '[{"op":"add","path":"/b","value":1},{"op":"replace","path":"/a/5","value":2}]',
            'operation 1 (replace "/a/5"): array index 5 is out of range for length 1',
            id="MUT-07: the error names the failing operation's index, op and path",
        ),
        pytest.param(
            "{}",
            '[{"op":"move","from":"/x","path":"/y"}]',
            'operation 0 (move from "/x" to "/y"): the value to move does not exist',
            id="MUT-07: move and copy errors name both paths",
        ),
        pytest.param(
            "{}",
            '[{"op":"add","path":"/a/b","value":1}]',
            'operation 0 (add "/a/b"): path does not exist',
            id="MUT-07: a missing parent is reported as a missing path",
        ),
        pytest.param(
            "{}",
            '[{"op":"frob","path":"/a"}]',
            'operation 0 (frob "/a"): unknown operation "frob"',
            id="MUT-07: an unknown op is named",
        ),
        pytest.param(
            '{"a":1}',
            '[{"op":"test","path":"/a","value":2}]',
            'operation 0 (test "/a"): test failed: the value differs',
            id="MUT-07: a failed test names its path",
        ),
    ],
)
def test_apply_error_texts(doc: str, patch: str, message: str) -> None:
    """MUT-07: error texts say which operation failed, where, and why."""
    with pytest.raises(PatchApplyError) as info:
        run(doc, patch)
    assert str(info.value) == message


def test_result_shares_untouched_subtrees() -> None:
    """MUT-07: copy-on-write copies only the touched path, so untouched subtrees are shared."""
    doc: dict[str, Any] = {"metadata": {"labels": {"a": "1"}}, "spec": {"containers": [{"name": "c"}]}}
    out = apply_patch(doc, [{"op": "add", "path": "/metadata/labels/b", "value": "2"}])
    assert out["spec"] is doc["spec"]
    assert out["metadata"] is not doc["metadata"]
    assert doc["metadata"]["labels"] == {"a": "1"}


def test_copied_value_is_independent_of_its_source() -> None:
    """MUT-08: after copy, changing the copy leaves the source alone (upstream deep-copies)."""
    out = apply_patch(
        {"a": {"x": [1]}},
        [
            {"op": "copy", "from": "/a", "path": "/b"},
            {"op": "add", "path": "/b/x/-", "value": 2},
        ],
    )
    assert out == {"a": {"x": [1]}, "b": {"x": [1, 2]}}


def test_patch_values_are_never_modified() -> None:
    """MUT-07: a value added by one operation and changed by a later one is copied, not modified."""
    ops = decode_patch(b'[{"op":"add","path":"/a","value":{"l":[1]}},{"op":"add","path":"/a/l/-","value":2}]')
    out = apply_patch({}, ops)
    assert out == {"a": {"l": [1, 2]}}
    assert ops[0]["value"] == {"l": [1]}


# --- decode_patch (MUT-03/04) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(b"[]", [], id="MUT-03: [] decodes to no operations"),
        pytest.param(b" null ", [], id="MUT-03: null decodes to no operations, as upstream"),
        pytest.param(b"[null]", [{}], id="MUT-04: a null element decodes (and fails later, MUT-07)"),
        pytest.param(
            b'[{"op":"add","path":"/a","value":{"b":[1,2.5,true,null]}}]',
            [{"op": "add", "path": "/a", "value": {"b": [1, 2.5, True, None]}}],
            id="MUT-04: an array of operations decodes",
        ),
    ],
)
def test_decode_patch_accepts(data: bytes, expected: list[dict[str, Any]]) -> None:
    """MUT-03/04: what upstream's DecodePatch accepts."""
    assert decode_patch(data) == expected


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            b'{"op":"add"}',
            "json: cannot unmarshal object into Go value of type jsonpatch.Patch",
            id="MUT-04: an object is not a patch",
        ),
        pytest.param(
            b'"[]"',
            "json: cannot unmarshal string into Go value of type jsonpatch.Patch",
            id="MUT-04: a string",
        ),
        pytest.param(
            b"[1]",
            "json: cannot unmarshal number into Go value of type jsonpatch.Operation",
            id="MUT-04: a number element is not an operation",
        ),
        pytest.param(
            b'[{}, ["add"]]',
            "json: cannot unmarshal array into Go value of type jsonpatch.Operation",
            id="MUT-04: an array element is not an operation",
        ),
        pytest.param(
            b"[true]",
            "json: cannot unmarshal bool into Go value of type jsonpatch.Operation",
            id="MUT-04: a bool element is not an operation",
        ),
        pytest.param(b"", "unexpected end of JSON input", id="MUT-04: no bytes"),
        pytest.param(b'[{"op":', "unexpected end of JSON input", id="MUT-04: truncated JSON"),
        pytest.param(b"xyz", "invalid character 'x' at offset 0", id="MUT-04: not JSON"),
        pytest.param(b"[] x", "invalid character 'x' after top-level value", id="MUT-04: trailing data"),
    ],
)
def test_decode_patch_refuses(data: bytes, message: str) -> None:
    """MUT-04: anything but a JSON array of operations is refused with a Go-like text."""
    with pytest.raises(PatchDecodeError) as info:
        decode_patch(data)
    assert str(info.value) == message


# --- json_equal (MUT-12) ---------------------------------------------------------------------------

EQUALITY = [
    ("upstream ExtraKeyFalse", '{"foo":"bar"}', '{"foo":"bar","baz":"qux"}', False),
    ("upstream KeysOutOfOrderTrue", '{"baz":"qux","foo":"bar"}', '{"foo":"bar","baz":"qux"}', True),
    ("upstream ComparingNullFalse", '{"foo":null}', '{"foo":"bar"}', False),
    ("upstream ComparingNullTrue", '{"foo":null}', '{"foo":null}', True),
    ("upstream ArrayOutOfOrderFalse", '["foo","bar","baz"]', '["bar","baz","foo"]', False),
    ("upstream ArrayTrue", '["foo","bar","baz"]', '["foo","bar","baz"]', True),
    ("upstream NonStringTypesTrue", '{"int":6,"bool":true,"float":7.0,"string":"s","null":null}',
     '{"int":6,"bool":true,"float":7.0,"string":"s","null":null}', True),
    ("upstream NestedNullFalse", '{"foo":["an","array"],"bar":{"an":"object"}}', '{"foo":null,"bar":null}',
     False),
    ("upstream NullCompareStringFalse", '"foo"', "null", False),
    ("upstream NullCompareIntFalse", "6", "null", False),
    ("upstream NullCompareFloatFalse", "6.01", "null", False),
    ("upstream NullCompareBoolFalse", "false", "null", False),
    ("numbers compare by value: 1 equals 1.0", '{"a":1}', '{"a":1.0}', True),
    ("numbers compare by value: 1 differs from 2", "[1]", "[2]", False),
    ("true never equals 1", "true", "1", False),
    ("false never equals 0", '{"a":false}', '{"a":0}', False),
    ("a string never equals a number", '"1"', "1", False),
    ("strings compare exactly", '"a"', '"A"', False),
    ("an empty object differs from an empty array", "{}", "[]", False),
    ("an empty object differs from null", "{}", "null", False),
    ("an empty map differs from an absent one (GW-04)", '{"labels":{}}', "{}", False),
    ("a missing member differs from a null member", '{"a":null}', '{"b":null}', False),
    ("deeply equal documents", '{"a":[{"b":[1,{"c":"d"}]}]}', '{"a":[{"b":[1.0,{"c":"d"}]}]}', True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("a", "b", "equal"), [pytest.param(a, b, eq, id=f"MUT-12: {name}") for name, a, b, eq in EQUALITY]
)
def test_json_equal(a: str, b: str, equal: bool) -> None:
    """MUT-12: structural equality, both ways round."""
    left, right = json.loads(a), json.loads(b)
    assert json_equal(left, right) is equal
    assert json_equal(right, left) is equal


# --- concat_patches (MUT-23) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patches", "expected"),
    [
        pytest.param([], b"[]", id="MUT-23: no patches join to []"),
        pytest.param([b"[]", b" [ \n] "], b"[]", id="MUT-23: empty arrays contribute nothing"),
        pytest.param([b"null", b""], b"[]", id="MUT-23: null and empty patches contribute nothing"),
        pytest.param(
            [
                b'[{"op":"add","path":"/a","value":1}]',
                b"[]",
                b' [ {"op":"remove","path":"/b"} ,{"op":"x"} ]\n',
            ],
            b'[{"op":"add","path":"/a","value":1},{"op":"remove","path":"/b"} ,{"op":"x"}]',
            id="MUT-23: arrays join in order, byte for byte",
        ),
    ],
)
def test_concat_patches(patches: list[bytes], expected: bytes) -> None:
    """MUT-23: the combined patch is the backends' arrays joined without re-encoding."""
    assert concat_patches(patches) == expected
    assert json.loads(concat_patches(patches)) == [op for p in patches if p for op in decode_patch(p)]


def test_concat_patches_refuses_non_arrays() -> None:
    """MUT-23: only JSON arrays can be joined."""
    with pytest.raises(ValueError, match="not a JSON array"):
        concat_patches([b'{"op":"add"}'])


# --- diff_patch (MUT-24/25) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        pytest.param({"a": 1}, {"a": 1}, [], id="MUT-24: equal documents give an empty patch"),
        pytest.param(
            {"a": 1},
            {"a": 1.0},
            [{"op": "replace", "path": "/a", "value": 1.0}],
            id="MUT-24: 1 → 1.0 is kept",
        ),
        pytest.param(
            {"m": {"l": {"x": "1"}}},
            {"m": {"l": {"x": "1", "a/b~": "2"}}},
            [{"op": "add", "path": "/m/l/a~1b~0", "value": "2"}],
            id="MUT-25: keys are escaped in paths",
        ),
        pytest.param(
            {"c": [{"n": "a"}, {"n": "b"}]},
            {"c": [{"n": "s"}, {"n": "a"}, {"n": "b"}]},
            [{"op": "add", "path": "/c/0", "value": {"n": "s"}}],
            id="MUT-24: an insertion at the front of an array is one add",
        ),
        pytest.param(
            {"c": [1, 2, 3]},
            {"c": [1, 3]},
            [{"op": "remove", "path": "/c/1"}],
            id="MUT-24: a removal in the middle of an array is one remove",
        ),
        pytest.param(
            {"a": 1},
            [1],
            [{"op": "replace", "path": "", "value": [1]}],
            id="MUT-25: a different root type replaces the whole document",
        ),
    ],
)
def test_diff_patch_rows(src: Any, dst: Any, expected: list[dict[str, Any]]) -> None:
    """MUT-24/25: diffs are small, escaped, and apply to give the target."""
    assert diff_patch(src, dst) == expected
    assert _identical(apply_patch(src, diff_patch(src, dst)), dst)


def test_diff_patch_refuses_scalar_targets() -> None:
    """MUT-25: no upstream-applicable patch turns a document into a scalar."""
    with pytest.raises(TypeError):
        diff_patch({"a": 1}, 3)


def _identical(a: Any, b: Any) -> bool:
    """Equal as JSON texts would be: types included (1 is not 1.0, true is not 1)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(-2, 2, allow_nan=False)
    | st.text(alphabet="ab~/", max_size=3)
)


def json_values_with(keys: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return st.recursive(
        json_scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
        max_leaves=25,
    )


# Member names with "-" and digits exercise the array-index look-alikes; the diff test leaves them out
# so that a negative index in its output can be recognised.
json_values = json_values_with(st.text("ab~/-0", max_size=3))
json_documents = st.dictionaries(st.text("ab~/-0", max_size=3), json_values, max_size=5)
plain_documents = st.dictionaries(st.text("ab~/", max_size=3), json_values_with(st.text("ab~/", max_size=3)))


@settings(max_examples=300, deadline=None)
@given(src=plain_documents, dst=plain_documents)
def test_diff_patch_round_trip(src: dict[str, Any], dst: dict[str, Any]) -> None:
    """MUT-24/25: applying diff_patch(src, dst) to src gives exactly dst, with MUT-08 constructs only."""
    before = copy.deepcopy(src)
    ops = diff_patch(src, dst)
    assert _identical(apply_patch(src, ops), dst)
    assert _identical(src, before)
    for op in ops:
        assert op["op"] in {"add", "remove", "replace"}
        assert not any(token.startswith("-") for token in op["path"].split("/"))


def _paths(doc: Any, prefix: str = "") -> list[str]:
    out = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, f"{prefix}/{key.replace('~', '~0').replace('/', '~1')}")
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _paths(value, f"{prefix}/{i}")
            out.append(f"{prefix}/-{len(doc) - i}")
        out.append(f"{prefix}/-")
        out.append(f"{prefix}/{len(doc)}")
    return out


@st.composite
def documents_and_patches(draw: st.DrawFn) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    doc = draw(json_documents)
    paths = [*_paths(doc)[1:], "", "/new", "/a/b/c"]
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(["add", "remove", "replace", "move", "copy", "test"]))
        op: dict[str, Any] = {"op": name, "path": draw(st.sampled_from(paths))}
        if name in {"move", "copy"}:
            op["from"] = draw(st.sampled_from(paths))
        if name in {"add", "replace", "test"}:
            op["value"] = draw(json_values)
        ops.append(op)
    return doc, ops


@settings(max_examples=300, deadline=None)
@given(case=documents_and_patches())
def test_apply_patch_never_modifies_its_input(case: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    """MUT-07: whatever the patch, succeeding or failing, the input document and ops stay unchanged."""
    doc, ops = case
    doc_before, ops_before = copy.deepcopy(doc), copy.deepcopy(ops)
    try:
        result = apply_patch(doc, ops)
    except PatchApplyError:
        result = None
    assert _identical(doc, doc_before)
    assert _identical(ops, ops_before)
    if result is not None:
        # MUT-23: applying the ops one patch at a time gives the same document as applying them at once.
        stepwise: Any = doc
        for op in ops:
            stepwise = apply_patch(stepwise, [op])
        assert _identical(stepwise, result)
