"""Rollout modes (``Enforce | Warn | Shadow``): how a backend's result is used, as pure functions.

The dispatch outcome layer applies these to each backend's outcome; nothing here knows the
AdmissionReview. The rule they keep: a mode can only make a backend *less* strict than Enforce.

- Warn: a denial becomes "allowed, with the warning ``<name>: <message>``"; a call error is handled
  as under failurePolicy Ignore; a patch is not applied, and the warning says what it would change.
- Shadow: the result is recorded (``shadow_outcome``) and logged, never used; a call error is
  handled as under Ignore without the fail-open annotation (nothing was enforced to fail open).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

from gateway.config.backend_policy import BackendMode

FailurePolicy = Literal["Fail", "Ignore"]
ShadowOutcome = Literal["allowed", "denied", "mutated", "error"]
SHADOW_OUTCOMES: Final[tuple[ShadowOutcome, ...]] = ("allowed", "denied", "mutated", "error")

_MAX_PATCH_OPS_SHOWN: Final = 5
_MAX_WARNING_CHARS: Final = 512  # the apiserver truncates longer warnings anyway


def enforces(mode: BackendMode) -> bool:
    """Does the backend's result decide the review?"""
    return mode == "Enforce"


def effective_failure_policy(mode: BackendMode, failure_policy: FailurePolicy) -> FailurePolicy:
    """Warn and Shadow never fail a review: their call errors are handled as under Ignore."""
    return failure_policy if mode == "Enforce" else "Ignore"


def _bounded(text: str) -> str:
    return text if len(text) <= _MAX_WARNING_CHARS else text[: _MAX_WARNING_CHARS - 1] + "…"


def denial_warning(webhook: str, message: str) -> str:
    """Warn mode: the warning that replaces a denial (shown to kubectl users)."""
    return _bounded(f"{webhook}: {message}" if message else f"{webhook}: denied the request")


def patch_warning(webhook: str, operations: Sequence[tuple[str, str]]) -> str:
    """Warn mode: what a mutating backend would have changed, from its JSON Patch ``(op, path)`` pairs."""
    shown = ", ".join(f"{op} {path}" for op, path in operations[:_MAX_PATCH_OPS_SHOWN])
    more = len(operations) - _MAX_PATCH_OPS_SHOWN
    if more > 0:
        shown += f" and {more} more"
    return _bounded(f"{webhook}: would have changed the object: {shown}")


def shadow_outcome(*, call_error: bool, allowed: bool, patched: bool) -> ShadowOutcome:
    """The ``outcome`` label of ``webhook_gateway_shadow_decisions_total`` for one shadow result."""
    if call_error:
        return "error"
    if not allowed:
        return "denied"
    return "mutated" if patched else "allowed"
