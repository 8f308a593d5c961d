"""Audit annotations and warnings of one review (AUD-01..09)."""

from __future__ import annotations

import hashlib
import json

import pytest

from gateway.dispatch.annotations import (
    AuditAnnotations,
    Warnings,
    failed_open_key,
    mutation_key,
    mutation_value,
    patch_key,
    patch_value,
)

HOOK = "images.policy.example.com"


@pytest.mark.parametrize(
    ("webhook", "entries", "expected"),
    [
        pytest.param(HOOK, {"violation": "registry"}, {f"{HOOK}_violation": "registry"},
                     id="AUD-01/04: k: v is returned as <name>_<k>: v"),
        pytest.param(HOOK, {"a": "1", "b.c_d-E9": "2"}, {f"{HOOK}_a": "1", f"{HOOK}_b.c_d-E9": "2"},
                     id="AUD-02: names of letters, digits, '.', '_' and '-' are accepted, in order"),
        pytest.param(HOOK, {"x": ""}, {f"{HOOK}_x": ""}, id="AUD-01: an empty value is kept"),
        pytest.param(HOOK, {"a/b": "1"}, {}, id="AUD-02: a key containing '/' is dropped"),
        pytest.param(HOOK, {"a*": "1"}, {}, id="AUD-02: a key containing '*' is dropped"),
        pytest.param(HOOK, {"a b": "1"}, {}, id="AUD-02: a key containing a space is dropped"),
        pytest.param(HOOK, {"": "1"}, {}, id="AUD-02: an empty key is dropped"),
        pytest.param(HOOK, {"-a": "1"}, {}, id="AUD-02: a key starting with '-' is dropped"),
        pytest.param(HOOK, {"a.": "1"}, {}, id="AUD-02: a key ending with '.' is dropped"),
        pytest.param(HOOK, {"k" * 64: "1"}, {}, id="AUD-02: a key longer than 63 characters is dropped"),
        pytest.param("Images.Example.com", {"a": "1"}, {},
                     id="AUD-02: a webhook name that is not a lowercase DNS subdomain makes every key invalid"),
        pytest.param(HOOK, {"ok": "1", "not ok": "2", "also-ok": "3"}, {f"{HOOK}_ok": "1", f"{HOOK}_also-ok": "3"},
                     id="AUD-02: an invalid entry is dropped and the others are kept"),
    ],
)  # fmt: skip
def test_backend_annotations(webhook: str, entries: dict[str, str], expected: dict[str, str]) -> None:
    """AUD-01/02/04: valid entries are returned renamed; invalid ones are dropped with a reason."""
    annotations = AuditAnnotations()
    reasons = annotations.add_backend(webhook, entries)
    assert annotations.as_dict() == expected
    assert len(reasons) == len(entries) - len(expected)
    for reason in reasons:
        assert f'of webhook "{webhook}" dropped' in reason


def _hashed(key: str) -> str:
    return "ann-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def test_long_keys_are_hashed() -> None:
    """AUD-04: a renamed key over 63 characters becomes ann-<12 hex> with a JSON value naming the original."""
    annotations = AuditAnnotations()
    name = "k" * 63  # valid (AUD-02), but "<webhook>_<k>" is far longer than 63
    assert annotations.add_backend(HOOK, {name: 'say "hi"'}) == []
    key = f"{HOOK}/{name}"
    assert annotations.as_dict() == {
        _hashed(key): json.dumps({"key": key, "value": 'say "hi"'}, separators=(",", ":"))
    }


@pytest.mark.parametrize(
    ("name", "renamed"),
    [
        pytest.param("k" * (63 - len(HOOK) - 1), f"{HOOK}_{'k' * (63 - len(HOOK) - 1)}",
                     id="AUD-04: a renamed key of exactly 63 characters is kept as it is"),
        pytest.param("k" * (64 - len(HOOK) - 1), _hashed(f"{HOOK}/{'k' * (64 - len(HOOK) - 1)}"),
                     id="AUD-04: a renamed key of 64 characters is hashed"),
    ],
)  # fmt: skip
def test_rename_boundary(name: str, renamed: str) -> None:
    """AUD-04: the 63-character limit applies to the renamed key."""
    annotations = AuditAnnotations()
    annotations.add_backend(HOOK, {name: "v"})
    assert list(annotations.as_dict()) == [renamed]


@pytest.mark.parametrize(
    ("calls", "expected", "dropped"),
    [
        pytest.param([(HOOK, {"a": "1"}), (HOOK, {"a": "2"})], {f"{HOOK}_a": "1"}, 1,
                     id="AUD-03: a second, different value is refused (first wins) with a reason"),
        pytest.param([(HOOK, {"a": "1"}), (HOOK, {"a": "1"})], {f"{HOOK}_a": "1"}, 0,
                     id="AUD-03: recording the same value again is a silent no-op"),
        pytest.param([(HOOK, {"a": "1"}), ("other.example.com", {"a": "2"})],
                     {f"{HOOK}_a": "1", "other.example.com_a": "2"}, 0,
                     id="AUD-03: the same key from two backends are two keys"),
        pytest.param([(HOOK, {"a": "1"}), (HOOK, {"b": "x"}), (HOOK, {"a": "3", "b": "x", "c": "y"})],
                     {f"{HOOK}_a": "1", f"{HOOK}_b": "x", f"{HOOK}_c": "y"}, 1,
                     id="AUD-03: across rounds a backend keeps its first values"),
    ],
)  # fmt: skip
def test_first_value_wins(
    calls: list[tuple[str, dict[str, str]]], expected: dict[str, str], dropped: int
) -> None:
    """AUD-03: within one review an annotation key keeps its first value."""
    annotations = AuditAnnotations()
    reasons = [r for webhook, entries in calls for r in annotations.add_backend(webhook, entries)]
    assert annotations.as_dict() == expected
    assert len(reasons) == dropped


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        pytest.param(failed_open_key("mutating", 1, 3), "failed-open.mutation.round_1_index_3",
                     id="AUD-06: the mutating failed-open key"),
        pytest.param(failed_open_key("validating", 0, 12), "failed-open.validating.round_0_index_12",
                     id="AUD-06: the validating failed-open key"),
        pytest.param(mutation_key(0, 4), "mutation.round_0_index_4", id="AUD-06: the mutation key"),
        pytest.param(patch_key(1, 0), "patch.round_1_index_0", id="AUD-06: the patch key"),
    ],
)  # fmt: skip
def test_gateway_keys(key: str, expected: str) -> None:
    """AUD-06: the gateway's own keys carry no '/' and fit the caller's 63-character name part."""
    assert key == expected
    annotations = AuditAnnotations()
    assert annotations.add_gateway(key, "v") == []
    assert annotations.as_dict() == {key: "v"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(mutation_value("team-a", HOOK, True),
                     '{"configuration":"team-a","webhook":"images.policy.example.com","mutated":true}',
                     id="AUD-05/06: the mutation value of a mutating invocation"),
        pytest.param(mutation_value("team-a", HOOK, False),
                     '{"configuration":"team-a","webhook":"images.policy.example.com","mutated":false}',
                     id="AUD-05/06: the mutation value of an invocation that changed nothing"),
        pytest.param(patch_value("team-a", HOOK, b' [ {"op": "add", "path": "/a", "value": 1} ]\n'),
                     '{"configuration":"team-a","webhook":"images.policy.example.com",'
                     '"patch":[{"op":"add","path":"/a","value":1}],"patchType":"JSONPatch"}',
                     id="AUD-05/06: the patch value embeds the patch compacted"),
    ],
)  # fmt: skip
def test_gateway_values(value: str, expected: str) -> None:
    """AUD-05/06: the JSON values have upstream's member order and names."""
    assert value == expected


def test_gateway_annotations_keep_their_first_value_and_refuse_bad_keys() -> None:
    """AUD-03/06: gateway keys follow the same rules as backend keys."""
    annotations = AuditAnnotations()
    assert annotations.add_gateway("mutation.round_0_index_0", "a") == []
    assert annotations.add_gateway("mutation.round_0_index_0", "a") == []
    assert len(annotations.add_gateway("mutation.round_0_index_0", "b")) == 1
    assert len(annotations.add_gateway("a/b", "c")) == 1
    assert annotations.as_dict() == {"mutation.round_0_index_0": "a"}


@pytest.mark.parametrize(
    ("batches", "expected", "logged"),
    [
        pytest.param([["a", "b"], ["c"]], ["a", "b", "c"], 0, id="AUD-07: warnings keep arrival order"),
        pytest.param([["a", "", "b"]], ["a", "b"], 0, id="AUD-07: empty warnings are dropped silently"),
        pytest.param([["a", "b"], ["b", "a", "c"]], ["a", "b", "c"], 0,
                     id="AUD-07: exact duplicates (the later copy) are dropped silently"),
        pytest.param([["a", "A", "a "]], ["a", "A", "a "], 0, id="AUD-07: only exact duplicates are dropped"),
        pytest.param([["ok", "line\nbreak", "tab\there", "del\x7f", "c1\x85"]], ["ok"], 4,
                     id="AUD-08/09: texts with control characters are dropped and logged"),
        pytest.param([["ok", "bad \ud800 surrogate"]], ["ok"], 1,
                     id="AUD-08/09: a text that is not valid UTF-8 is dropped and logged"),
        pytest.param([["é ünïcødé ✓ 🙂"]], ["é ünïcødé ✓ 🙂"], 0, id="AUD-09: printable Unicode is kept"),
    ],
)  # fmt: skip
def test_warnings(batches: list[list[str]], expected: list[str], logged: int) -> None:
    """AUD-07/08/09: the warnings returned, and how many drops are reported for the log."""
    warnings = Warnings()
    reasons = [r for batch in batches for r in warnings.add(batch)]
    assert warnings.as_list() == expected
    assert len(reasons) == logged


@pytest.mark.parametrize(
    ("texts", "max_bytes", "expected"),
    [
        pytest.param(["12345", "67890"], 10, ["12345", "67890"], id="AUD-09: warnings that exactly fit are kept"),
        pytest.param(["12345", "678901", "ab"], 10, ["12345"],
                     id="AUD-09: past the budget, that warning and every later one are dropped"),
        pytest.param(["éé", "abc"], 6, ["éé"], id="AUD-09: the budget counts UTF-8 bytes, not characters"),
    ],
)  # fmt: skip
def test_warning_budget(texts: list[str], max_bytes: int, expected: list[str]) -> None:
    """AUD-09: at most max_bytes of warning text is returned; each dropped text is logged."""
    warnings = Warnings(max_bytes=max_bytes)
    reasons = warnings.add(texts)
    assert warnings.as_list() == expected
    assert len(reasons) == len(texts) - len(expected)
    assert all(f"exceed {max_bytes} bytes" in r for r in reasons)


def test_default_warning_budget_is_64_kib() -> None:
    """AUD-09: the default maxWarningBytes is 64 KiB."""
    warnings = Warnings()
    assert warnings.add(["x" * 65536]) == []
    assert len(warnings.add(["y"])) == 1
