"""Structural decoding of one parsed document into the Structs of ``types`` (before defaulting).

The field sets and types come from the Structs themselves (``msgspec.inspect``), so there is one
source of truth. Unlike ``msgspec.convert``, which stops at the first problem, this walk reports every
wrongly typed value as an error and every unknown field as a warning (so a typo such as
``timeoutSecond`` never passes silently), then hands a cleaned tree to ``msgspec.convert``.

A wrongly typed value is dropped: an optional field then reads as absent, a list element or map
value becomes its zero value (as Go's decoder would leave it), so later indexes keep their
positions. Its path is returned in ``bad_paths`` so that validation does not pile follow-on errors
on the same field.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

import msgspec
import msgspec.inspect as mi

from gateway.config.fielderrors import (
    FieldError,
    child,
    index,
    invalid,
    invalid_omitting_value,
    key,
)

S = TypeVar("S", bound=msgspec.Struct)

_ABSENT = object()


@dataclass(frozen=True, slots=True)
class UnknownField:
    """A field the schema does not have, and the known field it is most likely a misspelling of.

    ``guarding`` is true when that known field narrows what a webhook matches or how it fails (a
    selector, rule, match condition or policy field) and is absent from the same object: then the
    typo silently widens or weakens the webhook, and loading refuses it instead of warning.
    """

    path: str
    suggestion: str = ""
    guarding: bool = False


@dataclass(slots=True)
class Decoded(Generic[S]):
    """One decoded document: the Struct, its type errors, its unknown fields."""

    value: S
    errors: list[FieldError] = field(default_factory=list)
    unknown: list[UnknownField] = field(default_factory=list)
    bad_paths: frozenset[str] = frozenset()

    @property
    def unknown_fields(self) -> list[str]:
        return [u.path for u in self.unknown]


def json_type(value: object) -> str:
    """How a JSON value's type is named in messages (``a string``, ``an object`` ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


@functools.cache
def _struct_info(cls: type[msgspec.Struct]) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info


# Fields that narrow what a webhook matches or how it fails: misspelt, each silently widens or weakens
# the webhook (a missing namespaceSelector matches every namespace, a missing failurePolicy defaults).
# Every field of these structs, and these fields of a webhook.
_GUARDING_STRUCTS: Final = frozenset(
    {"RuleWithOperations", "LabelSelector", "LabelSelectorRequirement", "MatchCondition"}
)
_GUARDING_WEBHOOK_FIELDS: Final = frozenset(
    {
        "rules",
        "namespaceSelector",
        "objectSelector",
        "matchConditions",
        "failurePolicy",
        "matchPolicy",
        "sideEffects",
        "reinvocationPolicy",
    }
)


def edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
    neighbours each count one."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[len(b)]


def closest(name: str, known: Iterable[str]) -> tuple[str, int] | None:
    """The known name ``name`` most likely misspells, and the edit distance (case is ignored, so a
    wrongly cased name is at distance 0); None when nothing is close."""
    best: tuple[str, int] | None = None
    for candidate in known:
        distance = edit_distance(name.lower(), candidate.lower())
        limit = 1 if len(candidate) <= 4 else 2 if len(candidate) <= 10 else 3
        if distance <= limit and (best is None or distance < best[1]):
            best = (candidate, distance)
    return best


class _Walker:
    def __init__(self) -> None:
        self.errors: list[FieldError] = []
        self.unknown: list[UnknownField] = []
        self.bad: set[str] = set()

    def wrong_type(self, path: str, value: object, expected: str) -> None:
        self.bad.add(path)
        detail = f"must be {expected}, not {json_type(value)}"
        if isinstance(value, str):
            self.errors.append(invalid(path, value if len(value) <= 80 else value[:77] + "...", detail))
        elif isinstance(value, int | float) or value is None:
            self.errors.append(invalid(path, value, detail))
        else:  # containers can be large: name only their type
            self.errors.append(invalid_omitting_value(path, detail))

    def walk(self, value: object, typ: mi.Type, path: str) -> object:
        """Return the cleaned value, or ``_ABSENT`` when it is unusable."""
        if isinstance(typ, mi.UnionType):  # only ``T | None`` occurs in ``types``
            if value is None:
                return _ABSENT
            (typ,) = (t for t in typ.types if not isinstance(t, mi.NoneType))
        if isinstance(typ, mi.AnyType | mi.CustomType):
            return value
        if value is None:
            self.wrong_type(path, value, _expected(typ))
            return _ABSENT
        if isinstance(typ, mi.StrType):
            if isinstance(value, str):
                return value
        elif isinstance(typ, mi.IntType):
            if isinstance(value, int) and not isinstance(value, bool):
                if (typ.ge is not None and value < typ.ge) or (typ.le is not None and value > typ.le):
                    self.bad.add(path)
                    bits = 32 if typ.le == 2**31 - 1 else 64
                    self.errors.append(invalid(path, value, f"must fit in a {bits}-bit integer"))
                    return _ABSENT
                return value
        elif isinstance(typ, mi.ListType | mi.VarTupleType):
            if isinstance(value, list):
                return [self.item(v, typ.item_type, index(path, i)) for i, v in enumerate(value)]
        elif isinstance(typ, mi.DictType):
            if isinstance(value, dict):
                return self.mapping(value, typ, path)
        elif isinstance(typ, mi.StructType):
            if isinstance(value, dict):
                return self.struct(value, typ, path)
        else:  # pragma: no cover - a type ``types`` does not use
            raise TypeError(f"unsupported schema type {typ!r}")
        self.wrong_type(path, value, _expected(typ))
        return _ABSENT

    def item(self, value: object, typ: mi.Type, path: str) -> object:
        cleaned = self.walk(value, typ, path)
        return _zero(typ) if cleaned is _ABSENT else cleaned

    def mapping(self, value: dict[object, object], typ: mi.DictType, path: str) -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                self.wrong_type(key(path, str(k)), k, "a string key")
                continue
            out[k] = self.item(v, typ.value_type, key(path, k))
        return out

    def struct(self, value: dict[object, object], typ: mi.StructType, path: str) -> dict[str, object]:
        fields = {f.encode_name: f for f in typ.fields}
        out: dict[str, object] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                self.wrong_type(child(path, str(k)), k, "a string field name")
                continue
            f = fields.get(k)
            if f is None:
                self.unknown.append(_unknown(child(path, k), k, typ, value))
                continue
            cleaned = self.walk(v, f.type, child(path, k))
            if cleaned is not _ABSENT:
                out[k] = cleaned
        return out


def _unknown(path: str, name: str, typ: mi.StructType, given: dict[object, object]) -> UnknownField:
    found = closest(name, (f.encode_name for f in typ.fields))
    if found is None:
        return UnknownField(path)
    suggestion, distance = found
    struct = typ.cls.__name__
    guarding = struct in _GUARDING_STRUCTS or (
        struct in ("ValidatingWebhook", "MutatingWebhook") and suggestion in _GUARDING_WEBHOOK_FIELDS
    )
    return UnknownField(path, suggestion, guarding and distance <= 1 and suggestion not in given)


def _expected(typ: mi.Type) -> str:
    if isinstance(typ, mi.StrType):
        return "a string"
    if isinstance(typ, mi.IntType):
        return "an integer"
    if isinstance(typ, mi.ListType | mi.VarTupleType):
        return "a list"
    if isinstance(typ, mi.DictType):
        return "a map of strings"
    return "an object"


def _zero(typ: mi.Type) -> object:
    if isinstance(typ, mi.StrType):
        return ""
    if isinstance(typ, mi.IntType):
        return 0
    if isinstance(typ, mi.ListType | mi.VarTupleType):
        return []
    return {}


def decode(raw: dict[object, object], cls: type[S]) -> Decoded[S]:
    """Decode one document's mapping into ``cls``, collecting every type error and unknown field."""
    walker = _Walker()
    cleaned = walker.struct(raw, _struct_info(cls), "")
    try:
        value = msgspec.convert(cleaned, cls)
    except msgspec.ValidationError as exc:  # pragma: no cover - the walk above checks every type
        walker.errors.append(FieldError("", f"Invalid value: {exc}"))
        walker.bad.add("")
        value = cls()
    return Decoded(value, walker.errors, walker.unknown, frozenset(walker.bad))


def suppressed(path: str, bad_paths: frozenset[str]) -> bool:
    """Whether an error at ``path`` would only repeat a type error at, above or below it."""
    for bad in bad_paths:
        if path == bad or not bad:
            return True
        if path.startswith(bad) and path[len(bad)] in ".[":
            return True
        if bad.startswith(path) and bad[len(path)] in ".[":
            return True
    return False
