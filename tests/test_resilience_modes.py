"""Rollout modes' texts and labels as pure functions (the rule itself: tests/test_dispatch_outcome.py)."""

from __future__ import annotations

import pytest

from gateway.resilience.modes import denial_warning, patch_warning, shadow_outcome


def test_warnings_name_the_webhook() -> None:
    assert denial_warning("img.example.com", "image registry not allowed") == (
        "img.example.com: image registry not allowed"
    )
    assert denial_warning("img.example.com", "") == "img.example.com: denied the request"
    ops = [("add", f"/metadata/labels/l{i}") for i in range(7)]
    assert patch_warning("lbl.example.com", ops[:2]) == (
        "lbl.example.com: would have changed the object: add /metadata/labels/l0, add /metadata/labels/l1"
    )
    assert patch_warning("lbl.example.com", ops).endswith("add /metadata/labels/l4 and 2 more")
    assert len(denial_warning("x.example.com", "m" * 5000)) == 512


SHADOW = [
    pytest.param(True, False, False, "error", id="a call error"),
    pytest.param(False, False, False, "denied", id="a denial"),
    pytest.param(False, True, True, "mutated", id="allowed with a patch"),
    pytest.param(False, True, False, "allowed", id="allowed"),
]


@pytest.mark.parametrize(("call_error", "allowed", "patched", "expected"), SHADOW)
def test_shadow_outcome_labels(call_error: bool, allowed: bool, patched: bool, expected: str) -> None:
    assert shadow_outcome(call_error=call_error, allowed=allowed, patched=patched) == expected
