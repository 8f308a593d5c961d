"""The backend side of the wire: negotiate a version, encode the request, decode and verify the reply.

Pipeline for one backend call: ``negotiate_version`` (REV-03/05) → ``encode_backend_request``
(REV-06) → transport → ``decode_backend_response`` (REV-08, REV-10, REV-12..14) → ``BackendResponse``.
Nothing downstream knows which AdmissionReview version was spoken.

Every failure here is a call error (``CallingWebhookError``, governed by ``failurePolicy``) whose
``kind`` is one of ``KIND_VERSION`` (REV-05, code 400), ``KIND_DECODE`` (REV-08, code 503) or
``KIND_INVALID_RESPONSE`` (REV-12/13, code 503).
"""

from __future__ import annotations

import binascii
import random
from typing import Final

import msgspec

from gateway.admission import NULL, NestedTooDeeplyError, Status, decode_nested
from gateway.config.model import Webhook
from gateway.errors import CallingWebhookError
from gateway.review.types import JSON_PATCH, KIND, BackendReply, ReviewVersion, api_version
from gateway.review.view import InboundReview

NO_KNOWN_VERSION_REASON: Final = (
    "could not create admission objects: webhook does not accept known AdmissionReview versions (v1, v1beta1)"
)
KIND_VERSION: Final = "version"
KIND_DECODE: Final = "decode"
KIND_INVALID_RESPONSE: Final = "invalid_response"

_reply_decoder: Final = msgspec.json.Decoder(BackendReply | None)
_encoder: Final = msgspec.json.Encoder()
_EMPTY_REPLY: Final = BackendReply()
_SPOKEN: Final[dict[str, ReviewVersion]] = {"v1": "v1", "v1beta1": "v1beta1"}
_API_VERSIONS: Final[dict[ReviewVersion, str]] = {
    version: api_version(version) for version in _SPOKEN.values()
}


# --- negotiation ---------------------------------------------------------------------------------


def negotiate_version(hook: Webhook) -> ReviewVersion | None:
    """The first of the backend's ``admissionReviewVersions`` we speak (REV-03); ``None`` if none (REV-05)."""
    for name in hook.admission_review_versions:
        version = _SPOKEN.get(name)
        if version is not None:
            return version
    return None


def no_known_version_error() -> CallingWebhookError:
    """The REV-05 call error for a backend that accepts neither v1 nor v1beta1 (metrics code 400)."""
    return CallingWebhookError(NO_KNOWN_VERSION_REASON, status_code=400, kind=KIND_VERSION)


def new_request_uid() -> str:
    """A fresh uid for one backend call (REV-06): unique per call, reinvocations included.

    A version-4 UUID from ``random`` (Mersenne Twister, seeded from the OS at start and again in
    every forked worker), not ``uuid.uuid4()``: the uid must be unique, not secret, and
    ``uuid4`` costs a ``getrandom`` system call and ~2.5 µs per call against ~0.7 µs here.
    """
    bits = (random.getrandbits(128) & _UUID4_CLEAR) | _UUID4_SET
    h = f"{bits:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# RFC 9562 version 4: the version nibble is 0100, the variant bits are 10.
_UUID4_CLEAR: Final = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET: Final = (0x4000 << 64) | (0x8000 << 48)


# --- the request to a backend --------------------------------------------------------------------

_HEADS: Final[dict[str, bytes]] = {
    version: b"".join(
        (b'{"apiVersion":"', api_version(version).encode(), b'","kind":"AdmissionReview","request":{"uid":')
    )
    for version in ("v1", "v1beta1")
}
_OBJECT_KEY: Final = b',"object":'


def encode_backend_request(
    inbound: InboundReview,
    *,
    version: ReviewVersion,
    uid: str,
    object: msgspec.Raw | None,
) -> bytes:
    """The AdmissionReview sent to one backend (REV-06).

    The inbound request with ``uid`` (fresh per call) and ``object`` (the current object; ``None``
    for null) in the negotiated ``version``; every other member is copied unchanged, ``dryRun``
    always present. The object's bytes are spliced in, never re-decoded.
    """
    template = inbound.template
    return b"".join(
        (
            _HEADS[version],
            _encoder.encode(uid),
            template.middle,
            _OBJECT_KEY,
            NULL if object is None else object,
            template.suffix,
        )
    )


# --- the reply of a backend ----------------------------------------------------------------------


class BackendResponse(msgspec.Struct, frozen=True, kw_only=True):
    """A backend's reply, decoded and verified for the version sent (REV-10, REV-12..14).

    Guarantees: ``status`` is ``None`` when ``allowed`` (it is ignored then) and may be ``None`` when
    not ("without explanation"). ``patch`` is ``None`` or non-empty decoded bytes, and is only ever
    set for mutating backends; ``patch_type`` is set exactly when ``patch`` is: ``"JSONPatch"``, or
    for v1 any other non-empty string the backend sent. Not checked here, left to the dispatcher:
    that ``patch_type`` is ``JSONPatch`` (MUT-05) and that ``patch`` is a JSON array (MUT-04).
    ``uid`` is the backend's ``response.uid``, for logs only (REV-15).
    """

    allowed: bool
    status: Status | None = None
    patch: bytes | None = None
    patch_type: str | None = None
    audit_annotations: dict[str, str] = msgspec.field(default_factory=dict)
    warnings: list[str] = msgspec.field(default_factory=list)
    uid: str = ""


def _decode_error(detail: str) -> CallingWebhookError:
    return CallingWebhookError(f"failed to call webhook: {detail}", status_code=503, kind=KIND_DECODE)


def _invalid(detail: str) -> CallingWebhookError:
    return CallingWebhookError(
        f"received invalid webhook response: {detail}", status_code=503, kind=KIND_INVALID_RESPONSE
    )


_INT32: Final = range(-(2**31), 2**31)


def _int32_error(value: int, struct: str, path: str) -> CallingWebhookError:
    # upstream: encoding/json's UnmarshalTypeError, as the apiserver's decoder reports an overflow
    return _decode_error(
        f"json: cannot unmarshal number {value} into Go struct field {struct}.{path} of type int32"
    )


def _check_int32(status: Status) -> None:
    """The integers of a Status the apiserver decodes as int32 (``metav1.Status.Code``,
    ``StatusDetails.RetryAfterSeconds``): beyond that range its decoder fails the whole reply, so the
    gateway must never forward one (REV-08)."""
    if status.code not in _INT32:
        raise _int32_error(status.code, "Status", "response.status.code")
    details = status.details
    if details is not None and details.retry_after_seconds not in _INT32:
        path = "response.status.details.retryAfterSeconds"
        raise _int32_error(details.retry_after_seconds, "StatusDetails", path)


def _quote(text: str) -> str:
    """A double-quoted string literal, close to Go's ``%q`` for the texts that can occur here."""
    return _encoder.encode(text).decode()


def _decode_patch(text: str) -> bytes:
    """Standard padded base64, ignoring CR and LF as Go's decoder does (REV-08)."""
    # upstream: encoding/json decodes []byte with base64.StdEncoding, which skips \r and \n.
    if "\n" in text or "\r" in text:
        text = text.replace("\r", "").replace("\n", "")
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except ValueError as exc:  # binascii.Error, or a non-ASCII character
        raise _decode_error(f"illegal base64 data in response.patch: {exc}") from None


def decode_backend_response(
    body: bytes,
    *,
    version: ReviewVersion,
    sent_uid: str,
    mutating: bool,
    status_code: int = 200,
    content_type: str = "application/json",
) -> BackendResponse:
    """Decode and verify a backend's reply to a request sent in ``version`` with ``sent_uid``.

    Raises ``CallingWebhookError`` with the exact REV-08/12/13 reason. ``status_code`` and
    ``content_type`` of the HTTP reply only appear in the text for an empty body, as upstream's.
    """
    if not body:
        # upstream: client-go rest Result.Into
        raise _decode_error(
            f"0-length response with status code: {status_code} and content type: {content_type}"
        )
    try:
        reply = decode_nested(_reply_decoder, body)  # as deep as upstream's decoder allows
    except (msgspec.DecodeError, NestedTooDeeplyError) as exc:
        raise _decode_error(str(exc)) from None
    if reply is None:  # a JSON null decodes into an empty review upstream
        reply = _EMPTY_REPLY

    # upstream: the JSON serializer fills a missing apiVersion/kind from the type it decodes into, so
    # only a declared *other* type fails here, while decoding (REV-12, REV-14).
    expected = _API_VERSIONS[version]
    declared_version = reply.api_version or expected
    declared_kind = reply.kind or KIND
    if declared_kind != KIND or declared_version != expected:
        raise _decode_error(
            f"cannot decode {declared_version}, Kind={declared_kind} into {expected}, Kind={KIND}"
        )
    response = reply.response
    patch = _decode_patch(response.patch) if response is not None and response.patch else b""
    if response is not None and response.status is not None:
        _check_int32(response.status)  # decoded, as upstream's, whether or not the reply allows

    # upstream: request/admissionreview.go VerifyAdmissionResponse
    if response is None:
        raise _invalid("webhook response was absent")
    patch_type = response.patch_type
    if version == "v1":
        received_uid = response.uid or ""
        if received_uid != sent_uid:
            raise _invalid(f"expected response.uid={_quote(sent_uid)}, got {_quote(received_uid)}")
        if reply.api_version != expected or reply.kind != KIND:
            # Reached only with apiVersion and/or kind missing or empty, printed as empty.
            got = f"{reply.api_version or '/'}, Kind={reply.kind or ''}"
            raise _invalid(f"expected webhook response of {expected}, Kind={KIND}, got {got}")
        if mutating:
            if patch and patch_type is None:
                raise _invalid("webhook returned response.patch but not response.patchType")
            if not patch and patch_type is not None:
                raise _invalid("webhook returned response.patchType but not response.patch")
            if patch_type == "":
                raise _invalid('webhook returned invalid response.patchType of ""')
        else:
            if patch:
                raise _invalid("validating webhook may not return response.patch")
            if patch_type is not None:
                raise _invalid("validating webhook may not return response.patchType")
    elif mutating:
        # v1beta1 never checked patchType: a non-empty patch is a JSON Patch (REV-14).
        patch_type = JSON_PATCH if patch else None
    else:
        patch, patch_type = b"", None

    allowed = bool(response.allowed)
    return BackendResponse(
        allowed=allowed,
        status=None if allowed else response.status,
        patch=patch or None,
        patch_type=patch_type if patch else None,
        audit_annotations=response.audit_annotations or {},
        warnings=response.warnings or [],
        uid=response.uid or "",
    )
