"""The ``webhook-gateway.io/backend-policy`` annotation: per-backend resilience settings.

On a Validating/MutatingWebhookConfiguration, the annotation's value is YAML (or JSON) mapping a
webhook name of that object, or ``"*"`` for all of them, to settings::

    "*": {circuitBreaker: {consecutiveFailures: 5, openSeconds: 10}, maxInFlight: 200}
    new-check.team-a.example.com: {mode: Shadow}
    "*": {caFrom: {secret: {namespace: team-a, name: policy-ca, key: ca.crt}}}

``caFrom`` names where the backend's CA bundle is kept (``gateway.config.trust``). A named entry
overrides ``"*"`` field by field (inside ``circuitBreaker`` too); an explicit ``null`` turns an
inherited protection (or reference) off for that webhook. Problems are field errors whose path
names the annotation and the key, e.g.
``metadata.annotations[webhook-gateway.io/backend-policy][*].maxInFlight: Invalid value: 0: ...``.
Pure: no I/O; the result is attached to each ``Webhook`` of the snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal

import msgspec
import yaml

from gateway.config.fielderrors import FieldError, child, invalid, invalid_omitting_value, key, not_supported
from gateway.config.trust import CA_FROM, CaReference, parse_ca_from

ANNOTATION: Final = "webhook-gateway.io/backend-policy"
ALL_WEBHOOKS: Final = "*"
MAX_ANNOTATION_BYTES: Final = 64 * 1024

BackendMode = Literal["Enforce", "Warn", "Shadow"]
MODES: Final[tuple[BackendMode, ...]] = ("Enforce", "Shadow", "Warn")  # sorted, as errors list them

DEFAULT_CONSECUTIVE_FAILURES: Final = 5
DEFAULT_OPEN_SECONDS: Final = 10.0
MAX_CONSECUTIVE_FAILURES: Final = 10_000
MAX_OPEN_SECONDS: Final = 3600.0
MAX_IN_FLIGHT: Final = 1_000_000

_ENTRY_FIELDS: Final = (CA_FROM, "circuitBreaker", "maxInFlight", "mode")
_BREAKER_FIELDS: Final = ("consecutiveFailures", "openSeconds")


class CircuitBreakerPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """Open after ``consecutive_failures`` call errors in a row, for ``open_seconds``."""

    consecutive_failures: int = DEFAULT_CONSECUTIVE_FAILURES
    open_seconds: float = DEFAULT_OPEN_SECONDS


class BackendPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """One backend's settings: resilience and rollout mode, and where its CA bundle comes from.

    The default protects nothing, enforces, and trusts the configuration's own ``caBundle``.
    """

    circuit_breaker: CircuitBreakerPolicy | None = None
    max_in_flight: int | None = None
    mode: BackendMode = "Enforce"
    ca_from: CaReference | None = None

    def describe(self) -> str:
        """A one-line summary for ``check``: ``mode=Shadow circuitBreaker=5/10s maxInFlight=200``."""
        parts = [f"mode={self.mode}"]
        if (cb := self.circuit_breaker) is not None:
            parts.append(f"circuitBreaker={cb.consecutive_failures}/{cb.open_seconds:g}s")
        if self.max_in_flight is not None:
            parts.append(f"maxInFlight={self.max_in_flight}")
        if self.ca_from is not None:
            parts.append(f"caFrom={self.ca_from.describe()}")
        return " ".join(parts)


DEFAULT_POLICY: Final = BackendPolicy()


@dataclass(frozen=True, slots=True)
class PolicyAnnotation:
    """A parsed annotation: the ``"*"`` entry and the named entries, each only its given fields."""

    default: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    named: Mapping[str, Mapping[str, object]] = field(default_factory=lambda: MappingProxyType({}))

    def for_webhook(self, name: str) -> BackendPolicy:
        """The effective policy of webhook ``name``: its entry over ``"*"``, field by field."""
        entry = dict(self.default)
        own = self.named.get(name, {})
        for k, v in own.items():
            if k == "circuitBreaker" and isinstance(v, Mapping) and isinstance(entry.get(k), Mapping):
                base = entry[k]
                assert isinstance(base, Mapping)
                entry[k] = {**base, **v}
            else:
                entry[k] = v
        breaker = entry.get("circuitBreaker")
        limit = entry.get("maxInFlight")
        mode = entry.get("mode", "Enforce")
        ca_from = entry.get(CA_FROM)
        return BackendPolicy(
            circuit_breaker=None
            if not isinstance(breaker, Mapping)
            else CircuitBreakerPolicy(
                consecutive_failures=int(breaker.get("consecutiveFailures", DEFAULT_CONSECUTIVE_FAILURES)),
                open_seconds=float(breaker.get("openSeconds", DEFAULT_OPEN_SECONDS)),
            ),
            max_in_flight=limit if isinstance(limit, int) else None,
            mode=mode if mode in MODES else "Enforce",
            ca_from=ca_from.for_webhook(name) if isinstance(ca_from, CaReference) else None,
        )


def policy_for(annotation: PolicyAnnotation | None, name: str) -> BackendPolicy:
    """The policy of webhook ``name`` of a configuration (the default when it has no annotation)."""
    return DEFAULT_POLICY if annotation is None else annotation.for_webhook(name)


@dataclass(slots=True)
class ParsedPolicy:
    """What parsing one configuration's annotation found."""

    annotation: PolicyAnnotation | None = None
    errors: list[FieldError] = field(default_factory=list)
    warnings: list[FieldError] = field(default_factory=list)


ROOT: Final = key(child("metadata", "annotations"), ANNOTATION)


def _safe_loader() -> type[yaml.SafeLoader]:
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def _integer(value: object, path: str, low: int, high: int, found: ParsedPolicy) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        found.errors.append(invalid_omitting_value(path, f"must be an integer, not {_type_name(value)}"))
        return False
    if not low <= value <= high:
        found.errors.append(invalid(path, value, f"must be between {low} and {high}"))
        return False
    return True


def _breaker(value: object, path: str, found: ParsedPolicy) -> dict[str, object] | None:
    if not isinstance(value, dict):
        found.errors.append(
            invalid_omitting_value(path, f"must be an object or null, not {_type_name(value)}")
        )
        return None
    ok: dict[str, object] = {}
    for k, v in value.items():
        p = child(path, str(k))
        if k == "consecutiveFailures":
            if _integer(v, p, 1, MAX_CONSECUTIVE_FAILURES, found):
                ok[k] = v
        elif k == "openSeconds":
            if isinstance(v, bool) or not isinstance(v, int | float):
                found.errors.append(invalid_omitting_value(p, f"must be a number, not {_type_name(v)}"))
            elif not 0 < v <= MAX_OPEN_SECONDS:
                found.errors.append(invalid(p, v, f"must be more than 0 and at most {MAX_OPEN_SECONDS:g}"))
            else:
                ok[k] = float(v)
        else:
            found.warnings.append(FieldError(p, f"unknown field; known fields: {', '.join(_BREAKER_FIELDS)}"))
    return ok


def _entry(value: object, path: str, found: ParsedPolicy) -> dict[str, object]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        found.errors.append(invalid_omitting_value(path, f"must be an object, not {_type_name(value)}"))
        return {}
    ok: dict[str, object] = {}
    for k, v in value.items():
        p = child(path, str(k))
        if k == "circuitBreaker":
            if v is None:
                ok[k] = None
            elif (breaker := _breaker(v, p, found)) is not None:
                ok[k] = MappingProxyType(breaker)
        elif k == "maxInFlight":
            if v is None or _integer(v, p, 1, MAX_IN_FLIGHT, found):
                ok[k] = v
        elif k == CA_FROM:
            parsed = parse_ca_from(v, p)
            found.errors.extend(parsed.errors)
            found.warnings.extend(parsed.warnings)
            if not parsed.errors:
                ok[k] = parsed.reference  # None: an explicit null turns an inherited reference off
        elif k == "mode":
            if v in MODES:
                ok[k] = v
            else:
                found.errors.append(not_supported(p, v, MODES))
        else:
            found.warnings.append(FieldError(p, f"unknown field; known fields: {', '.join(_ENTRY_FIELDS)}"))
    return ok


def parse_backend_policy(annotations: Mapping[str, str] | None, webhook_names: Sequence[str]) -> ParsedPolicy:
    """Parse and validate one configuration's annotation against the names of its webhooks."""
    found = ParsedPolicy()
    text = (annotations or {}).get(ANNOTATION)
    if text is None:
        return found
    if len(text.encode()) > MAX_ANNOTATION_BYTES:
        found.errors.append(invalid_omitting_value(ROOT, f"must be at most {MAX_ANNOTATION_BYTES} bytes"))
        return found
    try:
        body = yaml.load(text, Loader=_safe_loader())  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        found.errors.append(invalid_omitting_value(ROOT, f"not valid YAML or JSON{where}: {problem}"))
        return found
    except RecursionError:
        found.errors.append(invalid_omitting_value(ROOT, "nests too deeply"))
        return found
    if body is None:
        return found  # an empty annotation: no policy
    if not isinstance(body, dict):
        found.errors.append(
            invalid_omitting_value(
                ROOT, f'must map webhook names or "*" to settings, not be {_type_name(body)}'
            )
        )
        return found
    names = set(webhook_names)
    default: dict[str, object] = {}
    named: dict[str, Mapping[str, object]] = {}
    for k, v in body.items():
        if not isinstance(k, str):
            found.errors.append(invalid(ROOT, str(k), 'keys must be webhook names or "*"'))
            continue
        path = key(ROOT, k)
        if k != ALL_WEBHOOKS and k not in names:
            found.errors.append(
                invalid(path, k, 'no webhook of this name in this configuration (use "*" for all of them)')
            )
            continue
        entry = _entry(v, path, found)
        if k == ALL_WEBHOOKS:
            default = entry
        else:
            named[k] = MappingProxyType(entry)
    if found.errors:
        return found
    found.annotation = PolicyAnnotation(MappingProxyType(default), MappingProxyType(named))
    return found
