"""ConversionReview on the wire, both versions: the caller's review in, the backend's review out.

Objects are carried as raw JSON bytes from the caller to the backend and back, never re-encoded:
what the backend gets is exactly what the caller sent (CNV-07), the cache keys on those exact bytes,
and the converted objects reach the caller as the backend produced them (CNV-12).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from gateway.errors import BadReview

ReviewVersion = Literal["v1", "v1beta1"]

GROUP: Final = "apiextensions.k8s.io"
KIND: Final = "ConversionReview"
_API_VERSIONS: Final[dict[str, ReviewVersion]] = {f"{GROUP}/v1": "v1", f"{GROUP}/v1beta1": "v1beta1"}

_encoder: Final = msgspec.json.Encoder()


def api_version(version: ReviewVersion) -> str:
    return f"{GROUP}/{version}"


class _InboundRequest(msgspec.Struct, rename="camel"):
    uid: object = None
    desired_api_version: object = msgspec.field(default=None, name="desiredAPIVersion")
    objects: list[msgspec.Raw] | None = None


class _InboundReview(msgspec.Struct, rename="camel"):
    api_version: object = None
    kind: object = None
    request: _InboundRequest | None = None


_inbound_decoder: Final = msgspec.json.Decoder(_InboundReview)


@dataclass(frozen=True, slots=True)
class ConversionRequest:
    """A caller's ConversionReview (CNV-04): its version, uid, desired apiVersion and raw objects."""

    version: ReviewVersion
    uid: str
    desired_api_version: str
    objects: tuple[bytes, ...]


def decode_inbound(body: bytes) -> ConversionRequest:
    """CNV-04: a v1 or v1beta1 ConversionReview with a request; ``BadReview`` (HTTP 400) otherwise."""
    try:
        review = _inbound_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise BadReview(f"cannot decode ConversionReview: {exc}") from None
    version = _API_VERSIONS.get(review.api_version) if isinstance(review.api_version, str) else None
    if version is None:
        raise BadReview(
            f"unsupported apiVersion {review.api_version!r}: expected {GROUP}/v1 or {GROUP}/v1beta1"
        )
    if review.kind != KIND:
        raise BadReview(f"unsupported kind {review.kind!r}: expected {KIND}")
    req = review.request
    if req is None:
        raise BadReview("ConversionReview has no request")
    if not isinstance(req.uid, str) or not req.uid:
        raise BadReview("request.uid is required")
    if not isinstance(req.desired_api_version, str) or not req.desired_api_version:
        raise BadReview("request.desiredAPIVersion is required")
    if req.objects is None:
        raise BadReview("request.objects must be an array")
    objects = tuple(bytes(o) for o in req.objects)
    for i, obj in enumerate(objects):
        if not obj.lstrip().startswith(b"{"):
            raise BadReview(f"request.objects[{i}] must be an object")
    return ConversionRequest(version, req.uid, req.desired_api_version, objects)


def encode_backend_request(
    version: ReviewVersion, *, uid: str, desired_api_version: str, objects: tuple[bytes, ...]
) -> bytes:
    """CNV-07: the review sent to the backend, in its negotiated version, with a fresh uid."""
    desired = b',"desiredAPIVersion":' + _encoder.encode(desired_api_version)
    return _review(version, b"request", uid, desired, key=b"objects", objects=objects)


def encode_reply(
    version: ReviewVersion, *, uid: str, objects: tuple[bytes, ...] = (), failure: str | None = None
) -> bytes:
    """CNV-05: the answer in the caller's version with its uid, ``Success`` or ``Failure``."""
    if failure is None:
        result = b'{"status":"Success"}'
    else:
        result, objects = _encoder.encode({"status": "Failure", "message": failure}), ()
    return _review(
        version, b"response", uid, b',"result":' + result, key=b"convertedObjects", objects=objects
    )


def _review(
    version: ReviewVersion, member: bytes, uid: str, fields: bytes, *, key: bytes, objects: tuple[bytes, ...]
) -> bytes:
    """A ConversionReview whose ``member`` holds ``uid``, the encoded ``fields`` and, last, the list
    ``key`` of objects: their bytes spliced in as they are, never re-encoded."""
    return b"".join(
        (
            b'{"apiVersion":"',
            api_version(version).encode(),
            b'","kind":"ConversionReview","',
            member,
            b'":{"uid":',
            _encoder.encode(uid),
            fields,
            b',"',
            key,
            b'":[',
            b",".join(objects),
            b"]}}",
        )
    )


# --- the backend's reply ---------------------------------------------------------------------------


class Result(msgspec.Struct, rename="camel"):
    """``response.result``: a meta/v1 Status; only status and message matter."""

    status: str | None = None
    message: str | None = None


class BackendResponse(msgspec.Struct, rename="camel"):
    uid: str | None = None
    result: Result | None = None
    converted_objects: list[msgspec.Raw] | None = None


class BackendReview(msgspec.Struct, rename="camel"):
    api_version: str | None = None
    kind: str | None = None
    response: BackendResponse | None = None


_backend_decoder: Final = msgspec.json.Decoder(BackendReview)


def decode_backend_reply(body: bytes) -> BackendReview:
    """The backend's ConversionReview; ``ValueError`` with a short reason when it does not decode."""
    if not body.strip():
        raise ValueError("empty response body")
    try:
        return _backend_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"cannot decode ConversionReview: {exc}") from None
