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
_ANNOTATIONS_PATH: Final = "metadata.annotation"  # sic: upstream validates at field path metadata.annotation


class ConversionFailedError(Exception):
    """A conversion that failed: the reason text and its CNV-15 failure type."""

    def __init__(self, reason: str, failure_type: str, *, timed_out: bool = False) -> None:
        self.reason = reason
        self.failure_type = failure_type
        self.timed_out = timed_out
        super().__init__(reason)


class ObjectHead(msgspec.Struct, rename="camel"):
    """What verification reads of an object: type, identity, labels and annotations.

    ``metadata`` is ``UNSET`` when the object has none, ``None`` when it is ``null``.
    """

    api_version: object = None
    kind: object = None
    metadata: object = msgspec.UNSET


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


def go_type(value: object) -> str:
    """Go's ``%T`` of a decoded JSON value, as the apiserver's unstructured decoding makes it."""
    # upstream: apimachinery util/json turns integral numbers into int64, the others into float64.
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "[]interface {}"
    return "map[string]interface {}"


def _string_map_error(value: object, field: str) -> str | None:
    """Why ``metadata.<field>`` of a converted object is not a map of strings, or None."""
    if not isinstance(value, dict):
        return f"invalid metadata.{field} of type {go_type(value)} in converted object"
    for key, item in value.items():
        if not isinstance(item, str):
            return f"metadata.{field}[{key}] must be a string, but is {go_type(item)} in converted object"
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
        errors.extend(invalid(_ANNOTATIONS_PATH, k, m) for m in is_qualified_name(k.lower()))
        total += len(k) + len(v)
    if total > MAX_ANNOTATIONS_BYTES:
        errors.append(
            FieldError(_ANNOTATIONS_PATH, f"Too long: must have at most {MAX_ANNOTATIONS_BYTES} bytes")
        )
    return errors


def verify_object(index: int, original: bytes, converted: bytes, desired_api_version: str) -> None:
    """CNV-11: one converted object keeps its identity and carries the desired apiVersion.

    The texts are upstream's (``webhook_converter.go``): ``returned invalid object at index <i>`` for
    the type and identity checks, ``returned invalid metadata in object at index <i>`` for the
    metadata's own shape, labels and annotations. The order is upstream's too: name, namespace and
    uid are compared first (a missing or non-object ``metadata`` reads as empty), so an object
    without metadata whose original has a name reads ``must have the same name: a != ``, and
    ``missing metadata in converted object`` is what an object without a name (a field-set
    fragment) gets.
    """
    out = object_head(converted)
    if out is None:
        raise ConversionFailedError(
            f"returned invalid converted object at index {index}: not a JSON object", INVALID_CONVERTED_OBJECT
        )
    inp = object_head(original) or ObjectHead()
    where = f"returned invalid object at index {index}"
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
    for field, label in (("name", "name"), ("namespace", "namespace"), ("uid", "UID")):
        a, b = _meta_field(inp, field), _meta_field(out, field)
        if a != b:
            raise ConversionFailedError(
                f"{where}: must have the same {label}: {a} != {b}", INVALID_CONVERTED_OBJECT
            )
    in_metadata = f"returned invalid metadata in object at index {index}"
    meta = out.metadata
    if not isinstance(meta, dict):
        message = "missing metadata in converted object"
        if meta is not msgspec.UNSET:
            message = f"invalid metadata of type {go_type(meta)} in converted object"
        raise ConversionFailedError(f"{in_metadata}: {message}", INVALID_CONVERTED_OBJECT)
    for field, check in (("labels", _label_errors), ("annotations", _annotation_errors)):
        value = meta.get(field)
        if value is None:
            continue  # absent or null: the labels (annotations) are dropped
        problem = _string_map_error(value, field)
        if problem is None and value != _meta_field(inp, field):
            errors = check(value)  # only changed sets are validated, as upstream
            problem = str(errors[0]) if errors else None
        if problem is not None:
            raise ConversionFailedError(f"{in_metadata}: {problem}", INVALID_CONVERTED_OBJECT)
