"""CRD conversion through the real gateway and real conversion backends (CNV-01, CNV-04..15, MET-10/11).

Every table runs the gateway in-process on 127.0.0.1 with the sample conversion backend
(``gateway.devtools.conversion``) behind it, and sends ConversionReviews over a real socket, for both
inbound versions.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from gateway.devtools.conversion import convert_object
from tests.support.conversion import (
    CRD,
    ConversionSetup,
    conversion_review,
    crd,
    crontab,
    start_conversion,
)
from tests.support.httpservers import server_context

V2 = "stable.example.com/v2"
BOTH = pytest.mark.parametrize("caller", ["v1", "v1beta1"], ids=["inbound v1", "inbound v1beta1"])


async def convert(
    nursery: trio.Nursery,
    tmp_path: Path,
    behaviour: str = "",
    *,
    caller: str = "v1",
    objects: list[Any] | None = None,
    desired: str = V2,
    timeout: str | None = "30s",
    **crd_fields: Any,
) -> tuple[dict[str, Any], dict[str, Any], ConversionSetup]:
    """Point the CRD at ``/convert/<behaviour>``, send one review; (sent, answer, setup)."""
    path = "/convert" + (f"/{behaviour}" if behaviour else "")
    setup = await start_conversion(nursery, tmp_path, [crd(url="__backend__" + path, **crd_fields)])
    sent = conversion_review(
        objects if objects is not None else [crontab("a"), crontab("b")], desired=desired, version=caller
    )
    resp = await setup.send(sent, timeout=timeout)
    assert resp.status == 200, resp.body
    return sent, resp.json, setup


def check_envelope(sent: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """CNV-05: the answer is in the caller's version, with the caller's uid."""
    assert answer["apiVersion"] == sent["apiVersion"]
    assert answer["kind"] == "ConversionReview"
    response: dict[str, Any] = answer["response"]
    assert response["uid"] == sent["request"]["uid"]
    return response


def failure_message(response: dict[str, Any], url: str) -> str:
    assert response["result"]["status"] == "Failure", response
    assert response["convertedObjects"] == []
    message: str = response["result"]["message"]
    prefix = f'conversion webhook "{CRD}" ({url}) failed: '
    assert message.startswith(prefix), message
    return message.removeprefix(prefix)


# --- CNV-01 / CNV-04: routing and malformed reviews -------------------------------------------------


@pytest.mark.parametrize(
    ("crd_name", "method", "body", "status", "reason"),
    [
        pytest.param(
            "nothing.example.com",
            "POST",
            None,
            404,
            "NotFound",
            id="CNV-01 an unknown CRD name is 404 with a Status",
        ),
        pytest.param(CRD, "GET", b"", 405, "MethodNotAllowed", id="CNV-01 only POST converts"),
        pytest.param(CRD, "POST", b"{not json", 400, "BadRequest", id="CNV-04 undecodable JSON is 400"),
        pytest.param(
            CRD,
            "POST",
            b'{"apiVersion":"admission.k8s.io/v1","kind":"ConversionReview","request":{}}',
            400,
            "BadRequest",
            id="CNV-04 a wrong apiVersion is 400",
        ),
        pytest.param(
            CRD,
            "POST",
            b'{"apiVersion":"apiextensions.k8s.io/v1","kind":"AdmissionReview"}',
            400,
            "BadRequest",
            id="CNV-04 a wrong kind is 400",
        ),
        pytest.param(
            CRD,
            "POST",
            b'{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview"}',
            400,
            "BadRequest",
            id="CNV-04 a review without request is 400",
        ),
        pytest.param(
            CRD,
            "POST",
            b'{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{"desiredAPIVersion":"a/v1","objects":[]}}',
            400,
            "BadRequest",
            id="CNV-04 a request without uid is 400",
        ),
        pytest.param(
            CRD,
            "POST",
            b'{"apiVersion":"apiextensions.k8s.io/v1beta1","kind":"ConversionReview","request":{"uid":"u","objects":[]}}',
            400,
            "BadRequest",
            id="CNV-04 a request without desiredAPIVersion is 400",
        ),
        pytest.param(
            CRD,
            "POST",
            b'{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{"uid":"u","desiredAPIVersion":"a/v1"}}',
            400,
            "BadRequest",
            id="CNV-04 a request without objects is 400",
        ),
        pytest.param(
            CRD,
            "POST",
            b'{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{"uid":"u","desiredAPIVersion":"a/v1","objects":[1]}}',
            400,
            "BadRequest",
            id="CNV-04 an object that is not an object is 400",
        ),
    ],
)
async def test_routing_and_malformed_reviews(nursery, tmp_path, crd_name, method, body, status, reason):
    setup = await start_conversion(nursery, tmp_path)
    doc = body if body is not None else conversion_review([crontab()])
    resp = await setup.send(doc, crd_name=crd_name, method=method)
    assert resp.status == status, resp.body
    assert resp.json["kind"] == "Status"
    assert resp.json["reason"] == reason
    assert resp.json["code"] == status
    assert setup.backend.calls == []


# --- CNV-05 / CNV-07 / CNV-08 / CNV-12: the successful exchange ------------------------------------------


@BOTH
@pytest.mark.parametrize("protocol", ["http1", "h2"], ids=["HTTP/1.1", "HTTP/2"])
async def test_success_answers_in_the_callers_version_with_the_backends_objects(
    nursery, tmp_path, caller, protocol
):
    """CNV-05, CNV-07, CNV-12: same count and order, fresh uid to the backend, objects as produced."""
    setup = await start_conversion(nursery, tmp_path, protocol=protocol)
    objects = [crontab("a"), crontab("b", cron="*/5 * * * *"), crontab("c", namespace="other")]
    sent = conversion_review(objects, version=caller)
    for _ in range(2):  # keep-alive: the second review reuses the connection
        resp = await setup.send(sent)
        response = check_envelope(sent, resp.json)
        assert response["result"] == {"status": "Success"}
        assert response["convertedObjects"] == [convert_object(o, V2) for o in objects]
    call = setup.backend.calls[0]
    backend_review = call.review
    assert backend_review["request"]["uid"] != sent["request"]["uid"]  # CNV-07: fresh uid
    assert backend_review["request"]["desiredAPIVersion"] == V2
    assert backend_review["request"]["objects"] == objects
    assert setup.backend.calls[1].review["request"]["uid"] != backend_review["request"]["uid"]


@pytest.mark.parametrize("protocol", ["http1", "h2"], ids=["HTTP/1.1 over TLS", "h2 over TLS (ALPN)"])
async def test_conversion_on_the_tls_listener(nursery, tmp_path, protocol):
    """/convert is served on the same TLS listener as admission, HTTP/1.1 and HTTP/2."""
    import ssl

    ca = trustme.CA()
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "tls.pem")
    client_ssl = ssl.create_default_context()
    ca.configure_trust(client_ssl)
    tls = ("--certfile", str(tmp_path / "tls.pem"), "--keyfile", str(tmp_path / "tls.pem"))
    setup = await start_conversion(
        nursery, tmp_path / "config", gateway_args=tls, protocol=protocol, client_ssl=client_ssl
    )
    assert setup.running.urls[0].startswith("https://")
    sent = conversion_review([crontab()])
    response = check_envelope(sent, (await setup.send(sent)).json)
    assert response["convertedObjects"] == [convert_object(crontab(), V2)]


@BOTH
async def test_objects_reach_the_backend_byte_for_byte_and_already_converted_ones_too(
    nursery, tmp_path, caller
):
    """CNV-07/08: the list is forwarded unchanged, objects in the desired version included."""
    setup = await start_conversion(nursery, tmp_path)
    raw_objects = [
        b'{"kind":"CronTab","apiVersion":"stable.example.com/v1" , "metadata":{"name":"x"}}',
        json.dumps(crontab("y", version="v2")).encode(),
    ]
    body = (
        b'{"apiVersion":"apiextensions.k8s.io/' + caller.encode() + b'","kind":"ConversionReview",'
        b'"request":{"uid":"u-1","desiredAPIVersion":"stable.example.com/v2","objects":['
        + b",".join(raw_objects)
        + b"]}}"
    )
    resp = await setup.send(body)
    assert resp.json["response"]["result"]["status"] == "Success"
    sent_body = setup.backend.calls[0].body
    for raw in raw_objects:
        assert raw in sent_body


@BOTH
async def test_a_review_without_objects_succeeds_without_a_call(nursery, tmp_path, caller):
    """CNV-07: no objects, no call, Success with an empty list."""
    sent, answer, setup = await convert(nursery, tmp_path, caller=caller, objects=[])
    response = check_envelope(sent, answer)
    assert response["result"] == {"status": "Success"}
    assert response["convertedObjects"] == []
    assert setup.backend.calls == []


# --- CNV-06: version negotiation ----------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize(
    ("behaviour", "review_versions", "spoken", "ok"),
    [
        pytest.param("", ["v1", "v1beta1"], "v1", True, id="CNV-06 the first entry is spoken"),
        pytest.param("", ["v1beta1", "v1"], "v1beta1", True, id="CNV-06 v1beta1 first is spoken"),
        pytest.param("", ["v2", "v1beta1"], "v1beta1", True, id="CNV-06 unknown entries are skipped"),
        pytest.param(
            "only-v1beta1", ["v1beta1"], "v1beta1", True, id="CNV-06 a v1beta1-only backend gets v1beta1"
        ),
        pytest.param(
            "only-v1beta1",
            ["v1", "v1beta1"],
            "v1",
            False,
            id="CNV-06 a v1beta1-only backend spoken to in v1 fails",
        ),
    ],
)
async def test_version_negotiation(nursery, tmp_path, caller, behaviour, review_versions, spoken, ok):
    sent, answer, setup = await convert(
        nursery, tmp_path, behaviour, caller=caller, review_versions=review_versions
    )
    response = check_envelope(sent, answer)
    assert setup.backend.calls[0].review["apiVersion"] == f"apiextensions.k8s.io/{spoken}"
    assert (response["result"]["status"] == "Success") is ok, response


def test_no_usable_version_is_a_call_failure():
    """CNV-06: files cannot carry such an entry (CNV-03), so negotiation is checked directly."""
    from gateway.config.model import ClientConfig, ConversionEntry
    from gateway.conversion.convert import negotiate

    entry = ConversionEntry(
        crd_name=CRD, client_config=ClientConfig(url="https://x"), conversion_review_versions=("v2",)
    )
    assert negotiate(entry) is None


# --- CNV-09 / CNV-10 / CNV-11 / CNV-13: verification and failures -----------------------------------------


VERIFY_TABLE = [
    pytest.param(
        "wrong-review-version",
        ["v1"],
        "expected webhook response of apiextensions.k8s.io/v1, Kind=ConversionReview, got apiextensions.k8s.io/v1beta1, Kind=ConversionReview",
        "conversion_webhook_malformed_response_failure",
        id="CNV-09 a v1 reply must be apiextensions.k8s.io/v1 ConversionReview",
    ),
    pytest.param(
        "no-response",
        ["v1"],
        "no response provided",
        "conversion_webhook_malformed_response_failure",
        id="CNV-09 v1 no response",
    ),
    pytest.param(
        "no-response",
        ["v1beta1"],
        "no response provided",
        "conversion_webhook_malformed_response_failure",
        id="CNV-09 v1beta1 no response",
    ),
    pytest.param(
        "wrong-uid",
        ["v1"],
        re.compile(r'^expected response\.uid="[0-9a-f-]{36}", got "[0-9a-f-]{36}-wrong"$'),
        "conversion_webhook_malformed_response_failure",
        id="CNV-09 v1 the uid must be echoed",
    ),
    pytest.param("wrong-uid", ["v1beta1"], None, "", id="CNV-09 v1beta1 does not check the uid"),
    pytest.param(
        "wrong-review-version", ["v1beta1"], None, "", id="CNV-09 v1beta1 does not check apiVersion and kind"
    ),
    pytest.param(
        "fail/cannot%20convert%20this",
        ["v1"],
        "cannot convert this",
        "conversion_webhook_malformed_response_failure",
        id="CNV-09 a Failure result's message is the reason",
    ),
    pytest.param(
        "failure-no-message",
        ["v1beta1"],
        "response.result.status was 'Failure', not 'Success'",
        "conversion_webhook_malformed_response_failure",
        id="CNV-09 a Failure without message names the status",
    ),
    pytest.param(
        "wrong-count",
        ["v1"],
        "returned 1 objects, expected 2",
        "conversion_webhook_partial_response_failure",
        id="CNV-10 a reply with fewer objects fails",
    ),
    pytest.param(
        "wrong-api-version",
        ["v1"],
        "returned invalid object at index 0: invalid groupVersion (expected stable.example.com/v2, received stable.example.com/v1)",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 objects must carry the desired apiVersion",
    ),
    pytest.param(
        "wrong-kind",
        ["v1"],
        "returned invalid object at index 0: invalid kind (expected CronTab, received Other)",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 objects keep their kind",
    ),
    pytest.param(
        "change-name",
        ["v1"],
        "returned invalid object at index 0: must have the same name: a != a-changed",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 objects keep their name",
    ),
    pytest.param(
        "change-namespace",
        ["v1"],
        "returned invalid object at index 0: must have the same namespace: ops != ops-changed",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 objects keep their namespace",
    ),
    pytest.param(
        "change-uid",
        ["v1beta1"],
        "returned invalid object at index 0: must have the same UID: uid-a != uid-a-changed",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 objects keep their uid",
    ),
    pytest.param(
        "missing-metadata",
        ["v1"],
        "returned invalid object at index 0: must have the same name: a != ",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 an object that lost its metadata fails the name check first, as upstream",
    ),
    pytest.param(
        "metadata-not-object",
        ["v1"],
        "returned invalid object at index 0: must have the same name: a != ",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 metadata that is not an object reads as empty in the name check, as upstream",
    ),
    pytest.param(
        "labels-not-map",
        ["v1"],
        "returned invalid metadata in object at index 0: "
        "invalid metadata.labels of type []interface {} in converted object",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 labels that are not a map: invalid metadata.labels of type <Go type>",
    ),
    pytest.param(
        "non-string-label",
        ["v1"],
        "returned invalid metadata in object at index 0: "
        "metadata.labels[converted] must be a string, but is int64 in converted object",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 a label value that is not a string: must be a string, but is <Go type>",
    ),
    pytest.param(
        "non-string-annotation",
        ["v1"],
        "returned invalid metadata in object at index 0: "
        "metadata.annotations[converted] must be a string, but is bool in converted object",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 an annotation value that is not a string: must be a string, but is <Go type>",
    ),
    pytest.param(
        "bad-labels",
        ["v1"],
        'returned invalid metadata in object at index 0: metadata.labels: Invalid value: "not a valid value!"',
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 changed labels must be valid",
    ),
    pytest.param(
        "not-object",
        ["v1"],
        "returned invalid converted object at index 0: not a JSON object",
        "conversion_webhook_invalid_converted_object_failure",
        id="CNV-11 converted objects must be JSON objects",
    ),
    pytest.param(
        "status/500",
        ["v1"],
        'an error on the server ("conversion backend error") has prevented the request from succeeding',
        "conversion_webhook_call_failure",
        id="CNV-13 an HTTP 500 is a call failure",
    ),
    pytest.param(
        "status/404",
        ["v1"],
        "the server could not find the requested resource",
        "conversion_webhook_call_failure",
        id="CNV-13 an HTTP 404 is a call failure",
    ),
    pytest.param(
        "empty-body",
        ["v1"],
        "empty response body",
        "conversion_webhook_call_failure",
        id="CNV-13 an empty body is a call failure",
    ),
]


@BOTH
@pytest.mark.parametrize(("behaviour", "review_versions", "reason", "failure_type"), VERIFY_TABLE)
async def test_verification_of_the_backends_reply(
    nursery, tmp_path, caller, behaviour, review_versions, reason, failure_type
):
    sent, answer, setup = await convert(
        nursery, tmp_path, behaviour, caller=caller, review_versions=review_versions
    )
    response = check_envelope(sent, answer)
    metrics = setup.metrics()
    if reason is None:
        assert response["result"]["status"] == "Success", response
        assert (
            'webhook_gateway_conversion_webhook_request_total{failure_type="",result="success"} 1.0'
            in metrics
        )
        return
    got = failure_message(response, setup.backend.url("/convert/" + behaviour))
    if isinstance(reason, re.Pattern):
        assert reason.match(got), got
    elif "Invalid value" in reason:  # the validation's own detail follows
        assert got.startswith(reason), got
    else:
        assert got == reason
    # CNV-15 / MET-10 / MET-11: the failure is classified
    assert (
        f'webhook_gateway_conversion_webhook_request_total{{failure_type="{failure_type}",result="failure"}} 1.0'
        in metrics
    )
    assert (
        f'webhook_gateway_crd_conversion_webhook_failures_total{{crd_name="{CRD}",failure_type="{failure_type}"}} 1.0'
        in metrics
    )


@BOTH
async def test_an_unreachable_backend_is_a_failure_naming_the_url(nursery, tmp_path, caller):
    """CNV-13: no failurePolicy; a refused connection answers Failure with the transport cause."""
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/convert"
    setup = await start_conversion(nursery, tmp_path, [crd(url=url)])
    sent = conversion_review([crontab()], version=caller)
    response = check_envelope(sent, (await setup.send(sent)).json)
    reason = failure_message(response, url)
    assert reason.startswith(f'Post "{url}?timeout=30s": ')
    assert "connection refused" in reason


# --- CNV-14: time -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("annotations", "timeout", "sent_timeout"),
    [
        pytest.param(None, None, "30s", id="CNV-14 default 30 s without an inbound timeout"),
        pytest.param(None, "30s", "30s", id="CNV-14 the caller's 30 s minus the margin rounds up to 30s"),
        pytest.param(
            {"webhook-gateway.io/conversion-timeout-seconds": "7"},
            "30s",
            "7s",
            id="CNV-14 the CRD annotation sets the timeout",
        ),
        pytest.param(None, "5s", "5s", id="CNV-14 the caller's timeout caps the CRD's"),
        pytest.param(
            {"webhook-gateway.io/conversion-timeout-seconds": "3"},
            "20s",
            "3s",
            id="CNV-14 the smaller of the two wins",
        ),
    ],
)
async def test_the_backend_gets_the_timeout_as_query(nursery, tmp_path, annotations, timeout, sent_timeout):
    _sent, answer, setup = await convert(nursery, tmp_path, annotations=annotations, timeout=timeout)
    assert answer["response"]["result"]["status"] == "Success"
    assert setup.backend.calls[0].path.endswith(f"?timeout={sent_timeout}")


@BOTH
@pytest.mark.parametrize(
    ("annotations", "timeout"),
    [
        pytest.param(
            {"webhook-gateway.io/conversion-timeout-seconds": "1"},
            "30s",
            id="CNV-14 the CRD's timeout ends a slow call",
        ),
        pytest.param(None, "1s", id="CNV-14 the caller's timeout minus the margin ends a slow call"),
    ],
)
async def test_a_slow_backend_times_out(nursery, tmp_path, caller, annotations, timeout):
    started = trio.current_time()
    sent, answer, setup = await convert(
        nursery, tmp_path, "sleep/5000", caller=caller, annotations=annotations, timeout=timeout
    )
    assert trio.current_time() - started < 4.5
    reason = failure_message(check_envelope(sent, answer), setup.backend.url("/convert/sleep/5000"))
    assert reason.startswith('Post "' + setup.backend.url("/convert/sleep/5000") + "?timeout=")
    assert reason.endswith("context deadline exceeded")
    metrics = setup.metrics()
    assert f'webhook_gateway_crd_conversion_webhook_timeouts_total{{crd_name="{CRD}"}} 1.0' in metrics


async def test_a_caller_that_goes_away_cancels_the_backend_call(nursery, tmp_path):
    """Like reviews: a disconnect cancels the conversion; it is counted as 499, not as a failure."""
    setup = await start_conversion(nursery, tmp_path, [crd(url="__backend__/convert/sleep/20000")])

    async def send_and_vanish() -> None:
        with contextlib.suppress(Exception):
            await setup.send(conversion_review([crontab()]))

    nursery.start_soon(send_and_vanish)
    with trio.fail_after(10):
        while not setup.backend.calls:
            await trio.sleep(0.02)
        await setup.client.stream.aclose()
        while (
            'webhook_gateway_inbound_requests_total{code="499",endpoint="conversion"} 1.0'
            not in setup.metrics()
        ):
            await trio.sleep(0.05)
    assert "crd_conversion_webhook_failures_total{" not in setup.metrics()
    assert setup.running.app.in_flight == 0


# --- CNV-15: transport shared with admission backends ---------------------------------------------------


@BOTH
@pytest.mark.parametrize(
    ("trusted", "ok"),
    [
        pytest.param(True, True, id="CNV-15 TLS verified against the CRD's caBundle"),
        pytest.param(False, False, id="CNV-15 a caBundle of another CA fails the TLS handshake"),
    ],
)
async def test_tls_with_ca_bundle(nursery, tmp_path, caller, trusted, ok):
    ca, other = trustme.CA(), trustme.CA()
    bundle = (ca if trusted else other).cert_pem.bytes()
    setup = await start_conversion(
        nursery,
        tmp_path,
        [crd(url="__backend__/convert", ca_bundle=bundle)],
        backend_tls=server_context(ca, "127.0.0.1"),
    )
    sent = conversion_review([crontab()], version=caller)
    response = check_envelope(sent, (await setup.send(sent)).json)
    if ok:
        assert response["result"]["status"] == "Success"
        assert response["convertedObjects"] == [convert_object(crontab(), V2)]
        assert setup.backend.calls[0].http_version == "2"  # loopback may speak HTTP/2 (TRN-08)
    else:
        assert "certificate" in failure_message(response, setup.backend.url("/convert"))


async def test_the_backends_tls_context_is_built_once_not_per_call(nursery, tmp_path, monkeypatch):
    """CNV-15: conversion calls go through the admission backends' caller and its resolved targets:
    the TLS context of a CRD's caBundle is built with the configuration, not again on every call."""
    import gateway.transport.resolve as resolve

    built: list[bytes] = []
    real = resolve.client_ssl_context

    def counting(ca_bundle: bytes, *args: Any, **kwargs: Any) -> Any:
        built.append(ca_bundle)
        return real(ca_bundle, *args, **kwargs)

    monkeypatch.setattr(resolve, "client_ssl_context", counting)
    ca = trustme.CA()
    setup = await start_conversion(
        nursery,
        tmp_path,
        [crd(url="__backend__/convert", ca_bundle=ca.cert_pem.bytes())],
        backend_tls=server_context(ca, "127.0.0.1"),
    )
    for _ in range(5):
        sent = conversion_review([crontab()])
        assert check_envelope(sent, (await setup.send(sent)).json)["result"]["status"] == "Success"
    assert built == [ca.cert_pem.bytes()]


async def test_per_host_credentials_apply_and_rotate(nursery, tmp_path):
    """CNV-15 / TRN-10/11: conversion calls carry the admission backends' per-host credentials."""
    import yaml

    kubeconfig = tmp_path / "backends.kubeconfig"

    def write_token(token: str) -> None:
        users = [{"name": "*", "user": {"token": token}}]
        kubeconfig.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "users": users}))

    write_token("first")
    args = ("--backend-kubeconfig", str(kubeconfig), "--config-poll-seconds", "0.05")
    setup = await start_conversion(nursery, tmp_path / "config", gateway_args=args)
    await setup.send(conversion_review([crontab()]))
    assert setup.backend.calls[-1].header("authorization") == "Bearer first"
    write_token("second")
    with trio.fail_after(5):
        while setup.backend.calls[-1].header("authorization") != "Bearer second":
            await trio.sleep(0.05)
            await setup.send(conversion_review([crontab()]))


async def test_trace_context_is_forwarded(nursery, tmp_path):
    """The backend call carries a child of the caller's traceparent."""
    setup = await start_conversion(nursery, tmp_path)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    setup.client.extra_headers = [("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")]
    await setup.send(conversion_review([crontab()]))
    _, got_trace, span, flags = (setup.backend.calls[0].header("traceparent") or "").split("-")
    assert (got_trace, flags) == (trace_id, "01")
    assert span != "00f067aa0ba902b7"


# --- MET-10 / MET-11 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("desired", "objects", "observed"),
    [
        pytest.param(V2, [crontab("a")], True, id="MET-10 a conversion between versions is observed per CRD"),
        pytest.param(
            "stable.example.com/v1",
            [crontab("a")],
            False,
            id="MET-10 no per-CRD observation when from equals to",
        ),
    ],
)
async def test_conversion_metrics(nursery, tmp_path, desired, objects, observed):
    _sent, answer, setup = await convert(nursery, tmp_path, objects=objects, desired=desired)
    assert answer["response"]["result"]["status"] == "Success"
    metrics = setup.metrics()
    assert 'webhook_gateway_conversion_webhook_request_total{failure_type="",result="success"} 1.0' in metrics
    assert (
        'webhook_gateway_conversion_webhook_duration_seconds_bucket{failure_type="",le="60",result="success"} 1.0'
        in metrics
    )
    assert 'webhook_gateway_inbound_requests_total{code="200",endpoint="conversion"} 1.0' in metrics
    assert 'webhook_gateway_backends{kind="conversion"} 1.0' in metrics  # the CRD's entry is loaded
    per_crd = f'webhook_gateway_crd_conversion_webhook_duration_seconds_count{{crd_name="{CRD}",from_version="v1",succeeded="true",to_version="v2"}} 1.0'
    assert (per_crd in metrics) is observed
    assert 'le="16.384"' in metrics or not observed


# --- the canonical log line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("behaviour", "result", "failure_type", "level"),
    [
        pytest.param("", "success", "", "info", id="one info line per successful conversion"),
        pytest.param(
            "wrong-kind",
            "failure",
            "conversion_webhook_invalid_converted_object_failure",
            "warning",
            id="one warning line per failed conversion, with its failure type",
        ),
    ],
)
async def test_one_canonical_line_per_conversion(nursery, tmp_path, behaviour, result, failure_type, level):
    from structlog.testing import capture_logs

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with capture_logs() as logs:
        path = "/convert" + (f"/{behaviour}" if behaviour else "")
        setup = await start_conversion(nursery, tmp_path, [crd(url="__backend__" + path)])
        setup.client.extra_headers = [("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")]
        sent = conversion_review([crontab("a"), crontab("b")])
        await setup.send(sent)
    (line,) = [entry for entry in logs if entry["event"] == "conversion"]
    assert line["log_level"] == level
    assert line["crd"] == CRD
    assert line["uid"] == sent["request"]["uid"]
    assert (line["from_version"], line["to_version"], line["objects"]) == ("v1", "v2", 2)
    assert line["backend"] == setup.backend.url(path)
    assert (line["result"], line["failure_type"]) == (result, failure_type)
    assert line["duration_ms"] >= line["backend_ms"] > 0
    assert line["trace_id"] == trace_id
    assert ("reason" in line) is (result == "failure")
