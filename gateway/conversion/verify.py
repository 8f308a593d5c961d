"""Verifying a backend's ConversionReview (CNV-09..11), with the failure types of CNV-15.

Pure: from the decoded reply, what was sent and the inputs to the converted objects' raw bytes, or a
``ConversionFailedError`` whose ``reason`` ends up in ``conversion webhook "<crd>" (<url>) failed: <reason>``.
"""

from __future__ import annotations

from typing import Final

import msgspec

from gateway.config.fielderrors import FieldError, invalid
from gateway.config.formats import is_label_value, is_qualified_name
from gateway.conversion.codec import KIND, BackendReview, ReviewVersion, api_version

# CNV-15 failure types (MET-10 ``failure_type`` label values).
CALL_FAILURE: Final = "conversion_webhook_call_failure"
MALFORMED_RESPONSE: Final = "conversion_webhook_malformed_response_failure"
PARTIAL_RESPONSE: Final = "conversion_webhook_partial_response_failure"
INVALID_CONVERTED_OBJECT: Final = "conversion_webhook_invalid_converted_object_failure"
NO_OBJECTS_RETURNED: Final = "conversion_webhook_no_objects_returned_failure"
FAILURE_TYPES: Final = (
    CALL_FAILURE,
    MALFORMED_RESPONSE,
    PARTIAL_RESPONSE,
    INVALID_CONVERTED_OBJECT,
    NO_OBJECTS_RETURNED,
)

MAX_ANNOTATIONS_BYTES: Final = 256 * 1024  # upstream: apimachinery TotalAnnotationSizeLimitB


class ConversionFailedError(Exception):
    """A conversion that failed: the reason text and its CNV-15 failure type."""

    def __init__(self, reason: str, failure_type: str, *, timed_out: bool = False) -> None:
        self.reason = reason
        self.failure_type = failure_type
        self.timed_out = timed_out
        super().__init__(reason)


class ObjectHead(msgspec.Struct, rename="camel"):
    """What verification reads of an object: type, identity, labels and annotations."""

    api_version: object = None
    kind: object = None
    metadata: object = None


_head_decoder: Final = msgspec.json.Decoder(ObjectHead)


def object_head(raw: bytes) -> ObjectHead | None:
    """The head of a JSON object, or None when ``raw`` is not one."""
    if not raw.lstrip().startswith(b"{"):
        return None
    try:
        return _head_decoder.decode(raw)
    except msgspec.DecodeError:
        return None


def _meta_field(head: ObjectHead, name: str) -> object:
    meta = head.metadata
    value = meta.get(name) if isinstance(meta, dict) else None
    return "" if value is None else value


def verify_review(reply: BackendReview, *, version: ReviewVersion, sent_uid: str) -> list[bytes]:
    """CNV-09: the reply's envelope, per version; returns the converted objects' raw bytes."""
    if version == "v1":
        expected = api_version("v1")
        if reply.api_version != expected or reply.kind != KIND:
            raise ConversionFailedError(
                f"expected webhook response of {expected}, Kind={KIND}, "
                f"got {reply.api_version or ''}, Kind={reply.kind or ''}",
                MALFORMED_RESPONSE,
            )
    response = reply.response
    if response is None:
        raise ConversionFailedError("no response provided", MALFORMED_RESPONSE)
    if version == "v1" and response.uid != sent_uid:
        raise ConversionFailedError(
            f'expected response.uid="{sent_uid}", got "{response.uid or ""}"', MALFORMED_RESPONSE
        )
    result = response.result
    status = result.status if result is not None else None
    if status != "Success":
        message = result.message if result is not None else None
        raise ConversionFailedError(
            message or f"response.result.status was '{status or ''}', not 'Success'", MALFORMED_RESPONSE
        )
    return [bytes(o) for o in response.converted_objects or ()]


def verify_count(converted: list[bytes], sent: int) -> None:
    """CNV-10: exactly as many converted objects as were sent."""
    if len(converted) != sent:
        raise ConversionFailedError(f"returned {len(converted)} objects, expected {sent}", PARTIAL_RESPONSE)


def _string_map_errors(value: object, path: str) -> list[FieldError] | None:
    """None when ``value`` is absent or a map of strings, else the error."""
    if value == "" or value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        return [FieldError(path, "Invalid value: must be a map of strings")]
    return None


def _label_errors(labels: dict[str, str]) -> list[FieldError]:
    errors: list[FieldError] = []
    for k, v in labels.items():
        errors.extend(invalid("metadata.labels", k, m) for m in is_qualified_name(k))
        errors.extend(invalid("metadata.labels", v, m) for m in is_label_value(v))
    return errors


def _annotation_errors(annotations: dict[str, str]) -> list[FieldError]:
    errors: list[FieldError] = []
    total = 0
    for k, v in annotations.items():
        errors.extend(invalid("metadata.annotations", k, m) for m in is_qualified_name(k.lower()))
        total += len(k) + len(v)
    if total > MAX_ANNOTATIONS_BYTES:
        errors.append(
            FieldError("metadata.annotations", f"Too long: must have at most {MAX_ANNOTATIONS_BYTES} bytes")
        )
    return errors


def verify_object(index: int, original: bytes, converted: bytes, desired_api_version: str) -> None:
    """CNV-11: one converted object keeps its identity and carries the desired apiVersion."""
    where = f"returned invalid object at index {index}"
    out = object_head(converted)
    if out is None:
        raise ConversionFailedError(
            f"returned invalid converted object at index {index}: not a JSON object", INVALID_CONVERTED_OBJECT
        )
    inp = object_head(original) or ObjectHead()
    if out.api_version != desired_api_version:
        raise ConversionFailedError(
            f"{where}: invalid groupVersion "
            f"(expected {desired_api_version}, received {out.api_version or ''})",
            INVALID_CONVERTED_OBJECT,
        )
    if out.kind != inp.kind:
        raise ConversionFailedError(
            f"{where}: invalid kind (expected {inp.kind or ''}, received {out.kind or ''})",
            INVALID_CONVERTED_OBJECT,
        )
    where = f"returned invalid metadata in object at index {index}"
    for field, label in (("name", "name"), ("namespace", "namespace"), ("uid", "UID")):
        a, b = _meta_field(inp, field), _meta_field(out, field)
        if a != b:
            raise ConversionFailedError(
                f"{where}: must have the same {label}: {a} != {b}", INVALID_CONVERTED_OBJECT
            )
    if not isinstance(out.metadata, dict):
        message = "missing metadata in converted object"
        if out.metadata is not None:
            message = f"invalid metadata of type {type(out.metadata).__name__} in converted object"
        raise ConversionFailedError(f"{where}: {message}", INVALID_CONVERTED_OBJECT)
    for field, check in (("labels", _label_errors), ("annotations", _annotation_errors)):
        value = out.metadata.get(field)
        errors = _string_map_errors(value, f"metadata.{field}")
        if errors is None and isinstance(value, dict) and value != _meta_field(inp, field):
            errors = check(value) or None  # only changed sets are validated, as upstream
        if errors:
            raise ConversionFailedError(f"{where}: {errors[0]}", INVALID_CONVERTED_OBJECT)
