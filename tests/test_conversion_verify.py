"""CNV-09..11 on the pure verification functions, for shapes the sample backend cannot produce."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.conversion.codec import (
    decode_backend_reply,
    decode_inbound,
    encode_backend_request,
    encode_reply,
)
from gateway.conversion.verify import (
    INVALID_CONVERTED_OBJECT,
    MALFORMED_RESPONSE,
    ConversionFailedError,
    verify_object,
    verify_review,
)
from gateway.errors import BadReview

DESIRED = "stable.example.com/v2"
ORIGINAL: dict[str, Any] = {
    "apiVersion": "stable.example.com/v1",
    "kind": "CronTab",
    "metadata": {"name": "a", "namespace": "ops", "uid": "u-a", "labels": {"bad": "not valid!"}},
}


def converted(**metadata: Any) -> bytes:
    meta = {**ORIGINAL["metadata"], **metadata}
    return json.dumps(
        {**ORIGINAL, "apiVersion": DESIRED, "metadata": {k: v for k, v in meta.items() if v is not ...}}
    ).encode()


@pytest.mark.parametrize(
    ("out", "reason"),
    [
        pytest.param(converted(), None, id="CNV-11 unchanged labels are not validated again, as upstream"),
        pytest.param(converted(labels=...), None, id="CNV-11 labels may be dropped"),
        pytest.param(converted(labels={"ok": "yes"}), None, id="CNV-11 changed valid labels pass"),
        pytest.param(
            converted(labels=["a"]),
            "invalid metadata.labels of type []interface {} in converted object",
            id="CNV-11 labels must be a map",
        ),
        pytest.param(
            converted(annotations={"a": 1.5}),
            "metadata.annotations[a] must be a string, but is float64 in converted object",
            id="CNV-11 annotation values must be strings",
        ),
        pytest.param(
            converted(annotations={"a/b/c": "x"}),
            'metadata.annotation: Invalid value: "a/b/c"',
            id="CNV-11 changed annotation keys must be qualified names",
        ),
        pytest.param(
            converted(annotations={"big": "x" * (256 * 1024)}),
            "metadata.annotation: Too long: must have at most 262144 bytes",
            id="CNV-11 annotations are bounded",
        ),
        pytest.param(
            converted(labels={"n": None, "ok": "yes"}),
            "metadata.labels[n] must be a string, but is <nil> in converted object",
            id="CNV-11 a null label value is not a string",
        ),
        pytest.param(
            converted(labels=None),
            None,
            id="CNV-11 null labels are dropped labels",
        ),
        pytest.param(
            json.dumps({"kind": "CronTab", "metadata": ORIGINAL["metadata"]}).encode(),
            "invalid groupVersion (expected stable.example.com/v2, received )",
            id="CNV-11 a missing apiVersion is a wrong one",
        ),
    ],
)
def test_converted_object_checks(out, reason):
    original = json.dumps(ORIGINAL).encode()
    if reason is None:
        verify_object(0, original, out, DESIRED)
        return
    with pytest.raises(ConversionFailedError) as caught:
        verify_object(0, original, out, DESIRED)
    assert reason in caught.value.reason
    assert caught.value.failure_type == INVALID_CONVERTED_OBJECT


FRAGMENT: dict[str, Any] = {"apiVersion": "stable.example.com/v1", "kind": "CronTab", "spec": {}}


@pytest.mark.parametrize(
    ("original", "metadata", "reason"),
    [
        pytest.param(
            ORIGINAL,
            ...,
            "returned invalid object at index 0: must have the same name: a != ",
            id="CNV-11 an object that lost its metadata fails the name check first, in upstream's order",
        ),
        pytest.param(
            ORIGINAL,
            "x",
            "returned invalid object at index 0: must have the same name: a != ",
            id="CNV-11 metadata that is not an object reads as empty in the identity check, as upstream",
        ),
        pytest.param(
            FRAGMENT,
            ...,
            "returned invalid metadata in object at index 0: missing metadata in converted object",
            id="CNV-11 without a name to compare (a field-set fragment), missing metadata is named",
        ),
        pytest.param(
            FRAGMENT,
            "x",
            "returned invalid metadata in object at index 0: invalid metadata of type string in converted object",
            id="CNV-11 without a name to compare, metadata must be an object",
        ),
        pytest.param(
            FRAGMENT,
            None,
            "returned invalid metadata in object at index 0: invalid metadata of type <nil> in converted object",
            id="CNV-11 null metadata is metadata of type <nil>, not missing",
        ),
    ],
)
def test_metadata_shape_is_checked_after_identity(original, metadata, reason):
    out = {**original, "apiVersion": DESIRED}
    out.pop("metadata", None)
    if metadata is not ...:
        out["metadata"] = metadata
    with pytest.raises(ConversionFailedError) as caught:
        verify_object(0, json.dumps(original).encode(), json.dumps(out).encode(), DESIRED)
    assert caught.value.reason == reason
    assert caught.value.failure_type == INVALID_CONVERTED_OBJECT


@pytest.mark.parametrize(
    ("body", "version", "reason"),
    [
        pytest.param(
            b'{"apiVersion":"apiextensions.k8s.io/v1","kind":"Other","response":{}}',
            "v1",
            "expected webhook response of apiextensions.k8s.io/v1, Kind=ConversionReview, got apiextensions.k8s.io/v1, Kind=Other",
            id="CNV-09 v1 kind must be ConversionReview",
        ),
        pytest.param(
            b'{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","response":{"uid":"sent"}}',
            "v1",
            "response.result.status was '', not 'Success'",
            id="CNV-09 a missing result is not Success",
        ),
        pytest.param(
            b'{"kind":"Anything","response":{"uid":"other","result":{"status":"Success"}}}',
            "v1beta1",
            None,
            id="CNV-09 v1beta1 checks only response and result",
        ),
    ],
)
def test_review_checks(body, version, reason):
    reply = decode_backend_reply(body)
    if reason is None:
        assert verify_review(reply, version=version, sent_uid="sent") == []
        return
    with pytest.raises(ConversionFailedError) as caught:
        verify_review(reply, version=version, sent_uid="sent")
    assert caught.value.reason == reason
    assert caught.value.failure_type == MALFORMED_RESPONSE


def test_codec_carries_objects_byte_for_byte():
    objects = (b'{"b":1,  "a":2}', b'{"kind":"X"}')
    body = encode_backend_request("v1beta1", uid="u", desired_api_version=DESIRED, objects=objects)
    assert b'"objects":[{"b":1,  "a":2},{"kind":"X"}]' in body
    inbound = decode_inbound(body)
    assert (inbound.version, inbound.uid, inbound.desired_api_version, inbound.objects) == (
        "v1beta1",
        "u",
        DESIRED,
        objects,
    )
    assert json.loads(encode_reply("v1", uid="u", objects=objects))["response"]["convertedObjects"] == [
        {"b": 1, "a": 2},
        {"kind": "X"},
    ]
    failure = json.loads(encode_reply("v1", uid="u", objects=objects, failure='x "y"'))["response"]
    assert failure == {
        "uid": "u",
        "result": {"status": "Failure", "message": 'x "y"'},
        "convertedObjects": [],
    }


def test_inbound_must_be_json():
    with pytest.raises(BadReview, match="cannot decode ConversionReview"):
        decode_inbound(b"\xff")
