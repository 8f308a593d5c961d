"""The AdmissionReview wire types (admission.k8s.io/v1 and /v1beta1), as msgspec Structs.

Both versions carry the same fields (docs/behaviour.md, REV-*), so one set of Structs serves both; only the
``apiVersion`` string and the strictness of reply verification (``gateway.review.codec``) differ.
Objects the gateway only forwards (``object``, ``oldObject``, ``options``) stay ``msgspec.Raw``.

Field order follows upstream's Go structs so that what we encode reads like what the apiserver sends.
Decoding is tolerant (unknown fields ignored) and case-sensitive, as upstream's decoder is (REV-08).
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from gateway.admission import NULL, GroupVersionKind, GroupVersionResource, Status

ReviewVersion = Literal["v1", "v1beta1"]

JSON_PATCH: Final = "JSONPatch"
GROUP: Final = "admission.k8s.io"
KIND: Final = "AdmissionReview"
API_VERSIONS: Final[dict[str, ReviewVersion]] = {
    "admission.k8s.io/v1": "v1",
    "admission.k8s.io/v1beta1": "v1beta1",
}


def api_version(version: ReviewVersion) -> str:
    """``admission.k8s.io/<version>``."""
    return f"{GROUP}/{version}"


class UserInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """``authentication.k8s.io/v1`` UserInfo; every member is ``omitempty`` upstream."""

    username: str = ""
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)


# --- inbound (the caller's review) ---------------------------------------------------------------


class InboundRequest(msgspec.Struct, frozen=True, rename="camel"):
    """``request`` of the caller's AdmissionReview, as received.

    ``None`` for ``request_kind``/``request_resource``/``request_sub_resource`` means absent (REV-07
    fills them); ``dry_run`` ``None`` means absent (false). Objects are ``null`` Raw when absent.
    """

    uid: str = ""
    kind: GroupVersionKind = msgspec.field(default_factory=GroupVersionKind)
    resource: GroupVersionResource = msgspec.field(default_factory=GroupVersionResource)
    sub_resource: str = ""
    request_kind: GroupVersionKind | None = None
    request_resource: GroupVersionResource | None = None
    request_sub_resource: str | None = None
    name: str = ""
    namespace: str = ""
    operation: str = ""
    user_info: UserInfo = msgspec.field(default_factory=UserInfo)
    object: msgspec.Raw = NULL
    old_object: msgspec.Raw = NULL
    dry_run: bool | None = None
    options: msgspec.Raw = NULL


class InboundEnvelope(msgspec.Struct, frozen=True, rename="camel"):
    """The caller's AdmissionReview; ``api_version``/``kind`` are checked after decoding (REV-01)."""

    api_version: str = ""
    kind: str = ""
    request: InboundRequest | None = None


# --- to a backend --------------------------------------------------------------------------------


class RequestHeader(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    """The request members between ``uid`` and ``object`` that are copied unchanged (REV-06).

    Encoded once per inbound review and spliced into every backend request (see codec).
    ``requestKind``/``requestResource`` are always present (REV-07 filled them); the string members
    are ``omitempty`` upstream, ``operation`` and ``userInfo`` are not.
    """

    kind: GroupVersionKind
    resource: GroupVersionResource
    sub_resource: str = ""
    request_kind: GroupVersionKind | None = None
    request_resource: GroupVersionResource | None = None
    request_sub_resource: str = ""
    name: str = ""
    namespace: str = ""
    operation: str | None = None
    user_info: UserInfo | None = None


# --- from a backend ------------------------------------------------------------------------------


class BackendResponseBody(msgspec.Struct, frozen=True, rename="camel"):
    """``response`` of a backend's reply as decoded, before verification.

    Members are optional and nullable: upstream's Go decoder leaves a field at its zero value for
    both an absent member and a JSON ``null``. ``patch`` stays a string: base64 is checked by hand
    because upstream tolerates line breaks in it (REV-08).
    """

    uid: str | None = None
    allowed: bool | None = None
    status: Status | None = None
    patch: str | None = None
    patch_type: str | None = None
    audit_annotations: dict[str, str] | None = None
    warnings: list[str] | None = None


class BackendReply(msgspec.Struct, frozen=True, rename="camel"):
    """A backend's AdmissionReview reply as decoded, before verification."""

    api_version: str | None = None
    kind: str | None = None
    response: BackendResponseBody | None = None


# --- our reply to the caller ---------------------------------------------------------------------


class ReplyResponse(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    """``response`` of the gateway's reply. ``allowed`` is always present; the rest is ``omitempty``.

    ``patch`` holds the raw JSON Patch bytes; msgspec encodes ``bytes`` as padded standard base64.
    """

    uid: str
    allowed: bool
    status: Status | None = None
    patch: bytes | None = None
    patch_type: str | None = None
    audit_annotations: dict[str, str] | None = None
    warnings: list[str] | None = None


class Reply(msgspec.Struct, frozen=True, rename="camel"):
    """The gateway's AdmissionReview reply: no ``request`` member (REV-02)."""

    api_version: str
    kind: str
    response: ReplyResponse


class MetaStatus(msgspec.Struct, frozen=True):
    """A top-level ``meta.k8s.io/v1`` Status object, the body of the gateway's HTTP errors."""

    kind: str
    apiVersion: str  # noqa: N815 - the wire name
    metadata: dict[str, str]
    status: str
    message: str
    reason: str
    code: int
