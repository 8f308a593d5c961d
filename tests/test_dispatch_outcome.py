"""The pure outcome layer without sockets: failurePolicy in one place, the verdict built once.

Every backend invocation is an ``Outcome`` value; ``apply_failure_policy`` says what it does to the
review (FPT-01..03/09, ERR-01/02/04/08, MUT-06..14) and ``settle`` builds the reply, audit
annotations (AUD-05/06), warnings (AUD-07) and the report metrics and logs read (MET-02..06).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from gateway.admission import Status
from gateway.config.backend_policy import BackendMode
from gateway.config.model import FailurePolicy, Webhook
from gateway.dispatch.outcome import (
    Admission,
    Allowed,
    CallFailed,
    DispatchSettings,
    DryRunRefused,
    Invocation,
    MatchRefused,
    Outcome,
    Panicked,
    PatchFailed,
    Rejected,
    apply_failure_policy,
    not_enforced,
    settle,
    shadow_result,
)
from gateway.dispatch.report import DispatchReport
from gateway.errors import CallingWebhookError, MatchingError
from gateway.review import BackendResponse
from tests.matching_support import hook as make_hook


def hook(name: str, index: int, policy: FailurePolicy = "Fail", kind: str = "validating") -> Webhook:
    return msgspec.structs.replace(make_hook(name, failure_policy=policy, index=index), kind=kind)


OK = BackendResponse(allowed=True)
DENY = Status(status="Failure", message="no", code=403)
REFUSED = BackendResponse(allowed=False, status=DENY)
ERROR = CallingWebhookError('failed to call webhook: Post "https://b": connection refused', kind="connect")


def at(h: Webhook, **kw: Any) -> Invocation:
    return Invocation(h, **kw)


POLICY_TABLE: list[Any] = [
    pytest.param(lambda h: Allowed(at(h), OK), "Fail", None, False, id="FPT-01: allowed never denies"),
    pytest.param(
        lambda h: Rejected(at(h), REFUSED, DENY),
        "Ignore",
        403,
        False,
        id="ERR-01: a rejection denies under Ignore too",
    ),
    pytest.param(
        lambda h: CallFailed(at(h), ERROR),
        "Fail",
        500,
        False,
        id="FPT-02/ERR-02: a call error under Fail denies",
    ),
    pytest.param(
        lambda h: CallFailed(at(h), ERROR),
        "Ignore",
        None,
        True,
        id="FPT-03: a call error under Ignore fails open",
    ),
    pytest.param(
        lambda h: DryRunRefused(at(h), Status(code=400, message="dry run")),
        "Ignore",
        400,
        False,
        id="FPT-09: a dry-run refusal denies whatever failurePolicy says",
    ),
    pytest.param(
        lambda h: PatchFailed(at(h), OK, Status(code=500, message="patch")),
        "Ignore",
        500,
        False,
        id="MUT-07: a patch that cannot be applied denies whatever failurePolicy says",
    ),
    pytest.param(
        lambda h: Panicked(at(h), "boom"), "Fail", 500, False, id="VAL-06/ERR-08: a bug under Fail denies"
    ),
    pytest.param(
        lambda h: Panicked(at(h), "boom"), "Ignore", None, True, id="VAL-06: a bug under Ignore fails open"
    ),
    pytest.param(
        lambda h: MatchRefused(
            h, MatchingError(code=404, reason="NotFound", message='namespaces "x" not found')
        ),
        "Ignore",
        404,
        False,
        id="MAT-16: a matching error answers the review whatever failurePolicy says",
    ),
]


@pytest.mark.parametrize(("make", "policy", "code", "failed_open"), POLICY_TABLE)
def test_apply_failure_policy(make: Any, policy: FailurePolicy, code: int | None, failed_open: bool) -> None:
    effect = apply_failure_policy(make(hook("a.example.com", 0, policy)), policy)
    assert (effect.deny.code if effect.deny else None) == code
    assert effect.denies is (code is not None)
    assert effect.failed_open is failed_open


def test_validating_denials_combine_in_configuration_order() -> None:
    """VAL-07/08: every deny counts, in configuration order; failed-open backends are annotated."""
    a, b, c = hook("a.example.com", 0), hook("b.example.com", 1, "Ignore"), hook("c.example.com", 2)
    outcomes: list[Outcome] = [
        Rejected(at(a, position=0), REFUSED, Status(status="Failure", message="a says no", code=403)),
        CallFailed(at(b, position=1), ERROR),
        CallFailed(at(c, position=2), ERROR),
    ]
    report = DispatchReport(kind="validating", operation="CREATE")
    verdict = settle("validating", report, outcomes, DispatchSettings())
    assert verdict.allowed is False and verdict.status is not None
    assert verdict.status.message.index("a says no") < verdict.status.message.index("c.example.com")
    assert verdict.audit_annotations == {"failed-open.validating.round_0_index_1": "b.example.com"}
    assert [(r.name, r.outcome) for r in report.invocations] == [
        ("a.example.com", "rejected"),
        ("b.example.com", "failed_open"),
        ("c.example.com", "failed_closed"),
    ]
    assert report.denied_by == "a.example.com"


def test_backend_annotations_and_warnings_of_every_verified_reply() -> None:
    """AUD-04/07: annotations renamed, warnings in order, also from a denying reply."""
    a, b = hook("a.example.com", 0), hook("b.example.com", 1)
    outcomes: list[Outcome] = [
        Allowed(at(a), BackendResponse(allowed=True, audit_annotations={"k": "v"}, warnings=["one"])),
        Rejected(at(b), BackendResponse(allowed=False, status=DENY, warnings=["two"]), DENY),
    ]
    verdict = settle(
        "validating", DispatchReport(kind="validating", operation="CREATE"), outcomes, DispatchSettings()
    )
    assert verdict.warnings == ["one", "two"]
    assert verdict.audit_annotations == {"a.example.com_k": "v"}


MUTATING_TABLE: list[Any] = [
    pytest.param(
        lambda h: DryRunRefused(at(h), Status(code=400, message="dry run")),
        False,
        {"mutated": False},
        id="AUD-05/06: a dry-run refusal is annotated as not mutated and denies",
    ),
    pytest.param(
        lambda h: Allowed(at(h), OK, mutated=True, patch=[]),
        True,
        {"mutated": True},
        id="AUD-05/06: a changing patch is annotated as mutated",
    ),
    pytest.param(
        lambda h: CallFailed(at(h), ERROR),
        False,
        {"mutated": False},
        id="AUD-05/06: a failed call is annotated as not mutated and denies under Fail",
    ),
]


@pytest.mark.parametrize(("make", "allowed", "value"), MUTATING_TABLE)
def test_mutation_annotation_for_every_invoked_backend(
    make: Any, allowed: bool, value: dict[str, Any]
) -> None:
    h = hook("m.example.com", 3, kind="mutating")
    verdict = settle(
        "mutating", DispatchReport(kind="mutating", operation="CREATE"), [make(h)], DispatchSettings()
    )
    assert verdict.allowed is allowed
    annotation = json.loads(verdict.audit_annotations["mutation.round_0_index_3"])
    assert annotation == {"configuration": "config", "webhook": "m.example.com", **value}


def test_mutating_fail_open_and_patch_audit() -> None:
    """FPT-03/AUD-06: a failed-open mutating backend gets both annotations; auditPatches adds the patch."""
    a, b = hook("a.example.com", 0, "Ignore", "mutating"), hook("b.example.com", 1, kind="mutating")
    ops = [{"op": "add", "path": "/metadata/labels/x", "value": "y"}]
    outcomes: list[Outcome] = [CallFailed(at(a), ERROR), Allowed(at(b), OK, mutated=True, patch=ops)]
    verdict = settle(
        "mutating",
        DispatchReport(kind="mutating", operation="CREATE"),
        outcomes,
        DispatchSettings(audit_patches=True),
        patch=b"[]",
    )
    assert verdict.allowed and verdict.patch == b"[]"
    assert verdict.audit_annotations["failed-open.mutation.round_0_index_0"] == "a.example.com"
    assert json.loads(verdict.audit_annotations["patch.round_0_index_1"])["patch"] == ops


def test_match_refusal_answers_the_review_and_discards_the_patch() -> None:
    """MUT-02: a matching error after an applied patch answers the review with no patch."""
    a, b = hook("a.example.com", 0, kind="mutating"), hook("b.example.com", 1, kind="mutating")
    error = MatchingError(code=500, reason="InternalError", message="Internal error occurred: lookup failed")
    outcomes: list[Outcome] = [Allowed(at(a), OK, mutated=True, patch=[]), MatchRefused(b, error)]
    report = DispatchReport(kind="mutating", operation="CREATE")
    verdict = settle("mutating", report, outcomes, DispatchSettings(), patch=b"[]")
    assert verdict.allowed is False and verdict.patch is None
    assert verdict.status is not None and verdict.status.code == 500
    assert report.denied_by == "b.example.com"


def test_not_enforced_outcomes_are_recorded_but_never_deny() -> None:
    """The rollout seam: a rejection marked not enforced is recorded as one, and the review allowed."""
    a = hook("a.example.com", 0)
    outcome = not_enforced(Rejected(at(a), REFUSED, DENY))
    effect = apply_failure_policy(outcome, "Fail")
    assert effect.deny == DENY and not effect.denies
    report = DispatchReport(kind="validating", operation="CREATE")
    verdict = settle("validating", report, [outcome], DispatchSettings())
    assert verdict.allowed and verdict.status is None
    assert [r.outcome for r in report.invocations] == ["rejected"]


class RefuseOne:
    """A backend policy (the seam for circuit breakers): refuses calls to one backend, or runs it
    in Warn mode (recorded, never enforced); records what it was told."""

    def __init__(self, name: str, *, refuse: bool = True) -> None:
        self.name, self.refuse = name, refuse
        self.seen: list[tuple[str, str]] = []

    def admit(self, hook: Webhook) -> CallingWebhookError | Admission:
        if self.refuse and hook.name == self.name:
            return CallingWebhookError(
                "failed to call webhook: circuit open", status_code=503, kind="refused"
            )
        seen = self.seen

        class Told:
            def settled(self, outcome: Outcome) -> None:
                seen.append((hook.name, type(outcome).__name__))

            def abandoned(self) -> None:
                seen.append((hook.name, "abandoned"))

        return Told()

    def mode(self, hook: Webhook) -> BackendMode:
        return "Enforce" if self.refuse or hook.name != self.name else "Warn"


SEAM_TABLE: list[Any] = [
    pytest.param(
        "validate", "Fail", True, False, id="FPT-02: a call the backend policy refuses denies under Fail"
    ),
    pytest.param(
        "validate",
        "Ignore",
        True,
        True,
        id="FPT-03: a call the backend policy refuses fails open under Ignore",
    ),
    pytest.param("mutate", "Fail", True, False, id="MUT-14: a refused call stops the chain under Fail"),
    pytest.param(
        "validate",
        "Fail",
        False,
        True,
        id="rollout: a denying backend not enforced leaves the review allowed",
    ),
    pytest.param(
        "mutate",
        "Fail",
        False,
        True,
        id="rollout: a denying mutating backend not enforced lets the chain go on",
    ),
]


@pytest.mark.parametrize(("endpoint", "policy", "refuse", "allowed"), SEAM_TABLE)
async def test_backend_policy_seam(endpoint: str, policy: str, refuse: bool, allowed: bool) -> None:
    from gateway.dispatch.engine import Dispatcher
    from tests.support.gateway import hook as hook_doc
    from tests.test_dispatch_deadlines import NoNamespaces, VirtualBackends, inbound, snapshot

    kind = "ValidatingWebhookConfiguration" if endpoint == "validate" else "MutatingWebhookConfiguration"
    snap = snapshot(
        hook_doc("ok.example.com", "https://ok", failurePolicy=policy),
        hook_doc("guarded.example.com", "https://guarded", failurePolicy=policy),
        kind=kind,
    )
    backends = VirtualBackends({"ok.example.com": (0, "allow"), "guarded.example.com": (0, "deny")})
    seam = RefuseOne("guarded.example.com", refuse=refuse)
    dispatcher = Dispatcher(backends, NoNamespaces(), policy=seam)
    run = dispatcher.validate if endpoint == "validate" else dispatcher.mutate
    verdict = await run(inbound(), snap, deadline=1e9)
    assert verdict.allowed is allowed, verdict.status
    called = [name for name, _, _ in backends.calls]
    assert ("guarded.example.com" in called) is (not refuse)
    if refuse and not allowed:
        assert verdict.status is not None and "circuit open" in verdict.status.message
    assert ("guarded.example.com" in [name for name, _ in seam.seen]) is (
        not refuse
    )  # refused: never settled


MODE_TABLE: list[Any] = [
    pytest.param(
        lambda h: Rejected(at(h, mode="Warn"), REFUSED, DENY), "Fail", False, ["a.example.com: no"],
        id="Warn: a rejection allows with the warning <webhook>: <backend message>",
    ),
    pytest.param(
        lambda h: CallFailed(at(h, mode="Warn"), ERROR), "Fail", True, [],
        id="Warn: a call error under Fail fails open as under Ignore",
    ),
    pytest.param(
        lambda h: Allowed(at(h, mode="Warn"), OK, withheld=[{"op": "add", "path": "/metadata/labels/x"}]),
        "Fail", False, ["a.example.com: would have changed the object: add /metadata/labels/x"],
        id="Warn: a withheld patch is a warning naming its operations",
    ),
    pytest.param(
        lambda h: CallFailed(at(h, mode="Shadow"), ERROR), "Fail", False, [],
        id="Shadow: a call error never fails the review and records no fail-open",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("make", "policy", "failed_open", "warnings"), MODE_TABLE)
def test_rollout_modes_never_deny(
    make: Any, policy: FailurePolicy, failed_open: bool, warnings: list[str]
) -> None:
    outcome = make(hook("a.example.com", 0, policy))
    effect = apply_failure_policy(outcome, policy)
    assert not effect.denies and effect.failed_open is failed_open
    report = DispatchReport(kind="validating", operation="CREATE")
    verdict = settle("validating", report, [outcome], DispatchSettings())
    assert verdict.allowed and verdict.status is None
    assert verdict.warnings == warnings
    assert ("failed-open.validating.round_0_index_0" in verdict.audit_annotations) is failed_open


SHADOW_RESULTS: list[Any] = [
    pytest.param(lambda h: Allowed(at(h), OK), "allowed", "", id="allowed unchanged"),
    pytest.param(
        lambda h: Allowed(at(h), OK, withheld=[{"op": "add", "path": "/metadata/labels/x"}]),
        "mutated", "would have changed the object: add /metadata/labels/x", id="a patch that would change",
    ),
    pytest.param(lambda h: Rejected(at(h), REFUSED, DENY), "denied", "no", id="a denial, with its message"),
    pytest.param(lambda h: CallFailed(at(h), ERROR), "error", "connection refused", id="a call error"),
    pytest.param(
        lambda h: PatchFailed(at(h), OK, Status(code=500, message="bad patch")), "error", "bad patch",
        id="a patch that cannot be applied is an error",
    ),
    pytest.param(
        lambda h: DryRunRefused(at(h), Status(code=400, message="dry run")), "denied", "dry run",
        id="a dry-run refusal would have denied",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("make", "label", "message"), SHADOW_RESULTS)
def test_shadow_result_labels_and_would_be_messages(make: Any, label: str, message: str) -> None:
    got_label, got_message = shadow_result(make(hook("a.example.com", 0)))
    assert got_label == label
    assert message in got_message
