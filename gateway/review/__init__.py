"""The AdmissionReview wire format (spec §4): pure codec, no I/O.

``inbound`` decodes the caller's review and encodes the gateway's answer; ``codec`` negotiates the
version for a backend, encodes its request and decodes and verifies its reply; ``types`` holds the
Structs of both versions.
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
    JSON_PATCH,
    InboundReview,
    decode_inbound,
    encode_bad_request_status,
    encode_reply,
    encode_status,
)
from gateway.review.types import ReviewVersion

__all__ = [
    "JSON_PATCH",
    "KIND_DECODE",
    "KIND_INVALID_RESPONSE",
    "KIND_VERSION",
    "NO_KNOWN_VERSION_REASON",
    "BackendResponse",
    "InboundReview",
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
