"""Verification of every answer: a wrong answer is an error by kind, never throughput.

Checks, in order: HTTP status, decodable AdmissionReview, apiVersion and kind, uid, the expected
decision (and the denial message naming the backend), and for mutations that the patch applies and
adds exactly the expected labels. Patch checks are cached per (template, patch) because backends are
deterministic, so the generator stays cheap.
"""

from __future__ import annotations

import base64
import binascii

import msgspec

from gateway.dispatch.jsonpatch import apply_patch
from loadtests.fixtures import ReviewTemplate
from loadtests.scenarios import Expectation

OK = "ok"
INJECTED = "injected"  # a correct answer reflecting an injected backend failure (--error-rate)


class _Status(msgspec.Struct):
    code: int = 0
    message: str = ""


class _Response(msgspec.Struct, rename="camel"):
    uid: str = ""
    allowed: bool = False
    status: _Status | None = None
    patch: str | None = None
    patch_type: str | None = None


class _Review(msgspec.Struct, rename={"api_version": "apiVersion"}):
    api_version: str = ""
    kind: str = ""
    response: _Response | None = None


_decode = msgspec.json.Decoder(_Review).decode


class Verifier:
    """Classifies answers; ``error_rate`` > 0 tolerates failures caused by injected backend errors."""

    def __init__(self, error_rate: float = 0.0) -> None:
        self.error_rate = error_rate
        self._patch_cache: dict[tuple[int, str], str] = {}

    def check(self, status: int, body: bytes, uid: str, template: ReviewTemplate, expect: Expectation) -> str:
        """Return ``OK``, ``INJECTED`` or an error kind."""
        if status != 200:
            if self.error_rate and not expect.via_gateway and status == 500:
                return INJECTED
            return f"http-{status}"
        try:
            review = _decode(body)
        except msgspec.DecodeError:
            return "undecodable-body"
        if review.kind != "AdmissionReview" or review.api_version != template.api_version:
            return "wrong-api-version-or-kind"
        r = review.response
        if r is None:
            return "no-response"
        if r.uid != uid:
            return "wrong-uid"
        if r.allowed != expect.allowed:
            if (
                self.error_rate
                and not r.allowed
                and r.status is not None
                and "failed calling webhook" in r.status.message
            ):
                return INJECTED
            return "wrong-decision"
        if not r.allowed:
            if expect.message_contains and (
                r.status is None or expect.message_contains not in r.status.message
            ):
                return "wrong-denial-message"
            return OK
        if not expect.labels:
            return "unexpected-patch" if r.patch else OK
        if not r.patch:
            return "patch-missing"
        if r.patch_type != "JSONPatch":
            return "wrong-patch-type"
        key = (id(template), r.patch)
        verdict = self._patch_cache.get(key)
        if verdict is None:
            verdict = self._check_patch(r.patch, template, expect)
            if len(self._patch_cache) < 10000:
                self._patch_cache[key] = verdict
        return verdict

    @staticmethod
    def _check_patch(patch: str, template: ReviewTemplate, expect: Expectation) -> str:
        try:
            ops = msgspec.json.decode(base64.b64decode(patch, validate=True))
        except (binascii.Error, msgspec.DecodeError):
            return "patch-undecodable"
        try:
            # The gateway's own implementation: upstream's semantics, and it never modifies its input.
            result = apply_patch(template.obj, ops)
        except Exception:  # noqa: BLE001  # any failure to apply is the error we are looking for
            return "patch-does-not-apply"
        before = template.obj["metadata"].get("labels") or {}
        after = (result.get("metadata") or {}).get("labels") or {}
        added = {k for k in after if k not in before}
        if added != set(expect.labels) or any(after[k] != "true" for k in expect.labels):
            return "patch-wrong-result"
        return OK
