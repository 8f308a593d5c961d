"""The mutating driver (MUT-01..25): the serial chain with at most one reinvocation round.

A thin loop over I/O: for each backend in effective order, match against the current object, invoke
it (``gateway.dispatch.invoke``), and let the pure ``ChainObject.apply`` say what its reply does to
the object (MUT-04..12); the chain stops at the first outcome whose ``Effect`` denies (MUT-13/14,
FPT-09). The outcomes and the combined patch go to ``outcome.settle``. No exception steers the chain.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.admission import AdmissionAttributes, decode_nested, is_null, nesting_allowed
from gateway.config.model import Webhook
from gateway.dispatch import jsonpatch, status
from gateway.dispatch.invoke import Called, Calls, reply_outcome
from gateway.dispatch.outcome import (
    Allowed,
    CallFailed,
    Invocation,
    Matching,
    MatchRefused,
    Outcome,
    PatchFailed,
    PatchMode,
    apply_failure_policy,
)
from gateway.dispatch.reinvocation import ReinvocationState
from gateway.dispatch.report import DispatchReport, ModeRecord
from gateway.errors import CallingWebhookError
from gateway.matching import Call, CallFailure, Refuse, should_call
from gateway.review import JSON_PATCH

_encode = msgspec.json.Encoder().encode
_decoder = msgspec.json.Decoder()


class ChainObject:
    """The object as the chain has patched it so far (pure; one per review).

    The inbound object is decoded lazily, only when the first patch arrives; ``attrs`` always
    carries the current object for matching and the next call. A patched object is encoded when
    ``attrs`` is next read, not when the patch is applied: after the chain's last backend nothing
    reads it, and that encode (~1 % of a chain of three) is never made.
    """

    __slots__ = ("_attrs", "_unencoded", "doc", "inbound_doc", "patches")

    def __init__(self, attrs: AdmissionAttributes) -> None:
        self._attrs = attrs
        self._unencoded = False  # ``doc`` changed since ``_attrs`` was made
        self.inbound_doc: Any = None
        self.doc: Any = None
        self.patches: list[bytes] = []

    @property
    def attrs(self) -> AdmissionAttributes:
        """The request with the current object (encoded now if a patch changed it since)."""
        if self._unencoded:
            try:
                encoded = _encode(self.doc)
            except RecursionError:  # patched at the default limit, but encoded deeper in the stack
                with nesting_allowed():
                    encoded = _encode(self.doc)
            self._attrs = self._attrs.with_object(msgspec.Raw(encoded))
            self._unencoded = False
        return self._attrs

    def apply(self, hook: Webhook, called: Called, at: Invocation) -> Outcome:
        """REV-11 / MUT-04..13: what a verified reply does to the chain (``invoke.Classify``).

        A backend in Warn or Shadow mode (``at.mode``): the patch is checked like any other but not
        applied; the ops that would have changed the object come back as ``Allowed.withheld``.
        """
        resp = called.response
        if not resp.allowed or resp.patch is None:  # MUT-13, or nothing to apply
            return reply_outcome(hook, called, at)
        commit = at.mode == "Enforce"
        if called.version == "v1" and resp.patch_type != JSON_PATCH:  # MUT-05
            error = CallingWebhookError(
                f'unsupported patch type "{resp.patch_type}"', status_code=400, kind="bad_response"
            )
            return CallFailed(at, error, resp)
        try:
            ops = jsonpatch.decode_patch(resp.patch)
        except jsonpatch.PatchDecodeError as exc:  # MUT-04
            error = CallingWebhookError(
                f"received undecodable patch in webhook response: {exc}", status_code=503, kind="bad_response"
            )
            return CallFailed(at, error, resp)
        if not ops:
            return Allowed(at, resp)
        try:
            return self._apply(hook, ops, resp.patch, at, resp, commit=commit)
        except RecursionError:
            pass
        # An object nested deeper than Python's default recursion allows (up to the apiserver's
        # 10,000 levels): patched like any other; deeper still is refused, never a crash.
        with nesting_allowed():
            try:
                return self._apply(hook, ops, resp.patch, at, resp, commit=commit, encode_now=True)
            except RecursionError:
                st = status.patch_failure_status(hook.name, "the object is nested too deeply to patch")
                return PatchFailed(at, resp, st)

    def _apply(
        self,
        hook: Webhook,
        ops: list[Any],
        raw: bytes,
        at: Invocation,
        resp: Any,
        *,
        commit: bool,
        encode_now: bool = False,
    ) -> Outcome:
        """MUT-06..12: apply all-or-nothing to the current object; internal errors deny with 500.

        ``encode_now``: a deeply nested object (the retry under ``nesting_allowed``) is encoded here,
        where a RecursionError still refuses the patch, instead of when ``attrs`` is next read.
        """
        if self.doc is None:  # the first patch of the chain (later ones have the decoded object)
            inbound = self._attrs.object  # not patched yet: ``_attrs`` holds the inbound object
            if is_null(inbound):  # MUT-06: DELETE carries no object to modify
                return PatchFailed(at, resp, status.patch_on_delete_status(hook.name))
            self.inbound_doc = decode_nested(_decoder, inbound)  # type: ignore[arg-type]
            self.doc = self.inbound_doc
        # Nothing below changes the chain until the very end, so a RecursionError can be retried.
        before = self.doc
        try:
            after = jsonpatch.apply_patch(before, ops)
        except jsonpatch.PatchApplyError as exc:  # MUT-07
            return PatchFailed(at, resp, status.patch_failure_status(hook.name, str(exc)))
        if not isinstance(after, dict):  # MUT-09
            st = status.not_an_object_status(hook.name, f"patched object is a {type(after).__name__}")
            return PatchFailed(at, resp, st)
        if (after.get("apiVersion"), after.get("kind")) != (before.get("apiVersion"), before.get("kind")):
            st = status.changed_kind_status(  # MUT-10
                hook.name,
                str(before.get("apiVersion", "")),
                str(before.get("kind", "")),
                str(after.get("apiVersion", "")),
                str(after.get("kind", "")),
            )
            return PatchFailed(at, resp, st)
        changed = not jsonpatch.json_equal(before, after)
        if not commit:
            return Allowed(at, resp, withheld=ops if changed else None)
        if changed:
            if encode_now:
                self._attrs = self._attrs.with_object(msgspec.Raw(_encode(after)))
                self.doc, self._unencoded = after, False
            else:
                self.doc, self._unencoded = after, True
        self.patches.append(raw)
        return Allowed(at, resp, mutated=changed, patch=ops)

    def combined_patch(self, mode: PatchMode) -> bytes | None:
        """MUT-22..24: one patch from the inbound object to the final one, or None if equal."""
        if not self.patches or self.doc is None:
            return None
        try:
            return self._combined(mode)
        except RecursionError:
            pass
        with nesting_allowed():  # a deeply nested object (see ``apply``)
            return self._combined(mode)

    def _combined(self, mode: PatchMode) -> bytes | None:
        if jsonpatch.json_equal(self.inbound_doc, self.doc):
            return None
        if mode == "diff":
            return _encode(jsonpatch.diff_patch(self.inbound_doc, self.doc))
        return jsonpatch.concat_patches(self.patches)


async def mutate(
    calls: Calls, matching: Matching, report: DispatchReport
) -> tuple[list[Outcome], bytes | None]:
    """MUT-01..25: the outcomes of one review's chain, in chain order, and its combined patch.

    The candidates are fixed for the whole chain: rules read only operation and resource, which no
    patch changes.
    """
    chain = ChainObject(calls.inbound.attributes)
    policy = calls.backends.policy
    state = ReinvocationState()
    outcomes: list[Outcome] = []
    for round_ in (0, 1):
        if round_ == 1 and not state.should_run_round_1:
            break
        for plan, direct in matching.candidates:
            hook = plan.hook
            if round_ == 1 and not state.should_reinvoke(hook.identity):
                continue  # MUT-16/17: only backends in R, and only those invoked in round 0
            decision = should_call(
                plan,
                chain.attrs,
                matching.namespace,
                direct=direct,
                equivalents=matching.settings.equivalents,
                inputs=matching.inputs,
            )
            report.note_conditions(hook.name, decision)
            if isinstance(decision, Refuse):  # MUT-02: answers the review, earlier patches discarded
                outcomes.append(MatchRefused(hook, decision.error))
                return outcomes, None
            if not isinstance(decision, Call | CallFailure):
                continue
            report.matched += 1
            pre_error = decision.error if isinstance(decision, CallFailure) else None
            mode = policy.mode(hook)
            if mode != "Enforce":
                report.modes.append(ModeRecord(hook.name, hook.configuration, mode, round_, hook.index))
            if mode == "Shadow":  # called apart from the review, on its own copy of the chain so far
                calls.shadow(hook, chain.attrs, ChainObject(chain.attrs).apply, pre_error, round_=round_)
                continue
            if round_ == 1:
                report.reinvoked.append(hook.name)
            at = Invocation(hook, round=round_, mode=mode)
            outcome = await calls.invoke(at, chain.attrs, chain.apply, pre_error)
            outcomes.append(outcome)
            if apply_failure_policy(outcome, hook.failure_policy).denies:
                return outcomes, None  # MUT-13/14, FPT-09, MUT-06..10
            changed = isinstance(outcome, Allowed) and outcome.mutated
            state.record(hook.identity, if_needed=hook.reinvocation_policy == "IfNeeded", changed=changed)
    try:
        patch = chain.combined_patch(matching.settings.patch_mode)
    except RecursionError:  # beyond even the raised limit: the ops as the backends sent them
        patch = jsonpatch.concat_patches(chain.patches)
    return outcomes, patch
