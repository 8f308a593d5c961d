"""The AdmissionReview wire format (docs/behaviour.md, REV-*): pure codec, no I/O.

``inbound`` decodes the caller's review (once) into the ``view`` every later stage reads and encodes
the gateway's answer; ``codec`` negotiates the version for a backend, encodes its request from the
view and decodes and verifies its reply; ``types`` holds the Structs of both versions. Layering:
``types`` ← ``view`` ← {``inbound``, ``codec``}; ``inbound`` and ``codec`` never import each other.
"""

from gateway.review.codec import (
    KIND_DECODE,
    KIND_INVALID_RESPONSE,
    KIND_VERSION,
    NO_KNOWN_VERSION_REASON,
    BackendResponse,
    decode_backend_response,
    encode_backend_request,
    negotiate_version,
    new_request_uid,
    no_known_version_error,
)
from gateway.review.inbound import (
    ReplyTemplate,
    decode_inbound,
    encode_bad_request_status,
    encode_reply,
    encode_status,
)
from gateway.review.types import JSON_PATCH, ReviewVersion
from gateway.review.view import InboundReview

__all__ = [
    "JSON_PATCH",
    "KIND_DECODE",
    "KIND_INVALID_RESPONSE",
    "KIND_VERSION",
    "NO_KNOWN_VERSION_REASON",
    "BackendResponse",
    "InboundReview",
    "ReplyTemplate",
    "ReviewVersion",
    "decode_backend_response",
    "decode_inbound",
    "encode_backend_request",
    "encode_bad_request_status",
    "encode_reply",
    "encode_status",
    "negotiate_version",
    "new_request_uid",
    "no_known_version_error",
]
