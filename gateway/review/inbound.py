"""The caller's side of the wire: decode its AdmissionReview, encode the gateway's answer.

``decode_inbound`` turns the request body of ``POST /validate`` or ``/mutate`` into an
``InboundReview`` (REV-01, REV-07) whose ``attributes`` feed matching and dispatch; anything
malformed raises ``BadReview``, which the server answers with HTTP 400 and
``encode_bad_request_status``. ``encode_reply`` writes the single HTTP 200 reply in the inbound
version with the inbound uid (REV-02), in a shape the caller's strict v1 verification accepts (GW-16).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from gateway.admission import OPERATIONS, AdmissionAttributes, NestedTooDeeplyError, Status, decode_nested
from gateway.errors import BadReview
from gateway.review.types import (
    API_VERSIONS,
    JSON_PATCH,
    KIND,
    InboundEnvelope,
    MetaStatus,
    Reply,
    ReplyResponse,
)
from gateway.review.view import InboundReview

__all__ = [
    "JSON_PATCH",
    "InboundReview",
    "ReplyTemplate",
    "decode_inbound",
    "encode_bad_request_status",
    "encode_reply",
    "encode_status",
]

_inbound_decoder: Final = msgspec.json.Decoder(InboundEnvelope)
_encoder: Final = msgspec.json.Encoder()

_OPERATIONS_TEXT: Final = "CREATE, UPDATE, DELETE, CONNECT"
_OPEN_BRACE: Final = ord("{")
_N: Final = ord("n")


def _check_utf8(body: bytes) -> None:
    """REV-01: JSON text is UTF-8. Checked for the whole body, because objects are forwarded as bytes."""
    if body.isascii():  # nearly every review: no copy, no decode
        return
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        byte, offset = body[exc.start], exc.start
        detail = f"{exc.reason} (byte 0x{byte:02x} at offset {offset})"
        raise BadReview(f"request body is not valid UTF-8: {detail}") from None


def _object_or_null(doc: msgspec.Raw, field: str) -> msgspec.Raw | None:
    """``None`` for JSON null; the Raw itself for a JSON object; anything else is malformed."""
    # msgspec hands Raw exactly one well-formed value, so the first byte tells its type.
    first = memoryview(doc)[0]
    if first == _OPEN_BRACE:
        return doc
    if first == _N:  # "n" can only start "null"
        return None
    raise BadReview(f"request.{field} must be a JSON object or null")


def decode_inbound(body: bytes) -> InboundReview:
    """Decode and validate the caller's AdmissionReview (REV-01); fill request* fields (REV-07).

    Raises ``BadReview`` with a message saying what is wrong; nothing is called for such a review.
    """
    _check_utf8(body)
    try:
        # Objects stay undecoded bytes (Raw), but msgspec still walks them: as deep as the
        # apiserver's decoder allows (10,000 levels) is decided like any other review.
        envelope = decode_nested(_inbound_decoder, body)
    except NestedTooDeeplyError as exc:
        raise BadReview(f"request body is not acceptable: {exc}") from None
    except msgspec.DecodeError as exc:
        # ValidationError (a subclass) names the JSON path:
        # "Expected `str`, got `int` - at `$.request.name`".
        if isinstance(exc, msgspec.ValidationError):
            raise BadReview(f"invalid AdmissionReview: {exc}") from None
        raise BadReview(f"request body is not valid JSON: {exc}") from None

    if envelope.kind != KIND:
        got = f'"{envelope.kind}"' if envelope.kind else "missing"
        raise BadReview(f'kind must be "{KIND}", got {got}')
    if envelope.api_version not in API_VERSIONS:
        got = f'"{envelope.api_version}"' if envelope.api_version else "missing"
        raise BadReview(f"apiVersion must be admission.k8s.io/v1 or admission.k8s.io/v1beta1, got {got}")
    request = envelope.request
    if request is None:
        raise BadReview("AdmissionReview has no request")
    if not request.uid:
        raise BadReview("request.uid is missing or empty")
    if request.operation not in OPERATIONS:
        got = f'"{request.operation}"' if request.operation else "missing"
        raise BadReview(f"request.operation must be one of {_OPERATIONS_TEXT}, got {got}")
    obj = _object_or_null(request.object, "object")
    old = _object_or_null(request.old_object, "oldObject")
    _object_or_null(request.options, "options")

    # REV-07: old callers omit the request* members; the original request is then the request itself.
    if None in (request.request_kind, request.request_resource, request.request_sub_resource):
        request = msgspec.structs.replace(
            request,
            request_kind=request.kind if request.request_kind is None else request.request_kind,
            request_resource=(
                request.resource if request.request_resource is None else request.request_resource
            ),
            request_sub_resource=(
                request.sub_resource if request.request_sub_resource is None else request.request_sub_resource
            ),
        )
    attributes = AdmissionAttributes(
        uid=request.uid,
        operation=request.operation,
        kind=request.kind,
        resource=request.resource,
        sub_resource=request.sub_resource,
        name=request.name,
        namespace=request.namespace,
        object=obj,
        old_object=old,
        dry_run=bool(request.dry_run),
        request_kind=request.request_kind,
        request_resource=request.request_resource,
        request_sub_resource=request.request_sub_resource,
    )
    return InboundReview(api_version=envelope.api_version, request=request, attributes=attributes)


def encode_reply(
    inbound: InboundReview,
    *,
    allowed: bool,
    status: Status | None = None,
    patch: bytes | None = None,
    warnings: Sequence[str] = (),
    audit_annotations: Mapping[str, str] | None = None,
) -> bytes:
    """The gateway's HTTP 200 reply: inbound apiVersion and uid, no ``request`` (REV-02, GW-16).

    ``patch`` is the combined JSON Patch document (raw bytes, base64-encoded here); ``None`` or
    empty means no patch, and then no ``patchType`` either. A deny must carry a status and no patch;
    an allowed reply carries no status (ERR-10). Violations are bugs and raise ``ValueError``.
    """
    return _encode_reply(
        inbound.api_version,
        inbound.uid,
        allowed=allowed,
        status=status,
        patch=patch,
        warnings=warnings,
        audit_annotations=audit_annotations,
    )


class ReplyTemplate:
    """``encode_reply``'s bytes for one apiVersion and decision with the uid left open.

    ``render(uid)`` is byte for byte what ``encode_reply`` makes for a review of that apiVersion
    and uid: the uid is the response's first member, so the rest is encoded once. For answers
    given to many reviews alike (shed reviews, ``gateway.server.app``).
    """

    __slots__ = ("_head", "_tail")

    def __init__(
        self,
        api_version: str,
        *,
        allowed: bool,
        status: Status | None = None,
        patch: bytes | None = None,
        warnings: Sequence[str] = (),
        audit_annotations: Mapping[str, str] | None = None,
    ) -> None:
        whole = _encode_reply(
            api_version,
            "",
            allowed=allowed,
            status=status,
            patch=patch,
            warnings=warnings,
            audit_annotations=audit_annotations,
        )
        # apiVersion and kind are fixed words, so the first empty uid member is the response's.
        head, found, tail = whole.partition(_EMPTY_UID)
        if not found:
            raise ValueError("the reply has no response uid")
        self._head = head + _UID_MEMBER
        self._tail = tail

    def render(self, uid: str) -> bytes:
        return b"".join((self._head, _encoder.encode(uid), self._tail))


_UID_MEMBER: Final = b'"uid":'
_EMPTY_UID: Final = _UID_MEMBER + b'""'


def _encode_reply(
    api_version: str,
    uid: str,
    *,
    allowed: bool,
    status: Status | None,
    patch: bytes | None,
    warnings: Sequence[str],
    audit_annotations: Mapping[str, str] | None,
) -> bytes:
    if allowed and status is not None:
        raise ValueError("an allowed reply carries no status (ERR-10)")
    if not allowed and status is None:
        raise ValueError("a deny carries a status (ERR-10)")
    if patch and not allowed:
        raise ValueError("a deny carries no patch (MUT-13)")
    response = ReplyResponse(
        uid=uid,
        allowed=allowed,
        status=status,
        patch=patch or None,
        patch_type=JSON_PATCH if patch else None,
        audit_annotations=dict(audit_annotations) if audit_annotations else None,
        warnings=list(warnings) if warnings else None,
    )
    return _encoder.encode(Reply(api_version=api_version, kind=KIND, response=response))


def encode_status(code: int, reason: str, message: str) -> bytes:
    """A top-level meta/v1 Status (``status: Failure``) for the gateway's HTTP errors (404/405/413)."""
    return _encoder.encode(
        MetaStatus(
            kind="Status",
            apiVersion="v1",
            metadata={},
            status="Failure",
            message=message,
            reason=reason,
            code=code,
        )
    )


def encode_bad_request_status(message: str) -> bytes:
    """The HTTP 400 body for a malformed inbound review (REV-01): Status, reason ``BadRequest``."""
    return encode_status(400, "BadRequest", message)
