"""Deny statuses and non-2xx causes (ERR-01..10, MUT-06/09/10, VAL-06/07)."""

from __future__ import annotations

import pytest

from gateway.admission import Status, StatusCause, StatusDetails
from gateway.dispatch.status import (
    call_error_status,
    changed_kind_status,
    combine_denials,
    dry_run_status,
    http_error_cause,
    internal_error_status,
    not_an_object_status,
    panicked_status,
    patch_failure_status,
    patch_on_delete_status,
    rejection_status,
)

HOOK = "images.policy.example.com"
DENIED = f'admission webhook "{HOOK}" denied the request'
DETAILS = StatusDetails(
    name="web-1", kind="pods", causes=[StatusCause(type="FieldValueInvalid", field="spec")]
)


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        pytest.param(
            None,
            Status(status="Failure", code=400, message=f"{DENIED} without explanation"),
            id="ERR-01: no status at all is a 400 Failure without explanation",
        ),
        pytest.param(
            Status(),
            Status(status="Failure", code=400, message=f"{DENIED} without explanation"),
            id="ERR-01: an empty status is a 400 Failure without explanation",
        ),
        pytest.param(
            Status(code=403, reason="Forbidden", message="image registry not allowed"),
            Status(
                status="Failure",
                code=403,
                reason="Forbidden",
                message=f"{DENIED}: image registry not allowed",
            ),
            id="ERR-01: message is prefixed with the backend name; code 403 and reason pass",
        ),
        pytest.param(
            Status(reason="NotAcceptable"),
            Status(status="Failure", code=400, reason="NotAcceptable", message=f"{DENIED}: NotAcceptable"),
            id="ERR-01: without message the reason is used",
        ),
        pytest.param(
            Status(code=200, status="Success", message="m"),
            Status(status="Failure", code=400, message=f"{DENIED}: m"),
            id="ERR-01: code 200 becomes 400 and Success becomes Failure",
        ),
        pytest.param(
            Status(code=399, message="m"),
            Status(status="Failure", code=400, message=f"{DENIED}: m"),
            id="ERR-01: a code below 400 becomes 400",
        ),
        pytest.param(
            Status(code=422, message="m", details=DETAILS),
            Status(status="Failure", code=422, message=f"{DENIED}: m", details=DETAILS),
            id="ERR-01: 422 and details pass through unchanged",
        ),
        pytest.param(
            Status(code=429, message="m"),
            Status(status="Failure", code=429, message=f"{DENIED}: m"),
            id="ERR-01: 429 passes through",
        ),
        pytest.param(
            Status(code=500, message="m"),
            Status(status="Failure", code=500, message=f"{DENIED}: m"),
            id="ERR-01: 500 passes through",
        ),
        pytest.param(
            Status(code=999, message="m"),
            Status(status="Failure", code=999, message=f"{DENIED}: m"),
            id="ERR-01: even 999 passes through",
        ),
        pytest.param(
            Status(status="Failure", code=403, message="m", reason="r"),
            Status(status="Failure", code=403, message=f"{DENIED}: m", reason="r"),
            id="ERR-01: the message wins over the reason",
        ),
        pytest.param(
            Status(status="Pending", code=409, message="m"),
            Status(status="Pending", code=409, message=f"{DENIED}: m"),
            id="ERR-01/10: a status value other than empty or Success passes through",
        ),
    ],
)
def test_rejection_status(backend: Status | None, expected: Status) -> None:
    """ERR-01: a backend rejection is normalised and names the backend."""
    assert rejection_status(HOOK, backend) == expected


def _internal(text: str) -> Status:
    return Status(
        status="Failure",
        code=500,
        reason="InternalError",
        message=f"Internal error occurred: {text}",
        details=StatusDetails(causes=[StatusCause(message=text)]),
    )


REASON = 'failed to call webhook: Post "https://images.policy.svc:443/check?timeout=10s": context deadline exceeded'


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        pytest.param(
            call_error_status(HOOK, REASON),
            _internal(f'failed calling webhook "{HOOK}": {REASON}'),
            id="ERR-02: a fail-closed call error is 500 InternalError with the same text as its cause",
        ),
        pytest.param(
            dry_run_status(HOOK),
            Status(
                status="Failure",
                code=400,
                reason="BadRequest",
                message=f'admission webhook "{HOOK}" does not support dry run',
            ),
            id="ERR-04: a dry-run refusal is 400 BadRequest",
        ),
        pytest.param(
            patch_failure_status(HOOK, 'operation 0 (remove "/a"): member to remove does not exist'),
            _internal(
                f'admission webhook "{HOOK}" returned a patch that cannot be applied: '
                'operation 0 (remove "/a"): member to remove does not exist'
            ),
            id="ERR-05/MUT-07: a patch that cannot be applied is 500 naming the backend",
        ),
        pytest.param(
            patch_failure_status(HOOK, ValueError("boom")),
            _internal(f'admission webhook "{HOOK}" returned a patch that cannot be applied: boom'),
            id="ERR-05: an exception is reported by its text",
        ),
        pytest.param(
            not_an_object_status(HOOK, "the patched document is an array, not an object"),
            _internal(
                f'admission webhook "{HOOK}" returned a patch that cannot be applied: '
                "the patched document is an array, not an object"
            ),
            id="MUT-09: a result that is not an object is reported like ERR-05",
        ),
        pytest.param(
            patch_on_delete_status(HOOK),
            _internal(
                f'admission webhook "{HOOK}" attempted to modify the object, which is not supported for this operation'
            ),
            id="MUT-06: a patch on DELETE is a 500",
        ),
        pytest.param(
            changed_kind_status(HOOK, "apps/v1", "Deployment", "v1", "Pod"),
            _internal(
                f'admission webhook "{HOOK}" changed apiVersion/kind from apps/v1/Deployment to v1/Pod'
            ),
            id="MUT-10: a changed apiVersion/kind is a 500 naming both",
        ),
        pytest.param(
            panicked_status(HOOK, "KeyError: 'spec'"),
            _internal(f"ValidatingAdmissionWebhook/{HOOK} has panicked: KeyError: 'spec'"),
            id="VAL-06: an unexpected exception under Fail is a 500 'has panicked'",
        ),
        pytest.param(
            internal_error_status("encoding the reply", "bad value"),
            _internal("encoding the reply: bad value"),
            id="ERR-08: a gateway failure is a 500 naming the step",
        ),
    ],
)
def test_fixed_statuses(status: Status, expected: Status) -> None:
    """ERR-02/04/05/08, MUT-06/09/10, VAL-06: each deny has the spec's exact status."""
    assert status == expected


def test_every_builder_meets_err_10() -> None:
    """ERR-10: every deny status is a Failure with a code ≥ 400 and a non-empty message."""
    statuses = [
        rejection_status(HOOK, None),
        rejection_status(HOOK, Status(code=201, status="Success")),
        call_error_status(HOOK, "x"),
        dry_run_status(HOOK),
        patch_failure_status(HOOK, "x"),
        not_an_object_status(HOOK, "x"),
        patch_on_delete_status(HOOK),
        changed_kind_status(HOOK, "v1", "Pod", "v1", "Service"),
        panicked_status(HOOK, "x"),
        internal_error_status("step", "x"),
    ]
    for status in statuses:
        assert status.status == "Failure"
        assert status.code >= 400
        assert status.message


JSON = "application/json"
TEXT = "text/plain; charset=utf-8"


@pytest.mark.parametrize(
    ("code", "content_type", "body", "expected"),
    [
        pytest.param(400, TEXT, b"x", ("the server rejected our request for an unknown reason", 400),
                     id="ERR-07: 400 BadRequest"),
        pytest.param(401, TEXT, b"x", ("the server has asked for the client to provide credentials", 401),
                     id="ERR-07: 401 Unauthorized"),
        pytest.param(403, TEXT, b"  go away \n", ("go away", 403),
                     id="ERR-07: 403 gives the trimmed server message"),
        pytest.param(403, JSON, b'{"a":1}', ("unknown", 403),
                     id="ERR-07: a non-text body gives the server message 'unknown'"),
        pytest.param(403, "", b"plain words", ("plain words", 403),
                     id="ERR-07: no Content-Type counts as text"),
        pytest.param(404, TEXT, b"x", ("the server could not find the requested resource", 404),
                     id="ERR-07: 404 NotFound"),
        pytest.param(405, TEXT, b"x", ("the server does not allow this method on the requested resource", 405),
                     id="ERR-07: 405 MethodNotAllowed"),
        pytest.param(406, TEXT, b"want xml", ("want xml", 406), id="ERR-07: 406 with a message gives it"),
        pytest.param(406, TEXT, b"  ",
                     ("the server was unable to respond with a content type that the client supports", 406),
                     id="ERR-07: 406 with an empty message gives the fixed text"),
        pytest.param(406, JSON, b"{}",
                     ("the server was unable to respond with a content type that the client supports", 406),
                     id="ERR-07: 406 with message 'unknown' gives the fixed text"),
        pytest.param(409, TEXT, b"x", ("the server reported a conflict", 409), id="ERR-07: 409 AlreadyExists"),
        pytest.param(415, TEXT, b"use json", ("use json", 415), id="ERR-07: 415 gives the server message"),
        pytest.param(415, JSON, b"[]", ("unknown", 415), id="ERR-07: 415 with a JSON body gives 'unknown'"),
        pytest.param(422, TEXT, b"x", ("the server rejected our request due to an error in our request", 422),
                     id="ERR-07: 422 Invalid"),
        pytest.param(429, TEXT, b"x",
                     ("the server has received too many requests and has asked us to try again later", 429),
                     id="ERR-07: 429 TooManyRequests"),
        pytest.param(503, TEXT, b"x", ("the server is currently unable to handle the request", 503),
                     id="ERR-07: 503 ServiceUnavailable"),
        pytest.param(504, TEXT, b"x", ("the server was unable to return a response in the time allotted, but may "
                                       "still be processing the request", 504), id="ERR-07: 504 Timeout"),
        pytest.param(500, TEXT, b"oops\n",
                     ('an error on the server ("oops") has prevented the request from succeeding', 500),
                     id="ERR-07: 500 quotes the server message Go-style"),
        pytest.param(502, JSON, b"{}",
                     ('an error on the server ("unknown") has prevented the request from succeeding', 502),
                     id="ERR-07: other 5xx with a JSON body quotes 'unknown'"),
        pytest.param(599, TEXT, b'a "b"\tc\\d\x01\xff' + "é\u200b".encode(),
                     ('an error on the server ("a \\"b\\"\\tc\\\\d\\x01\\xffé\\u200b") has prevented the request '
                      "from succeeding", 599),
                     id="ERR-07: %q escapes quotes, controls, invalid bytes and non-printables, keeps é"),
        pytest.param(500, TEXT, b"", ('an error on the server ("") has prevented the request from succeeding', 500),
                     id="ERR-07: 500 with an empty body"),
        pytest.param(418, TEXT, b"teapot",
                     ("the server responded with the status code 418 but did not return more information", 418),
                     id="ERR-07: another status is Unknown"),
        pytest.param(302, TEXT, b"",
                     ("the server responded with the status code 302 but did not return more information", 302),
                     id="ERR-07/FPT-11: a redirect is Unknown"),
        pytest.param(101, "", b"",
                     ("the server responded with the status code 101 but did not return more information", 101),
                     id="ERR-07/REV-09: 101 is treated like any other status"),
        pytest.param(403, TEXT, b"\x1cx\x1c", ("\x1cx\x1c", 403),
                     id="ERR-07: trimming follows Go's TrimSpace (\\x1c is not space)"),
        pytest.param(403, TEXT, b"\xc2\xa0x\xe3\x80\x80", ("x", 403),
                     id="ERR-07: trimming removes Unicode spaces (NBSP, ideographic space)"),
    ],
)  # fmt: skip
def test_generic_server_response_causes(
    code: int, content_type: str, body: bytes, expected: tuple[str, int]
) -> None:
    """ERR-07/FPT-12: the cause text and metrics code of a reply outside 200–206."""
    assert http_error_cause(code, content_type, body) == expected


def test_server_message_is_cut_at_2048_bytes() -> None:
    """ERR-07: the server message is the first 2048 bytes of the body, then trimmed."""
    cause, code = http_error_cause(500, "text/plain", b"a" * 2047 + b"bcdef")
    assert cause == f'an error on the server ("{"a" * 2047}b") has prevented the request from succeeding'
    assert code == 500


@pytest.mark.parametrize(
    ("code", "content_type", "body", "expected"),
    [
        pytest.param(
            500, JSON, b'{"kind":"Status","apiVersion":"v1","status":"Failure","message":"quota gone","code":429}',
            ("quota gone", 429), id="ERR-07: a Failure Status body gives its message and code",
        ),
        pytest.param(
            403, TEXT, b'{"kind":"Status","status":"Failure","message":"m","code":403}',
            ("m", 403), id="ERR-07: a Status body is read whatever the Content-Type",
        ),
        pytest.param(
            503, "", b'{"kind":"Status","apiVersion":"meta.k8s.io/v1","status":"Failure","message":"m"}',
            ("m", 0), id="ERR-07: a Status without code gives code 0, as upstream",
        ),
        pytest.param(
            500, JSON, b'{"kind":"Status","status":"Failure","code":500}',
            ("", 500), id="ERR-07: a Status without message gives an empty cause",
        ),
        pytest.param(
            500, JSON, b'{"kind":"Status","status":"Success","message":"m","code":200}',
            ('an error on the server ("unknown") has prevented the request from succeeding', 500),
            id="ERR-07: a Success Status is not used",
        ),
        pytest.param(
            400, JSON, b'{"status":"Failure","message":"m","code":409}',
            ("the server rejected our request for an unknown reason", 400),
            id="ERR-07: a body without kind Status is not a Status",
        ),
        pytest.param(
            400, JSON, b'{"kind":"Status","status":"Failure","message":"m","code":"409"}',
            ("the server rejected our request for an unknown reason", 400),
            id="ERR-07: a Status with a mistyped field does not decode",
        ),
        pytest.param(
            400, TEXT, b'[{"kind":"Status"}]',
            ("the server rejected our request for an unknown reason", 400),
            id="ERR-07: a JSON array is not a Status",
        ),
    ],
)  # fmt: skip
def test_status_body_overrides(code: int, content_type: str, body: bytes, expected: tuple[str, int]) -> None:
    """ERR-07: a body that decodes as a Failure Status replaces the generic text and code."""
    assert http_error_cause(code, content_type, body) == expected


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        pytest.param("text", ("unknown", 403), id="ERR-07: a bare media type parses but is not text/*"),
        pytest.param(
            "TEXT/Plain;", ("x", 403), id="ERR-07: media types are case-insensitive; one ';' is fine"
        ),
        pytest.param('text/plain; a="b;c"', ("x", 403), id="ERR-07: quoted parameters may hold ';'"),
        pytest.param(
            "/json", ("Internal error occurred: mime: no media type", 500), id="ERR-07: no media type"
        ),
        pytest.param(
            "text plain",
            ("Internal error occurred: mime: expected slash after first token", 500),
            id="ERR-07: a space instead of a slash",
        ),
        pytest.param(
            "text/",
            ("Internal error occurred: mime: expected token after slash", 500),
            id="ERR-07: no subtype",
        ),
        pytest.param(
            "text/plain x",
            ("Internal error occurred: mime: unexpected content after media subtype", 500),
            id="ERR-07: junk after the subtype",
        ),
        pytest.param(
            "text/plain;;a=b",
            ("Internal error occurred: mime: invalid media parameter", 500),
            id="ERR-07: an empty parameter",
        ),
        pytest.param(
            "text/plain; a=b; A=c",
            ("Internal error occurred: mime: duplicate parameter name", 500),
            id="ERR-07: a repeated parameter",
        ),
    ],
)
def test_content_type_parsing(content_type: str, expected: tuple[str, int]) -> None:
    """ERR-07: an unparsable Content-Type makes the rest client fail with an internal error (code 500)."""
    assert http_error_cause(403, content_type, b"x") == expected


def _deny(name: str, code: int = 403, reason: str = "Forbidden") -> Status:
    return rejection_status(name, Status(code=code, reason=reason, message="no"))


@pytest.mark.parametrize(
    ("statuses", "limit", "expected_message"),
    [
        pytest.param([_deny("a")], 8192, 'admission webhook "a" denied the request: no',
                     id="VAL-07: one error is reported as it is"),
        pytest.param([_deny("a"), call_error_status("b", "failed to call webhook: x")], 8192,
                     'admission webhook "a" denied the request: no; '
                     'Internal error occurred: failed calling webhook "b": failed to call webhook: x',
                     id="VAL-07: every error, joined with '; ' in configuration order"),
        pytest.param([_deny("a"), _deny("b"), _deny("c")], 102,
                     'admission webhook "a" denied the request: no; admission webhook "b" denied the request: no'
                     "; and 1 more",
                     id="VAL-07: past the limit, whole messages are left out and counted"),
        pytest.param([_deny("a"), _deny("b"), _deny("c")], 101,
                     'admission webhook "a" denied the request: no; and 2 more',
                     id="VAL-07: a message that would leave no room for the count is left out"),
        pytest.param([_deny("a"), _deny("b")], 10,
                     'admission webhook "a" denied the request: no; and 1 more',
                     id="VAL-07: the first message is always kept"),
        pytest.param([_deny("a"), _deny("b"), _deny("c")], 136,
                     'admission webhook "a" denied the request: no; admission webhook "b" denied the request: no; '
                     'admission webhook "c" denied the request: no',
                     id="VAL-07: everything that fits is kept"),
    ],
)  # fmt: skip
def test_combine_denials(statuses: list[Status], limit: int, expected_message: str) -> None:
    """VAL-07: one deny with the first error's fields and every message, bounded."""
    combined = combine_denials(statuses, limit=limit)
    assert combined.message == expected_message
    assert len(combined.message) <= max(limit, len(statuses[0].message) + len("; and 99 more"))
    assert (combined.code, combined.reason, combined.status, combined.details) == (
        statuses[0].code,
        statuses[0].reason,
        statuses[0].status,
        statuses[0].details,
    )


def test_combine_denials_takes_code_and_reason_from_the_first() -> None:
    """VAL-07: a 500 call error after a 403 rejection leaves code 403 and reason Forbidden."""
    combined = combine_denials([_deny("a"), call_error_status("b", "x"), _deny("c", 422, "Invalid")])
    assert (combined.code, combined.reason) == (403, "Forbidden")
    assert combined.message.count("; ") == 2


def test_combine_denials_needs_a_status() -> None:
    """VAL-07: there is nothing to combine without a recorded error."""
    with pytest.raises(ValueError, match="at least one"):
        combine_denials([])
