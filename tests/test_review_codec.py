"""The backend side of the codec: negotiation (REV-03..05), requests (REV-06), replies (REV-08/10/12..14)."""

from __future__ import annotations

import base64
import json
import os
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.admission import Status, StatusCause, StatusDetails
from gateway.config.model import ClientConfig, Webhook
from gateway.config.selectors import EVERYTHING
from gateway.errors import CallingWebhookError
from gateway.review import (
    KIND_DECODE,
    KIND_INVALID_RESPONSE,
    KIND_VERSION,
    NO_KNOWN_VERSION_REASON,
    BackendResponse,
    ReviewVersion,
    decode_backend_response,
    decode_inbound,
    encode_backend_request,
    negotiate_version,
    new_request_uid,
    no_known_version_error,
)

GOLDEN = Path(__file__).parent / "golden"
BACKEND_UID = "11111111-2222-4333-8444-555555555555"
SENT = BACKEND_UID


def golden(path: str) -> bytes:
    return (GOLDEN / path).read_bytes()


def compact(raw: bytes) -> bytes:
    return json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=False).encode()


def webhook(*versions: str) -> Webhook:
    return Webhook(
        name="a.example.com",
        configuration="c",
        kind="validating",
        identity="c/a.example.com/0",
        index=0,
        client_config=ClientConfig(url="https://a.example.com/"),
        rules=(),
        failure_policy="Fail",
        match_policy="Equivalent",
        namespace_selector=EVERYTHING,
        object_selector=EVERYTHING,
        side_effects="None",
        timeout_seconds=10,
        admission_review_versions=versions,
    )


# --- REV-03/04/05: negotiation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        pytest.param(("v1",), "v1", id="REV-03: [v1] gets v1"),
        pytest.param(("v1beta1",), "v1beta1", id="REV-03: [v1beta1] gets v1beta1"),
        pytest.param(("v1", "v1beta1"), "v1", id="REV-03: the first known entry wins, v1 before v1beta1"),
        pytest.param(
            ("v1beta1", "v1"), "v1beta1", id="REV-03: the first known entry wins, v1beta1 before v1"
        ),
        pytest.param(("v2", "v1beta1", "v1"), "v1beta1", id="REV-03: unknown entries are skipped"),
        pytest.param(("v2",), None, id="REV-05: only unknown versions gives no version"),
        pytest.param((), None, id="REV-05: an empty list gives no version"),
        pytest.param(("V1", "v1 "), None, id="REV-05: versions are compared exactly"),
    ],
)
def test_negotiate_version(versions: tuple[str, ...], expected: str | None) -> None:
    """REV-03/05: a backend gets the first of its admissionReviewVersions that is v1 or v1beta1."""
    assert negotiate_version(webhook(*versions)) == expected


def test_no_known_version_is_a_call_error_with_code_400() -> None:
    """REV-05: the call error has the exact reason and metrics code 400."""
    err = no_known_version_error()
    assert isinstance(err, CallingWebhookError)
    assert (err.reason, err.status_code, err.kind) == (
        "could not create admission objects: "
        "webhook does not accept known AdmissionReview versions (v1, v1beta1)",
        400,
        KIND_VERSION,
    )
    assert err.reason == NO_KNOWN_VERSION_REASON


# --- REV-04/06: the request to a backend -------------------------------------------------------

_ROUND_TRIPS = [
    pytest.param(inbound.name, version, id=f"REV-06: {inbound.name} sent as {version}")
    for inbound in sorted((GOLDEN / "inbound").iterdir())
    for version in ("v1", "v1beta1")
]


def _expected_backend(inbound_name: str, version: str) -> bytes:
    base = inbound_name.removesuffix(".json").rsplit(".", 1)[0]
    return golden(f"backend/{base}.{version}.json")


@pytest.mark.parametrize(("inbound_name", "version"), _ROUND_TRIPS)
def test_backend_request_matches_golden(inbound_name: str, version: ReviewVersion) -> None:
    """REV-04/06/07: decode inbound, encode for a backend in either version: equal to the expected review."""
    inbound = decode_inbound(golden(f"inbound/{inbound_name}"))
    sent = encode_backend_request(inbound, version=version, uid=BACKEND_UID, object=inbound.attributes.object)
    assert json.loads(sent) == json.loads(_expected_backend(inbound_name, version))


@pytest.mark.parametrize(("inbound_name", "version"), _ROUND_TRIPS)
def test_backend_request_bytes_are_upstream_shaped(inbound_name: str, version: ReviewVersion) -> None:
    """REV-06: from a compact inbound review the request is byte-exact: upstream order, objects spliced."""
    inbound = decode_inbound(compact(golden(f"inbound/{inbound_name}")))
    sent = encode_backend_request(inbound, version=version, uid=BACKEND_UID, object=inbound.attributes.object)
    assert sent == compact(_expected_backend(inbound_name, version))


def test_backend_request_carries_fresh_uid_and_current_object() -> None:
    """REV-06: only uid and object change between calls; everything else is copied unchanged."""
    inbound = decode_inbound(golden("inbound/create-pod.v1.json"))
    patched = msgspec.Raw(b'{"apiVersion":"v1","kind":"Pod","metadata":{"labels":{"team":"payments"}}}')
    first = json.loads(
        encode_backend_request(inbound, version="v1", uid="uid-a", object=inbound.attributes.object)
    )
    second = json.loads(encode_backend_request(inbound, version="v1beta1", uid="uid-b", object=patched))
    third = json.loads(encode_backend_request(inbound, version="v1", uid="uid-c", object=None))
    assert (first["request"]["uid"], second["request"]["uid"], third["request"]["uid"]) == (
        "uid-a",
        "uid-b",
        "uid-c",
    )
    assert second["request"]["object"] == json.loads(bytes(patched))
    assert third["request"]["object"] is None
    assert second["apiVersion"] == "admission.k8s.io/v1beta1"
    for doc in (second, third):
        for key in set(first["request"]) - {"uid", "object"}:
            assert doc["request"][key] == first["request"][key], key
    assert "response" not in first


def test_backend_request_quotes_the_uid() -> None:
    """REV-06: the uid is written as a JSON string, whatever characters it holds."""
    inbound = decode_inbound(golden("inbound/delete-configmap.v1.json"))
    sent = encode_backend_request(inbound, version="v1", uid='a"b\\c', object=None)
    assert json.loads(sent)["request"]["uid"] == 'a"b\\c'


def test_request_uids_are_unique() -> None:
    """REV-06: every call gets a new uid."""
    assert len({new_request_uid() for _ in range(1000)}) == 1000


def test_request_uids_are_rfc_version_4_uuids() -> None:
    """REV-06: the uid is a canonical version-4 UUID string, as upstream sends."""
    for _ in range(200):
        uid = new_request_uid()
        parsed = uuid.UUID(uid)
        assert (str(parsed), parsed.version, parsed.variant) == (uid, 4, uuid.RFC_4122)


def test_request_uids_differ_between_forked_worker_processes() -> None:
    """REV-06: a forked worker does not repeat its parent's uids (the generator is re-seeded)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send one uid and leave at once
        os.write(write, new_request_uid().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child != new_request_uid()


# --- decoding replies --------------------------------------------------------------------------

PATCH = b'[{"op":"add","path":"/metadata/labels/team","value":"payments"}]'
PATCH64 = base64.b64encode(PATCH).decode()


def v1(**response: Any) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": SENT, **response},
    }


def v1beta1(**response: Any) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "response": response}


def without(doc: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in keys}


def encode(doc: object) -> bytes:
    return doc if isinstance(doc, bytes) else json.dumps(doc).encode()


def decode(doc: object, version: ReviewVersion = "v1", *, mutating: bool = False) -> BackendResponse:
    return decode_backend_response(encode(doc), version=version, sent_uid=SENT, mutating=mutating)


def reason_of(doc: object, version: ReviewVersion = "v1", *, mutating: bool = False) -> str:
    with pytest.raises(CallingWebhookError) as info:
        decode(doc, version, mutating=mutating)
    return info.value.reason


ALLOW = BackendResponse(allowed=True, uid=SENT)
DENY = BackendResponse(allowed=False, uid=SENT)
PATCHED = BackendResponse(allowed=True, patch=PATCH, patch_type="JSONPatch", uid=SENT)


@pytest.mark.parametrize(
    ("fixture", "version", "mutating", "expected"),
    [
        pytest.param("allow.v1.json", "v1", False, ALLOW, id="REV-12: a v1 allow"),
        pytest.param(
            "deny.v1.json",
            "v1",
            False,
            BackendResponse(
                allowed=False,
                status=Status(code=403, reason="Forbidden", message="image registry not allowed"),
                warnings=["tag :latest is discouraged"],
                audit_annotations={"violation": "registry"},
                uid=SENT,
            ),
            id="REV-11: a v1 deny keeps status, warnings and annotations",
        ),
        pytest.param("patch.v1.json", "v1", True, PATCHED, id="REV-13: a v1 patch with JSONPatch"),
        pytest.param(
            "allow.v1beta1.json",
            "v1beta1",
            False,
            BackendResponse(allowed=True, uid="not-the-sent-uid"),
            id="REV-14: v1beta1 does not compare the uid",
        ),
        pytest.param(
            "patch-without-type.v1beta1.json",
            "v1beta1",
            True,
            BackendResponse(allowed=True, patch=PATCH, patch_type="JSONPatch"),
            id="REV-14: a v1beta1 patch without patchType and without apiVersion/kind is a JSON Patch",
        ),
        pytest.param(
            "deny-with-patch.v1beta1.json",
            "v1beta1",
            True,
            BackendResponse(
                allowed=False,
                status=Status(
                    message="replicas above quota",
                    code=422,
                    reason="Invalid",
                    details=StatusDetails(
                        name="web",
                        kind="deployments",
                        causes=[
                            StatusCause(
                                type="FieldValueInvalid", field="spec.replicas", message="must be at most 4"
                            )
                        ],
                    ),
                ),
                patch=b"[]",
                patch_type="JSONPatch",
                uid=SENT,
            ),
            id="REV-14: a v1beta1 deny keeps status details; its patch is left to the dispatcher",
        ),
    ],
)
def test_golden_replies_decode(
    fixture: str, version: ReviewVersion, mutating: bool, expected: BackendResponse
) -> None:
    """REV-10..14: golden backend replies decode into the expected verified response."""
    body = golden(f"response/{fixture}")
    assert decode_backend_response(body, version=version, sent_uid=SENT, mutating=mutating) == expected


# REV-08 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "mutating", "reason"),
    [
        pytest.param(
            b"",
            False,
            "failed to call webhook: 0-length response with status code: 200 "
            "and content type: application/json",
            id="REV-08: an empty body",
        ),
        pytest.param(
            b"[]",
            False,
            "failed to call webhook: Expected `object | null`, got `array`",
            id="REV-08: a JSON array",
        ),
        pytest.param(
            v1(allowed="true"),
            False,
            "failed to call webhook: Expected `bool | null`, got `str` - at `$.response.allowed`",
            id="REV-08: allowed as a string",
        ),
        pytest.param(
            v1(allowed=True, warnings="w"),
            False,
            "failed to call webhook: Expected `array | null`, got `str` - at `$.response.warnings`",
            id="REV-08: warnings that are not a list",
        ),
        pytest.param(
            v1(allowed=True, auditAnnotations={"k": 1}),
            False,
            "failed to call webhook: Expected `str`, got `int` - at `$.response.auditAnnotations[...]`",
            id="REV-08: an annotation value that is not a string",
        ),
        pytest.param(
            v1(allowed=False, status={"code": "403"}),
            False,
            "failed to call webhook: Expected `int`, got `str` - at `$.response.status.code`",
            id="REV-08: a status code that is not a number",
        ),
        pytest.param(
            v1(allowed=True, patch=7, patchType="JSONPatch"),
            True,
            "failed to call webhook: Expected `str | null`, got `int` - at `$.response.patch`",
            id="REV-08: a patch that is not a string",
        ),
        pytest.param(
            v1(allowed=True, patch=PATCH.decode(), patchType="JSONPatch"),
            True,
            "failed to call webhook: illegal base64 data in response.patch: Only base64 data is allowed",
            id="REV-08: a patch that is plain JSON, not base64",
        ),
        pytest.param(
            v1(allowed=True, patch=PATCH64.rstrip("="), patchType="JSONPatch"),
            True,
            "failed to call webhook: illegal base64 data in response.patch: Incorrect padding",
            id="REV-08: base64 without padding",
        ),
        pytest.param(
            v1(allowed=True, patch=base64.urlsafe_b64encode(b"\xfb\xff" * 3).decode(), patchType="JSONPatch"),
            True,
            "failed to call webhook: illegal base64 data in response.patch: Only base64 data is allowed",
            id="REV-08: URL-safe base64",
        ),
        pytest.param(
            v1(allowed=True, patch=PATCH64[:8] + " " + PATCH64[8:], patchType="JSONPatch"),
            True,
            "failed to call webhook: illegal base64 data in response.patch: Only base64 data is allowed",
            id="REV-08: a space inside the base64",
        ),
        pytest.param(
            v1(allowed=True, patch="QQ==QQ==", patchType="JSONPatch"),
            True,
            "failed to call webhook: illegal base64 data in response.patch: Excess data after padding",
            id="REV-08: data after the padding",
        ),
        pytest.param(
            v1(allowed=True, patch="é" + PATCH64, patchType="JSONPatch"),
            True,
            "failed to call webhook: illegal base64 data in response.patch: "
            "string argument should contain only ASCII characters",
            id="REV-08: a non-ASCII character in the base64",
        ),
        pytest.param(
            v1(allowed=True, patch="!!!!"),
            False,
            "failed to call webhook: illegal base64 data in response.patch: Only base64 data is allowed",
            id="REV-08: bad base64 fails decoding even where the patch would be refused (validating)",
        ),
        pytest.param(
            without(v1(allowed=True, patch="!!!!"), "response"),
            False,
            "received invalid webhook response: webhook response was absent",
            id="REV-08: no response, no patch to decode",
        ),
    ],
)
def test_undecodable_v1_reply(doc: object, mutating: bool, reason: str) -> None:
    """REV-08: a body that does not decode is the call error `failed to call webhook: <decode error>`."""
    assert reason_of(doc, mutating=mutating) == reason


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(b"{", id="REV-08: truncated JSON"),
        pytest.param(b"allowed: true", id="REV-08: a YAML body"),
        pytest.param(b"<html>ok</html>", id="REV-08: an HTML body"),
        pytest.param(encode(v1(allowed=True)) + b" trailing", id="REV-08: trailing data"),
    ],
)
def test_malformed_json_reply(doc: bytes) -> None:
    """REV-08: malformed JSON is a decode call error carrying the parser's explanation, code 503."""
    with pytest.raises(CallingWebhookError) as info:
        decode(doc)
    assert info.value.reason.startswith("failed to call webhook: ")
    assert len(info.value.reason) > len("failed to call webhook: ")
    assert (info.value.status_code, info.value.kind) == (503, KIND_DECODE)


def test_empty_body_text_names_status_and_content_type() -> None:
    """REV-08: the empty-body decode error names the HTTP status and Content-Type, as upstream's does."""
    with pytest.raises(CallingWebhookError) as info:
        decode_backend_response(
            b"", version="v1beta1", sent_uid=SENT, mutating=True, status_code=204, content_type="text/plain"
        )
    assert info.value.reason == (
        "failed to call webhook: 0-length response with status code: 204 and content type: text/plain"
    )


@pytest.mark.parametrize(
    ("doc", "mutating", "expected"),
    [
        pytest.param(
            v1(allowed=True, unknown={"x": [1]}, extra=None),
            False,
            ALLOW,
            id="REV-08: unknown response members are ignored",
        ),
        pytest.param(
            {**v1(allowed=True), "metadata": {}, "request": {"uid": "x"}},
            False,
            ALLOW,
            id="REV-08: unknown and stray top-level members are ignored",
        ),
        pytest.param(
            v1(Allowed=True), False, DENY, id="REV-08: names are case-sensitive (Allowed is not allowed)"
        ),
        pytest.param(
            v1(
                allowed=True,
                patch=PATCH64[:10] + "\n" + PATCH64[10:40] + "\r\n" + PATCH64[40:],
                patchType="JSONPatch",
            ),
            True,
            PATCHED,
            id="REV-08: line breaks inside the base64 are tolerated",
        ),
        pytest.param(
            v1(allowed=True, patch="W10=", patchType="JSONPatch"),
            True,
            BackendResponse(allowed=True, patch=b"[]", patch_type="JSONPatch", uid=SENT),
            id="REV-08: the patch is returned decoded; [] is left to the dispatcher (MUT-03)",
        ),
        pytest.param(
            v1(allowed=True, patch="e30=", patchType="JSONPatch"),
            True,
            BackendResponse(allowed=True, patch=b"{}", patch_type="JSONPatch", uid=SENT),
            id="REV-08: a patch that is not an array is left to the dispatcher (MUT-04)",
        ),
    ],
)
def test_tolerant_v1_reply(doc: object, mutating: bool, expected: BackendResponse) -> None:
    """REV-08: decoding ignores unknown members, is case-sensitive and tolerates line breaks in base64."""
    assert decode(doc, mutating=mutating) == expected


# REV-10 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "version", "expected"),
    [
        pytest.param(
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {"uid": SENT}},
            "v1",
            DENY,
            id="REV-10: a v1 reply without allowed is a rejection without explanation",
        ),
        pytest.param(
            {"response": {}}, "v1beta1", BackendResponse(allowed=False), id="REV-10: v1beta1 {response:{}}"
        ),
        pytest.param(v1(allowed=None), "v1", DENY, id="REV-10: allowed null means false"),
        pytest.param(
            v1(allowed=True, status={"code": 403, "message": "ignored"}),
            "v1",
            ALLOW,
            id="REV-10: status is dropped when allowed",
        ),
        pytest.param(
            v1(allowed=False, status={"code": 403, "message": "no"}),
            "v1",
            BackendResponse(allowed=False, status=Status(code=403, message="no"), uid=SENT),
            id="REV-10: status is kept when not allowed",
        ),
        pytest.param(
            v1(allowed=True, warnings=None, auditAnnotations=None, status=None),
            "v1",
            ALLOW,
            id="REV-10: null members count as absent",
        ),
    ],
)
def test_allowed_defaults_to_false(doc: object, version: ReviewVersion, expected: BackendResponse) -> None:
    """REV-10: an absent allowed means false and status is ignored when allowed is true."""
    assert decode(doc, version) == expected


# REV-12 ----------------------------------------------------------------------------------------

_INVALID = "received invalid webhook response: "
_EXPECTED_V1 = "expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got "
_DECODE_INTO_V1 = " into admission.k8s.io/v1, Kind=AdmissionReview"


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        pytest.param(
            without(v1(), "response"),
            _INVALID + "webhook response was absent",
            id="REV-12: no response member",
        ),
        pytest.param(
            {**v1(), "response": None}, _INVALID + "webhook response was absent", id="REV-12: response null"
        ),
        pytest.param(
            b"null", _INVALID + "webhook response was absent", id="REV-12: a body that is JSON null"
        ),
        pytest.param(
            v1(uid="other", allowed=True),
            _INVALID + f'expected response.uid="{SENT}", got "other"',
            id="REV-12: a different uid",
        ),
        pytest.param(
            {**v1(allowed=True), "response": {"allowed": True}},
            _INVALID + f'expected response.uid="{SENT}", got ""',
            id="REV-12: a missing uid",
        ),
        pytest.param(
            v1(uid=SENT + " ", allowed=True),
            _INVALID + f'expected response.uid="{SENT}", got "{SENT} "',
            id="REV-12: uids compare exactly, whitespace included",
        ),
        pytest.param(
            without(v1(allowed=True), "apiVersion"),
            _INVALID + _EXPECTED_V1 + "/, Kind=AdmissionReview",
            id="REV-12: no apiVersion prints an empty group/version",
        ),
        pytest.param(
            {**v1(allowed=True), "apiVersion": ""},
            _INVALID + _EXPECTED_V1 + "/, Kind=AdmissionReview",
            id="REV-12: an empty apiVersion is like a missing one",
        ),
        pytest.param(
            without(v1(allowed=True), "apiVersion", "kind"),
            _INVALID + _EXPECTED_V1 + "/, Kind=",
            id="REV-12: neither apiVersion nor kind",
        ),
        pytest.param(
            without(v1(allowed=True), "kind"),
            _INVALID + _EXPECTED_V1 + "admission.k8s.io/v1, Kind=",
            id="REV-12: no kind",
        ),
        pytest.param(
            {**v1(allowed=True), "kind": None},
            _INVALID + _EXPECTED_V1 + "admission.k8s.io/v1, Kind=",
            id="REV-12: a null kind is like a missing one",
        ),
        pytest.param(
            {**v1(allowed=True), "apiVersion": "admission.k8s.io/v1beta1"},
            "failed to call webhook: cannot decode admission.k8s.io/v1beta1, Kind=AdmissionReview"
            + _DECODE_INTO_V1,
            id="REV-12: a v1beta1 reply to a v1 request fails decoding",
        ),
        pytest.param(
            {**v1(allowed=True), "apiVersion": "v1"},
            "failed to call webhook: cannot decode v1, Kind=AdmissionReview" + _DECODE_INTO_V1,
            id="REV-12: apiVersion v1 fails decoding",
        ),
        pytest.param(
            {**v1(allowed=True), "kind": "AdmissionReview2"},
            "failed to call webhook: cannot decode admission.k8s.io/v1, Kind=AdmissionReview2"
            + _DECODE_INTO_V1,
            id="REV-12: kind AdmissionReview2 fails decoding",
        ),
        pytest.param(
            {**v1(allowed=True), "kind": "admissionreview"},
            "failed to call webhook: cannot decode admission.k8s.io/v1, Kind=admissionreview"
            + _DECODE_INTO_V1,
            id="REV-12: kind is case-sensitive",
        ),
        pytest.param(
            without({**v1(allowed=True), "kind": "Status"}, "apiVersion"),
            "failed to call webhook: cannot decode admission.k8s.io/v1, Kind=Status" + _DECODE_INTO_V1,
            id="REV-12: a wrong kind without apiVersion is read as that kind in admission.k8s.io/v1",
        ),
        pytest.param(
            without({**v1(uid="x"), "apiVersion": "admission.k8s.io/v1beta1"}, "response"),
            "failed to call webhook: cannot decode admission.k8s.io/v1beta1, Kind=AdmissionReview"
            + _DECODE_INTO_V1,
            id="REV-12 order: a wrong type fails before the response check",
        ),
        pytest.param(
            without(without(v1(), "response"), "apiVersion"),
            _INVALID + "webhook response was absent",
            id="REV-12 order: response absent before the apiVersion check",
        ),
        pytest.param(
            without(v1(uid="x", allowed=True), "apiVersion", "kind"),
            _INVALID + f'expected response.uid="{SENT}", got "x"',
            id="REV-12 order: uid before the apiVersion/kind check",
        ),
        pytest.param(
            without(v1(uid="x", allowed=True, patch=PATCH64), "kind"),
            _INVALID + f'expected response.uid="{SENT}", got "x"',
            id="REV-12 order: uid before the patch checks",
        ),
    ],
)
def test_invalid_v1_reply(doc: object, reason: str) -> None:
    """REV-12: v1 replies need response, the sent uid, then exactly admission.k8s.io/v1 AdmissionReview."""
    assert reason_of(doc) == reason
    assert reason_of(doc, mutating=True) == reason


def test_verification_failures_are_call_errors_with_code_503() -> None:
    """FPT-12: verification failures are call errors with code 503 and kind invalid_response."""
    with pytest.raises(CallingWebhookError) as info:
        decode(v1(uid="x"))
    assert (info.value.status_code, info.value.kind) == (503, KIND_INVALID_RESPONSE)


# REV-13 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "mutating", "reason"),
    [
        pytest.param(
            {"patch": PATCH64},
            True,
            "webhook returned response.patch but not response.patchType",
            id="REV-13: mutating patch without patchType",
        ),
        pytest.param(
            {"patch": PATCH64, "patchType": None},
            True,
            "webhook returned response.patch but not response.patchType",
            id="REV-13: a null patchType counts as absent",
        ),
        pytest.param(
            {"patchType": "JSONPatch"},
            True,
            "webhook returned response.patchType but not response.patch",
            id="REV-13: mutating patchType without patch",
        ),
        pytest.param(
            {"patch": "", "patchType": "JSONPatch"},
            True,
            "webhook returned response.patchType but not response.patch",
            id="REV-13: an empty patch string counts as absent",
        ),
        pytest.param(
            {"patch": None, "patchType": "JSONPatch"},
            True,
            "webhook returned response.patchType but not response.patch",
            id="REV-13: a null patch counts as absent",
        ),
        pytest.param(
            {"patchType": ""},
            True,
            "webhook returned response.patchType but not response.patch",
            id="REV-13: an empty patchType without patch fails the pairing check first",
        ),
        pytest.param(
            {"patch": PATCH64, "patchType": ""},
            True,
            'webhook returned invalid response.patchType of ""',
            id="REV-13: an empty patchType with a patch",
        ),
        pytest.param(
            {"patch": PATCH64},
            False,
            "validating webhook may not return response.patch",
            id="REV-13: validating with a patch",
        ),
        pytest.param(
            {"patch": PATCH64, "patchType": "JSONPatch"},
            False,
            "validating webhook may not return response.patch",
            id="REV-13: validating with patch and patchType reports the patch first",
        ),
        pytest.param(
            {"patchType": "JSONPatch"},
            False,
            "validating webhook may not return response.patchType",
            id="REV-13: validating with a patchType",
        ),
        pytest.param(
            {"patch": "", "patchType": ""},
            False,
            "validating webhook may not return response.patchType",
            id="REV-13: validating with an empty patchType",
        ),
    ],
)
def test_v1_patch_pairing_is_verified(response: dict[str, Any], mutating: bool, reason: str) -> None:
    """REV-13: v1 mutating replies pair patch with patchType; validating replies carry neither."""
    assert reason_of(v1(allowed=True, **response), mutating=mutating) == _INVALID + reason


@pytest.mark.parametrize(
    ("response", "mutating", "expected"),
    [
        pytest.param({}, True, ALLOW, id="REV-13: mutating without patch or patchType"),
        pytest.param(
            {"patch": "", "patchType": None}, True, ALLOW, id="REV-13: mutating with empty patch, null type"
        ),
        pytest.param(
            {"patch": PATCH64, "patchType": "JSONMergePatch"},
            True,
            BackendResponse(allowed=True, patch=PATCH, patch_type="JSONMergePatch", uid=SENT),
            id="REV-13: another patchType passes here and is left to MUT-05",
        ),
        pytest.param({"patch": ""}, False, ALLOW, id="REV-13: validating with an empty patch"),
        pytest.param(
            {"patch": None, "patchType": None}, False, ALLOW, id="REV-13: validating with null patch members"
        ),
    ],
)
def test_v1_patch_pairing_accepts(
    response: dict[str, Any], mutating: bool, expected: BackendResponse
) -> None:
    """REV-13: what the pairing rules let through, with the patch type passed on for MUT-05."""
    assert decode(v1(allowed=True, **response), mutating=mutating) == expected


# REV-14 ----------------------------------------------------------------------------------------

_DECODE_INTO_V1BETA1 = " into admission.k8s.io/v1beta1, Kind=AdmissionReview"


@pytest.mark.parametrize(
    ("doc", "mutating", "expected"),
    [
        pytest.param(
            {"response": {"allowed": True}},
            False,
            BackendResponse(allowed=True),
            id="REV-14: no apiVersion/kind/uid",
        ),
        pytest.param(
            v1beta1(uid="whatever", allowed=True),
            False,
            BackendResponse(allowed=True, uid="whatever"),
            id="REV-14: the uid is not compared",
        ),
        pytest.param(
            {"kind": "AdmissionReview", "response": {"allowed": True}},
            False,
            BackendResponse(allowed=True),
            id="REV-14: kind without apiVersion",
        ),
        pytest.param(
            v1beta1(allowed=True, patch=PATCH64),
            True,
            BackendResponse(allowed=True, patch=PATCH, patch_type="JSONPatch"),
            id="REV-14: mutating patch without patchType is a JSON Patch",
        ),
        pytest.param(
            v1beta1(allowed=True, patch=PATCH64, patchType=""),
            True,
            BackendResponse(allowed=True, patch=PATCH, patch_type="JSONPatch"),
            id="REV-14: mutating patch with an empty patchType is a JSON Patch",
        ),
        pytest.param(
            v1beta1(allowed=True, patch=PATCH64, patchType="JSONMergePatch"),
            True,
            BackendResponse(allowed=True, patch=PATCH, patch_type="JSONPatch"),
            id="REV-14: mutating patch with another patchType is a JSON Patch",
        ),
        pytest.param(
            v1beta1(allowed=True, patchType="JSONPatch"),
            True,
            BackendResponse(allowed=True),
            id="REV-14: a patchType without patch is ignored",
        ),
        pytest.param(
            v1beta1(allowed=True, patch=PATCH64, patchType="JSONPatch"),
            False,
            BackendResponse(allowed=True),
            id="REV-14: validating patch and patchType are ignored",
        ),
    ],
)
def test_v1beta1_reply_is_verified_loosely(doc: object, mutating: bool, expected: BackendResponse) -> None:
    """REV-14: v1beta1 checks only that response is present; a mutating patch is always a JSON Patch."""
    assert decode(doc, "v1beta1", mutating=mutating) == expected


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        pytest.param(
            {}, _INVALID + "webhook response was absent", id="REV-14: an empty object has no response"
        ),
        pytest.param(
            {"response": None}, _INVALID + "webhook response was absent", id="REV-14: response null"
        ),
        pytest.param(
            {**v1beta1(allowed=True), "apiVersion": "admission.k8s.io/v1"},
            "failed to call webhook: cannot decode admission.k8s.io/v1, Kind=AdmissionReview"
            + _DECODE_INTO_V1BETA1,
            id="REV-14: a v1 reply to a v1beta1 request fails decoding",
        ),
        pytest.param(
            {"kind": "ConversionReview", "response": {"allowed": True}},
            "failed to call webhook: cannot decode admission.k8s.io/v1beta1, Kind=ConversionReview"
            + _DECODE_INTO_V1BETA1,
            id="REV-14: another kind fails decoding",
        ),
        pytest.param(
            v1beta1(allowed=True, patch="not base64!"),
            "failed to call webhook: illegal base64 data in response.patch: Only base64 data is allowed",
            id="REV-14: bad base64 fails decoding even for a validating backend",
        ),
    ],
)
def test_invalid_v1beta1_reply(doc: object, reason: str) -> None:
    """REV-14: a v1beta1 reply fails only without response or when it declares another type."""
    assert reason_of(doc, "v1beta1") == reason
    assert reason_of(doc, "v1beta1", mutating=True) == reason
