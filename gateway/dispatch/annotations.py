"""Audit annotations and warnings gathered over one review (AUD-01..09).

The dispatcher records each verified backend reply's ``auditAnnotations`` and ``warnings`` here, plus
the gateway's own per-invocation facts (AUD-05/06), and reads the result back when it answers the
caller. Both collectors are plain per-review values: create one of each per inbound review.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import msgspec

__all__ = [
    "AuditAnnotations",
    "Warnings",
    "failed_open_key",
    "mutation_key",
    "mutation_value",
    "patch_key",
    "patch_value",
]

# upstream: apimachinery validation IsQualifiedName (name part) and IsDNS1123Subdomain (prefix)
_NAME_MAX: Final = 63
_NAME: Final = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_SUBDOMAIN_MAX: Final = 253
_SUBDOMAIN: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")


def _name_problem(name: str) -> str | None:
    if not name:
        return "the name part must not be empty"
    if len(name) > _NAME_MAX:
        return f"the name part must be no more than {_NAME_MAX} characters"
    if not _NAME.match(name):
        return (
            "the name part must consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return None


def _key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid admission annotation key (AUD-02), or None.

    upstream: apiserver pkg/admission/attributes.go checkKeyFormat — exactly one ``/``, then a
    qualified name: a DNS-1123 subdomain prefix and a name part.
    """
    parts = key.split("/")
    if len(parts) != 2:
        return "the key must contain exactly one '/'"
    prefix, name = parts
    if not prefix:
        return "the prefix part must not be empty"
    if len(prefix) > _SUBDOMAIN_MAX or not _SUBDOMAIN.match(prefix):
        return "the prefix part must be a lowercase DNS-1123 subdomain"
    return _name_problem(name)


class _Renamed(msgspec.Struct):
    key: str
    value: str


_encoder: Final = msgspec.json.Encoder()


class AuditAnnotations:
    """The annotations one review returns to the caller (AUD-01..06), first value winning (AUD-03)."""

    __slots__ = ("_out", "_recorded")

    def __init__(self) -> None:
        # key as upstream would record it (``<name>/<k>`` or a gateway key) → value
        self._recorded: dict[str, str] = {}
        # key as returned to the caller (AUD-04/06) → value
        self._out: dict[str, str] = {}

    def add_backend(self, webhook: str, entries: Mapping[str, str]) -> list[str]:
        """Record a verified reply's ``auditAnnotations`` (AUD-01..04); return why entries were dropped.

        Each accepted entry ``k: v`` is returned as ``<webhook>_<k>: v``, or when that key would be longer
        than 63 characters as ``ann-<12 hex of sha256("<webhook>/<k>")>`` with value
        ``{"key":"<webhook>/<k>","value":"<v>"}``.
        """
        reasons: list[str] = []
        for name, value in entries.items():
            key = f"{webhook}/{name}"
            problem = _key_problem(key)
            if problem is not None:
                reasons.append(f'audit annotation "{key}" of webhook "{webhook}" dropped: {problem}')
                continue
            out_key = f"{webhook}_{name}"
            out_value = value
            if len(out_key) > _NAME_MAX:
                out_key = "ann-" + hashlib.sha256(key.encode()).hexdigest()[:12]
                out_value = _encoder.encode(_Renamed(key=key, value=value)).decode()
            reason = self._record(key, value, out_key, out_value)
            if reason:
                reasons.append(f'audit annotation "{key}" of webhook "{webhook}" dropped: {reason}')
        return reasons

    def add_gateway(self, key: str, value: str) -> list[str]:
        """Record one of the gateway's own annotations (AUD-06); return why it was dropped, if it was.

        The key carries no ``/``: the caller prefixes it with the gateway's webhook name.
        """
        problem = _name_problem(key)
        if problem is not None:
            return [f'gateway audit annotation "{key}" dropped: {problem}']
        reason = self._record(key, value, key, value)
        return [f'gateway audit annotation "{key}" dropped: {reason}'] if reason else []

    def _record(self, key: str, value: str, out_key: str, out_value: str) -> str | None:
        recorded = self._recorded.get(key)
        if recorded is not None:
            # upstream: attributesRecord.AddAnnotationWithLevel refuses to overwrite with another value.
            if recorded == value:
                return None
            return f"the key already has the value {recorded!r}; {value!r} is refused"
        taken = self._out.get(out_key)
        if taken is not None and taken != out_value:
            return f"the returned key {out_key!r} is already taken"
        self._recorded[key] = value
        self._out[out_key] = out_value
        return None

    def as_dict(self) -> dict[str, str]:
        """The annotations to put in the reply's ``auditAnnotations``, in the order recorded."""
        return dict(self._out)

    def __len__(self) -> int:
        return len(self._out)

    def __repr__(self) -> str:
        return f"<AuditAnnotations {len(self._out)} keys: {', '.join(self._out)}>"


# --- the gateway's own per-invocation facts (AUD-05/06) ---------------------------------------------


def failed_open_key(kind: Literal["mutating", "validating"], round: int, index: int) -> str:
    """AUD-06: the key naming a backend whose call error was ignored (value: the backend's name)."""
    family = "mutation" if kind == "mutating" else "validating"
    return f"failed-open.{family}.round_{round}_index_{index}"


def mutation_key(round: int, index: int) -> str:
    """AUD-06: the key recording whether a mutating invocation changed the object."""
    return f"mutation.round_{round}_index_{index}"


def mode_key(kind: Literal["mutating", "validating"], round: int, index: int) -> str:
    """The key naming a backend that ran in a rollout mode (Warn, Shadow); Enforce has none."""
    return f"mode.{kind}.round_{round}_index_{index}"


def mode_value(configuration: str, webhook: str, mode: str) -> str:
    """``{"configuration":…,"webhook":…,"mode":"Warn"}``."""
    return _encoder.encode({"configuration": configuration, "webhook": webhook, "mode": mode}).decode()


def patch_key(round: int, index: int) -> str:
    """AUD-06: the key carrying an applied patch (only with ``auditPatches: true``)."""
    return f"patch.round_{round}_index_{index}"


class _Mutation(msgspec.Struct):
    configuration: str
    webhook: str
    mutated: bool


class _Patch(msgspec.Struct, rename="camel"):
    configuration: str
    webhook: str
    patch: msgspec.Raw
    patch_type: str = "JSONPatch"


def mutation_value(configuration: str, webhook: str, mutated: bool) -> str:
    """AUD-05/06: ``{"configuration":…,"webhook":…,"mutated":…}``, upstream's MutationAuditAnnotation."""
    return _encoder.encode(_Mutation(configuration=configuration, webhook=webhook, mutated=mutated)).decode()


def patch_value(configuration: str, webhook: str, patch: bytes) -> str:
    """AUD-05/06: ``{"configuration":…,"webhook":…,"patch":[…],"patchType":"JSONPatch"}``.

    ``patch`` is the backend's patch as received (a JSON array), embedded compacted.
    """
    compact = msgspec.json.format(patch, indent=-1)  # -1: no whitespace at all
    return _encoder.encode(
        _Patch(configuration=configuration, webhook=webhook, patch=msgspec.Raw(compact))
    ).decode()


# --- warnings (AUD-07..09) -------------------------------------------------------------------------

# Go's unicode.IsControl: C0, DEL and C1 (what the caller's warning header check refuses).
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MAX_WARNING_BYTES: Final = 64 * 1024


class Warnings:
    """The warnings one review returns, in arrival order (AUD-07/09)."""

    __slots__ = ("_full", "_max_bytes", "_seen", "_texts", "_used")

    def __init__(self, max_bytes: int = MAX_WARNING_BYTES) -> None:
        self._max_bytes = max_bytes
        self._texts: list[str] = []
        self._seen: set[str] = set()
        self._used = 0
        self._full = False

    def add(self, texts: Sequence[str]) -> list[str]:
        """Record a verified reply's warnings; return why texts were dropped (for the log).

        Empty texts and exact duplicates are dropped silently, as the caller's warning recorder does.
        Texts with invalid UTF-8 or control characters are dropped (the caller could not send them as
        headers), and once ``max_bytes`` of UTF-8 would be exceeded, that text and every later one.
        """
        reasons: list[str] = []
        for text in texts:
            if not text or text in self._seen:
                continue
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError:  # a lone surrogate: the JSON carried invalid UTF-16
                reasons.append(f"warning {text!r} dropped: it is not valid UTF-8")
                continue
            if _CONTROL.search(text):
                reasons.append(f"warning {text!r} dropped: it contains control characters")
                continue
            if self._full or self._used + size > self._max_bytes:
                self._full = True
                reasons.append(f"warning {text[:80]!r} dropped: warnings exceed {self._max_bytes} bytes")
                continue
            self._seen.add(text)
            self._texts.append(text)
            self._used += size
        return reasons

    def as_list(self) -> list[str]:
        """The warnings to put in the reply's ``warnings``."""
        return list(self._texts)

    def __len__(self) -> int:
        return len(self._texts)

    def __repr__(self) -> str:
        return f"<Warnings {len(self._texts)} texts, {self._used} bytes>"
