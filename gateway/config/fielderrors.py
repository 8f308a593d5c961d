"""Field errors in upstream's shapes (apimachinery ``util/validation/field``), used by validation.

Every configuration problem below the document level is one ``FieldError``: a field path in upstream
notation (``webhooks[2].rules[0].operations[1]``) and a body such as ``Invalid value: 45: the timeout
value must be between 1 and 30 seconds``. Values are printed the way Go's ``fmt`` prints them in
upstream messages (``%q`` for strings, ``%#v`` for slices), so texts match the apiserver's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Go escapes for the characters strconv.Quote spells with a backslash letter.
_GO_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    "\\": "\\\\",
    '"': '\\"',
}


def go_quote(text: str) -> str:
    """``strconv.Quote`` (Go's ``%q`` of a string); invalid UTF-8 arrives as surrogate escapes."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in _GO_ESCAPES:
            out.append(_GO_ESCAPES[char])
        elif 0xDC80 <= code <= 0xDCFF:  # an undecodable byte (surrogateescape)
            out.append(f"\\x{code - 0xDC00:02x}")
        elif char.isprintable():
            out.append(char)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


@dataclass(frozen=True, slots=True)
class GoSlice:
    """A string slice printed as Go's ``%#v`` does: ``[]string{"a", "b"}``."""

    items: tuple[str, ...]
    type_name: str = "string"

    def __str__(self) -> str:
        return f"[]{self.type_name}{{{', '.join(go_quote(i) for i in self.items)}}}"


def go_value(value: object) -> str:
    """How upstream's field errors print a bad value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return go_quote(value)
    if isinstance(value, int | float | GoSlice):
        return str(value)
    if isinstance(value, list | tuple):
        return str(GoSlice(tuple(str(v) for v in value)))
    return repr(value)


@dataclass(frozen=True, slots=True)
class FieldError:
    """One field-level problem: ``path`` in upstream notation and the message ``body``.

    ``ratchet`` marks the rules the apiserver relaxes on update (CFG-24): for objects read from a
    cluster they are reported as warnings instead of errors.
    """

    path: str
    body: str
    ratchet: bool = False
    code: str = ""  # a warning's code for `check` (its --ignore-warning), where it has one of its own

    def __str__(self) -> str:
        return f"{self.path}: {self.body}"


def _with_detail(head: str, detail: str) -> str:
    return f"{head}: {detail}" if detail else head


def required(path: str, detail: str = "") -> FieldError:
    """``field.Required``: ``Required value[: detail]``."""
    return FieldError(path, _with_detail("Required value", detail))


def invalid(path: str, value: object, detail: str, *, ratchet: bool = False) -> FieldError:
    """``field.Invalid``: ``Invalid value: <value>: detail``."""
    return FieldError(path, _with_detail(f"Invalid value: {go_value(value)}", detail), ratchet)


def invalid_omitting_value(path: str, detail: str) -> FieldError:
    """``field.Invalid`` with the value omitted (values too long or too secret to print)."""
    return FieldError(path, _with_detail("Invalid value", detail))


def not_supported(path: str, value: object, supported: Iterable[str], *, ratchet: bool = False) -> FieldError:
    """``field.NotSupported``: ``Unsupported value: "x": supported values: "a", "b"``."""
    detail = ", ".join(go_quote(v) for v in supported)
    body = f"Unsupported value: {go_value(value)}"
    return FieldError(path, f"{body}: supported values: {detail}" if detail else body, ratchet)


def duplicate(path: str, value: object, *, ratchet: bool = False) -> FieldError:
    """``field.Duplicate``: ``Duplicate value: "x"``."""
    return FieldError(path, f"Duplicate value: {go_value(value)}", ratchet)


def forbidden(path: str, detail: str) -> FieldError:
    """``field.Forbidden``: ``Forbidden: detail``."""
    return FieldError(path, _with_detail("Forbidden", detail))


def too_many(path: str, actual: int, maximum: int) -> FieldError:
    """``field.TooMany``: ``Too many: <n>: must have at most <max> items``."""
    return FieldError(path, f"Too many: {actual}: must have at most {maximum} items")


def child(path: str, name: str) -> str:
    """``Path.Child``: ``a.b``."""
    return f"{path}.{name}" if path else name


def index(path: str, i: int) -> str:
    """``Path.Index``: ``a[i]``."""
    return f"{path}[{i}]"


def key(path: str, k: str) -> str:
    """``Path.Key``: ``a[k]``."""
    return f"{path}[{k}]"


def aggregate(messages: Sequence[str]) -> str:
    """``utilerrors.NewAggregate(...).Error()``: one message bare, several as ``[a, b]``, deduplicated."""
    unique = list(dict.fromkeys(messages))
    return unique[0] if len(unique) == 1 else "[" + ", ".join(unique) + "]"
