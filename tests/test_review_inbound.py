"""The caller's side of the codec: inbound decoding (REV-01/07) and the gateway's replies (REV-02, GW-16)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission import GroupVersionKind, GroupVersionResource, Status, StatusCause, StatusDetails
from gateway.errors import BadReview
from gateway.review import (
    InboundReview,
    ReplyTemplate,
    decode_inbound,
    encode_bad_request_status,
    encode_reply,
    encode_status,
)

GOLDEN = Path(__file__).parent / "golden"


def golden(path: str) -> bytes:
    return (GOLDEN / path).read_bytes()


def inbound_doc(**request: Any) -> dict[str, Any]:
    """A minimal valid v1 inbound review whose request members can be overridden."""
    req: dict[str, Any] = {
        "uid": "u-1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "operation": "CREATE",
        "object": {"metadata": {"name": "p"}},
    }
    req.update(request)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def body(doc: object) -> bytes:
    return json.dumps(doc).encode()


# --- REV-01 ------------------------------------------------------------------------------------

_VALID = inbound_doc()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        pytest.param(
            b"[]",
            "invalid AdmissionReview: Expected `object`, got `array`",
            id="REV-01: a JSON array is refused",
        ),
        pytest.param(
            b"null",
            "invalid AdmissionReview: Expected `object`, got `null`",
            id="REV-01: JSON null is refused",
        ),
        pytest.param(
            body({**_VALID, "kind": "ConversionReview"}),
            'kind must be "AdmissionReview", got "ConversionReview"',
            id="REV-01: kind ConversionReview is refused",
        ),
        pytest.param(
            body({k: v for k, v in _VALID.items() if k != "kind"}),
            'kind must be "AdmissionReview", got missing',
            id="REV-01: a review without kind is refused",
        ),
        pytest.param(
            body({**_VALID, "kind": "admissionreview"}),
            'kind must be "AdmissionReview", got "admissionreview"',
            id="REV-01: kind is case-sensitive",
        ),
        pytest.param(
            body({**_VALID, "apiVersion": "admission.k8s.io/v2"}),
            'apiVersion must be admission.k8s.io/v1 or admission.k8s.io/v1beta1, got "admission.k8s.io/v2"',
            id="REV-01: an unknown apiVersion is refused",
        ),
        pytest.param(
            body({k: v for k, v in _VALID.items() if k != "apiVersion"}),
            "apiVersion must be admission.k8s.io/v1 or admission.k8s.io/v1beta1, got missing",
            id="REV-01: a review without apiVersion is refused",
        ),
        pytest.param(
            body({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
            "AdmissionReview has no request",
            id="REV-01: a review without request is refused",
        ),
        pytest.param(
            body({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": None}),
            "AdmissionReview has no request",
            id="REV-01: a null request is refused",
        ),
        pytest.param(
            body({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": "x"}),
            "invalid AdmissionReview: Expected `object | null`, got `str` - at `$.request`",
            id="REV-01: a request that is not an object is refused",
        ),
        pytest.param(
            body({**_VALID, "request": {k: v for k, v in _VALID["request"].items() if k != "uid"}}),
            "request.uid is missing or empty",
            id="REV-01: a request without uid is refused",
        ),
        pytest.param(
            body(inbound_doc(uid="")), "request.uid is missing or empty", id="REV-01: an empty uid is refused"
        ),
        pytest.param(
            body(inbound_doc(uid=7)),
            "invalid AdmissionReview: Expected `str`, got `int` - at `$.request.uid`",
            id="REV-01: a numeric uid is refused with its JSON path",
        ),
        pytest.param(
            body(inbound_doc(operation="PATCH")),
            'request.operation must be one of CREATE, UPDATE, DELETE, CONNECT, got "PATCH"',
            id="REV-01: operation PATCH is refused",
        ),
        pytest.param(
            body(inbound_doc(operation="create")),
            'request.operation must be one of CREATE, UPDATE, DELETE, CONNECT, got "create"',
            id="REV-01: operations are case-sensitive",
        ),
        pytest.param(
            body({**_VALID, "request": {k: v for k, v in _VALID["request"].items() if k != "operation"}}),
            "request.operation must be one of CREATE, UPDATE, DELETE, CONNECT, got missing",
            id="REV-01: a request without operation is refused",
        ),
        pytest.param(
            body(inbound_doc(kind={"group": "", "version": 1, "kind": "Pod"})),
            "invalid AdmissionReview: Expected `str`, got `int` - at `$.request.kind.version`",
            id="REV-01: a wrongly typed kind member is refused with its JSON path",
        ),
        pytest.param(
            body(inbound_doc(dryRun="yes")),
            "invalid AdmissionReview: Expected `bool | null`, got `str` - at `$.request.dryRun`",
            id="REV-01: a dryRun that is not a boolean is refused",
        ),
        pytest.param(
            body(inbound_doc(userInfo={"username": "a", "groups": "dev"})),
            "invalid AdmissionReview: Expected `array`, got `str` - at `$.request.userInfo.groups`",
            id="REV-01: userInfo groups that are not a list are refused",
        ),
        pytest.param(
            body(inbound_doc(object=[1, 2])),
            "request.object must be a JSON object or null",
            id="REV-01: an object that is an array is refused",
        ),
        pytest.param(
            body(inbound_doc(oldObject="x")),
            "request.oldObject must be a JSON object or null",
            id="REV-01: an oldObject that is a string is refused",
        ),
        pytest.param(
            body(inbound_doc(options=5)),
            "request.options must be a JSON object or null",
            id="REV-01: options that are a number are refused",
        ),
        pytest.param(
            b'{"a":' * 20_000,
            "request body is not acceptable: JSON nested more than 10000 levels deep",
            id="REV-01: nesting deeper than the apiserver's decoder allows is refused",
        ),
    ],
)
def test_malformed_inbound_review_is_refused(payload: bytes, message: str) -> None:
    """REV-01: every malformed inbound review raises BadReview saying what is wrong."""
    with pytest.raises(BadReview) as info:
        decode_inbound(payload)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"", id="REV-01: an empty body is refused"),
        pytest.param(b"{not json", id="REV-01: a body that is not JSON is refused"),
        pytest.param(
            b'{"kind":"AdmissionReview"} {}', id="REV-01: trailing data after the object is refused"
        ),
    ],
)
def test_body_that_is_not_json_is_refused(payload: bytes) -> None:
    """REV-01: a body that does not parse as JSON is refused, with the parser's own explanation."""
    with pytest.raises(BadReview, match=r"^request body is not valid JSON: \S"):
        decode_inbound(payload)


@pytest.mark.parametrize(
    ("doc", "version"),
    [
        pytest.param(inbound_doc(), "v1", id="REV-01: a minimal v1 review is accepted"),
        pytest.param(
            {**inbound_doc(), "apiVersion": "admission.k8s.io/v1beta1"},
            "v1beta1",
            id="REV-01: v1beta1 is accepted",
        ),
        pytest.param(
            {**inbound_doc(Operation="PATCH", unknown={"x": 1}), "extra": True},
            "v1",
            id="REV-08: unknown members (differently cased too) are ignored",
        ),
        pytest.param(
            {**inbound_doc(), "response": {"uid": "x", "allowed": True}},
            "v1",
            id="REV-01: a stray response member is ignored",
        ),
        *(
            pytest.param(inbound_doc(operation=op), "v1", id=f"REV-01: operation {op} is accepted")
            for op in ("CREATE", "UPDATE", "DELETE", "CONNECT")
        ),
    ],
)
def test_valid_inbound_review_is_accepted(doc: dict[str, Any], version: str) -> None:
    """REV-01: well-formed reviews of both versions decode, keeping their version and uid."""
    inbound = decode_inbound(body(doc))
    assert (inbound.version, inbound.api_version, inbound.uid) == (version, doc["apiVersion"], "u-1")


# --- attributes and REV-07 ---------------------------------------------------------------------


def _attrs(inbound: InboundReview) -> dict[str, Any]:
    a = inbound.attributes
    return {
        "uid": a.uid,
        "operation": a.operation,
        "kind": a.kind,
        "resource": a.resource,
        "sub_resource": a.sub_resource,
        "name": a.name,
        "namespace": a.namespace,
        "object": None if a.object is None else json.loads(bytes(a.object)),
        "old_object": None if a.old_object is None else json.loads(bytes(a.old_object)),
        "dry_run": a.dry_run,
    }


@pytest.mark.parametrize("fixture", sorted(p.name for p in (GOLDEN / "inbound").iterdir()))
def test_attributes_come_from_the_request(fixture: str) -> None:
    """REV-01: the attributes matching reads are the request's members; objects equal the inbound JSON."""
    raw = golden(f"inbound/{fixture}")
    doc = json.loads(raw)
    req = doc["request"]
    inbound = decode_inbound(raw)
    assert _attrs(inbound) == {
        "uid": req["uid"],
        "operation": req["operation"],
        "kind": GroupVersionKind(**req["kind"]),
        "resource": GroupVersionResource(**req["resource"]),
        "sub_resource": req.get("subResource", ""),
        "name": req.get("name", ""),
        "namespace": req.get("namespace", ""),
        "object": req["object"],
        "old_object": req["oldObject"],
        "dry_run": req.get("dryRun", False),
    }
    assert inbound.version == doc["apiVersion"].rsplit("/", 1)[1]


def test_objects_stay_raw_slices_of_the_body() -> None:
    """The inbound object is kept as the exact bytes received (never re-encoded), whitespace included."""
    raw = golden("inbound/update-deployment.v1.json")
    inbound = decode_inbound(raw)
    assert inbound.attributes.object is not None
    assert bytes(inbound.attributes.object) in raw
    assert b"\n" in bytes(inbound.attributes.object)


@pytest.mark.parametrize(
    ("request_members", "expected"),
    [
        pytest.param(
            {"subResource": "scale"},
            (GroupVersionKind("", "v1", "Pod"), GroupVersionResource("", "v1", "pods"), "scale"),
            id="REV-07: all three request* members missing are filled from kind/resource/subResource",
        ),
        pytest.param(
            {
                "requestKind": {"group": "apps", "version": "v1beta1", "kind": "Deployment"},
                "requestResource": {"group": "apps", "version": "v1beta1", "resource": "deployments"},
                "requestSubResource": "",
                "subResource": "scale",
            },
            (
                GroupVersionKind("apps", "v1beta1", "Deployment"),
                GroupVersionResource("apps", "v1beta1", "deployments"),
                "",
            ),
            id="REV-07: request* members present (an empty requestSubResource too) are kept",
        ),
        pytest.param(
            {"requestKind": {"group": "x", "version": "v9", "kind": "X"}, "subResource": "status"},
            (GroupVersionKind("x", "v9", "X"), GroupVersionResource("", "v1", "pods"), "status"),
            id="REV-07: each missing member is filled independently",
        ),
    ],
)
def test_missing_request_members_are_filled(
    request_members: dict[str, Any], expected: tuple[object, ...]
) -> None:
    """REV-07: requestKind/requestResource/requestSubResource default to kind/resource/subResource."""
    req = decode_inbound(body(inbound_doc(**request_members))).request
    assert (req.request_kind, req.request_resource, req.request_sub_resource) == expected


@pytest.mark.parametrize(
    ("members", "dry_run"),
    [
        pytest.param({}, False, id="REV-06: an absent dryRun is false"),
        pytest.param({"dryRun": None}, False, id="REV-06: a null dryRun is false"),
        pytest.param({"dryRun": True}, True, id="REV-06: dryRun true is kept"),
    ],
)
def test_dry_run_attribute(members: dict[str, Any], dry_run: bool) -> None:
    """REV-06: dryRun is a boolean attribute, false unless the caller said true."""
    assert decode_inbound(body(inbound_doc(**members))).attributes.dry_run is dry_run


@pytest.mark.parametrize(
    ("members", "has_object", "has_old"),
    [
        pytest.param({}, True, False, id="REV-01: an absent oldObject is no old object"),
        pytest.param(
            {"object": None, "oldObject": {"a": 1}}, False, True, id="REV-01: a null object is no object"
        ),
    ],
)
def test_null_objects_are_none(members: dict[str, Any], has_object: bool, has_old: bool) -> None:
    """A null or absent object or oldObject is None in the attributes (DELETE, CREATE)."""
    a = decode_inbound(body(inbound_doc(**members))).attributes
    assert (a.object is not None, a.old_object is not None) == (has_object, has_old)


# --- REV-02, GW-16, ERR-08/10: the reply ------------------------------------------------------

_TIMEOUT_CAUSE = (
    'failed calling webhook "images.policy.example.com": failed to call webhook: '
    'Post "https://images.policy.svc:443/check?timeout=10s": context deadline exceeded'
)
_PATCH = (
    b'[{"op":"add","path":"/metadata/labels/team","value":"payments"},'
    b'{"op":"add","path":"/metadata/annotations","value":{"sidecar":"injected"}}]'
)


REPLIES = [
    pytest.param(
        "create-pod.v1.json",
        {"allowed": True},
        "allow.v1.json",
        id="REV-02: a v1 allow echoes version and uid",
    ),
    pytest.param(
        "create-pod.v1.json",
        {
            "allowed": True,
            "patch": _PATCH,
            "warnings": ["tag :latest is discouraged"],
            "audit_annotations": {
                "images.policy.example.com_violation": "registry",
                "mutation.round_0_index_0": json.dumps(
                    {"configuration": "labels", "webhook": "team.labels.example.com", "mutated": True},
                    separators=(",", ":"),
                ),
            },
        },
        "patch.v1.json",
        id="GW-16: a patch is base64 with patchType JSONPatch, plus annotations and warnings",
    ),
    pytest.param(
        "create-pod.v1.json",
        {
            "allowed": False,
            "status": Status(
                status="Failure",
                code=500,
                reason="InternalError",
                message=f"Internal error occurred: {_TIMEOUT_CAUSE}",
                details=StatusDetails(causes=[StatusCause(message=_TIMEOUT_CAUSE)]),
            ),
            "warnings": ["tag :latest is discouraged"],
        },
        "deny.v1.json",
        id="ERR-08: a fail-closed deny is an HTTP 200 review with the ERR-02 status",
    ),
    pytest.param(
        "create-pod.v1beta1.json",
        {
            "allowed": False,
            "status": Status(
                status="Failure",
                code=403,
                reason="Forbidden",
                message='admission webhook "images.policy.example.com" denied the request: '
                "image registry not allowed",
            ),
            "audit_annotations": {"images.policy.example.com_violation": "registry"},
        },
        "deny.v1beta1.json",
        id="REV-02: a v1beta1 caller is answered in v1beta1",
    ),
]


@pytest.mark.parametrize(("inbound_fixture", "kwargs", "reply_fixture"), REPLIES)
def test_reply_matches_golden(inbound_fixture: str, kwargs: dict[str, Any], reply_fixture: str) -> None:
    """REV-02/GW-16: the reply bytes equal the golden file exactly."""
    inbound = decode_inbound(golden(f"inbound/{inbound_fixture}"))
    assert encode_reply(inbound, **kwargs) == golden(f"reply/{reply_fixture}").rstrip(b"\n")


@pytest.mark.parametrize(("inbound_fixture", "kwargs", "reply_fixture"), REPLIES)
@settings(max_examples=50, deadline=None)
@given(uid=st.text(min_size=1))
def test_a_reply_template_renders_encode_replys_bytes_for_any_uid(
    inbound_fixture: str, kwargs: dict[str, Any], reply_fixture: str, uid: str
) -> None:
    """REV-02: a shed verdict's reply template (``ReplyTemplate``, one per verdict and apiVersion)
    gives every uid, whatever JSON must escape in it, exactly the bytes ``encode_reply`` gives."""
    doc = json.loads(golden(f"inbound/{inbound_fixture}"))
    doc["request"]["uid"] = uid
    inbound = decode_inbound(body(doc))
    template = ReplyTemplate(inbound.api_version, **kwargs)
    assert template.render(uid) == encode_reply(inbound, **kwargs)


def test_golden_patch_reply_decodes_to_the_patch() -> None:
    """GW-16: the golden patch reply carries exactly the given JSON Patch, standard padded base64."""
    reply = json.loads(golden("reply/patch.v1.json"))
    assert base64.b64decode(reply["response"]["patch"], validate=True) == _PATCH


@pytest.mark.parametrize(
    ("kwargs", "response"),
    [
        pytest.param(
            {"allowed": True, "patch": b""},
            {"uid": "u-1", "allowed": True},
            id="MUT-22: an empty patch is no patch and no patchType",
        ),
        pytest.param(
            {"allowed": True, "patch": None, "warnings": [], "audit_annotations": {}},
            {"uid": "u-1", "allowed": True},
            id="REV-02: empty warnings and annotations are omitted",
        ),
        pytest.param(
            {"allowed": False, "status": Status(status="Failure", code=400, message="m")},
            {"uid": "u-1", "allowed": False, "status": {"status": "Failure", "message": "m", "code": 400}},
            id="ERR-10: a deny carries its status and allowed false",
        ),
    ],
)
def test_reply_shape(kwargs: dict[str, Any], response: dict[str, Any]) -> None:
    """REV-02/ERR-10: the reply has apiVersion, kind and response only, with omitted empty members."""
    inbound = decode_inbound(body(inbound_doc()))
    assert json.loads(encode_reply(inbound, **kwargs)) == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"allowed": True, "status": Status(code=200)},
            "an allowed reply carries no status (ERR-10)",
            id="ERR-10: an allowed reply with a status is a bug",
        ),
        pytest.param(
            {"allowed": False},
            "a deny carries a status (ERR-10)",
            id="ERR-10: a deny without status is a bug",
        ),
        pytest.param(
            {"allowed": False, "status": Status(code=400, message="m"), "patch": b"[]"},
            "a deny carries no patch (MUT-13)",
            id="MUT-13: a deny with a patch is a bug",
        ),
    ],
)
def test_reply_contract_violations_raise(kwargs: dict[str, Any], message: str) -> None:
    """GW-16/ERR-10: encode_reply refuses replies the caller's verification or ERR-10 would not accept."""
    inbound = decode_inbound(body(inbound_doc()))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        encode_reply(inbound, **kwargs)


def test_bad_request_status_matches_golden() -> None:
    """REV-01: the HTTP 400 body is a meta/v1 Status, Failure, BadRequest, code 400, with the message."""
    assert encode_bad_request_status("request.uid is missing or empty") == golden(
        "reply/bad-request.status.json"
    ).rstrip(b"\n")


@pytest.mark.parametrize(
    ("code", "reason", "message"),
    [
        pytest.param(405, "MethodNotAllowed", "method GET is not allowed", id="REV-16: 405 Status body"),
        pytest.param(
            404, "NotFound", "the server could not find the requested resource", id="REV-16: 404 Status body"
        ),
        pytest.param(
            413, "RequestEntityTooLarge", "request body exceeds 33554432 bytes", id="TRN-13: 413 Status body"
        ),
    ],
)
def test_status_bodies(code: int, reason: str, message: str) -> None:
    """REV-16/TRN-13: HTTP error bodies are meta/v1 Status objects carrying code, reason and message."""
    assert msgspec.json.decode(encode_status(code, reason, message)) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@pytest.mark.parametrize(
    "member",
    [
        pytest.param(m, id=f"REV-01: a byte that is not UTF-8 in {m} is refused, naming byte and offset")
        for m in ("name", "namespace")
    ],
)
def test_invalid_utf8_is_refused_naming_byte_and_offset(member: str) -> None:
    payload = body(inbound_doc(**{member: "web-MARK"})).replace(b"MARK", b"\xfe")
    offset = payload.index(b"\xfe")
    with pytest.raises(BadReview) as info:
        decode_inbound(payload)
    assert (
        str(info.value)
        == f"request body is not valid UTF-8: invalid start byte (byte 0xfe at offset {offset})"
    )
