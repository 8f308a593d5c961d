"""Rollout modes (``Enforce | Warn | Shadow``): the texts and labels a mode's result is reported with.

The rule a mode applies to a backend's outcome lives in one place, the dispatch outcome layer
(``gateway.dispatch.outcome.apply_failure_policy``): a mode can only make a backend *less* strict
than Enforce. Warn turns a denial into "allowed, with the warning ``<name>: <message>``", handles a
call error as under failurePolicy Ignore and does not apply a patch; Shadow records the result and
never uses it. Here, as pure functions: those warnings, and the ``outcome`` label of a Shadow result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

ShadowOutcome = Literal["allowed", "denied", "mutated", "error"]

_MAX_PATCH_OPS_SHOWN: Final = 5
_MAX_WARNING_CHARS: Final = 512  # the apiserver truncates longer warnings anyway


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
