"""The sample backend webhook server (gateway.devtools.backends): every behaviour over HTTP/1.1 and
HTTP/2, plaintext and TLS, through a tiny real client on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import h2.config
import h2.connection
import h2.events
import jsonpatch
import pytest
import trio
import trustme

from gateway.devtools.backends import (
    HUGE_DEFAULT_BYTES,
    BackendServer,
    Delay,
    Plan,
    PlanError,
    parse_plan,
    serve_backend,
)
from tests.support.client import Client, Resp

# ------------------------------------------------------------------------------------------------
# A tiny client: one connection, h11 or h2, optional TLS


@dataclass
class Transport:
    protocol: str  # "http1" or "h2"
    tls: bool


TRANSPORTS = [
    pytest.param(Transport("http1", False), id="HTTP/1.1 plaintext"),
    pytest.param(Transport("h2", False), id="h2c prior knowledge"),
    pytest.param(Transport("http1", True), id="HTTP/1.1 over TLS"),
    pytest.param(Transport("h2", True), id="h2 over TLS (ALPN)"),
]


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(ctx)
    return ctx


async def connect(server: BackendServer, transport: Transport, ca: trustme.CA) -> Client:
    tcp = await trio.open_tcp_stream(server.host, server.port)
    stream: trio.abc.Stream = tcp
    if transport.tls:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        ctx.set_alpn_protocols(["h2"] if transport.protocol == "h2" else ["http/1.1"])
        tls = trio.SSLStream(tcp, ctx, server_hostname="127.0.0.1")
        await tls.do_handshake()
        assert tls.selected_alpn_protocol() == ("h2" if transport.protocol == "h2" else "http/1.1")
        stream = tls
    return Client(stream, transport.protocol, f"127.0.0.1:{server.port}")


@pytest.fixture
async def backend(request: pytest.FixtureRequest, nursery: trio.Nursery, ca: trustme.CA) -> BackendServer:
    transport: Transport = request.getfixturevalue("transport")
    ctx = server_context(ca) if transport.tls else None
    server: BackendServer = await nursery.start(
        lambda task_status: serve_backend(ssl_context=ctx, task_status=task_status)
    )
    return server


@pytest.fixture
async def client(backend: BackendServer, transport: Transport, ca: trustme.CA) -> AsyncIterator[Client]:
    c = await connect(backend, transport, ca)
    yield c
    await c.stream.aclose()


# ------------------------------------------------------------------------------------------------
# Reviews


def pod(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "web-1", "namespace": "shop"}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "c", "image": "nginx"}]},
    }


def review(version: str = "v1", obj: dict[str, Any] | None = None, uid: str = "uid-1") -> dict[str, Any]:
    return {
        "apiVersion": f"admission.k8s.io/{version}",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "web-1",
            "namespace": "shop",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": obj if obj is not None else pod({"app": "web"}),
            "oldObject": None,
            "dryRun": False,
        },
    }


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def patched(resp: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    assert resp["response"]["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(resp["response"]["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(obj, ops)
    return result


# ------------------------------------------------------------------------------------------------
# Behaviours (each row runs over all four transports)

Check = Callable[[Resp, dict[str, Any]], None]


def allowed(resp: Resp, sent: dict[str, Any]) -> None:
    r = resp.json
    assert resp.status == 200
    assert r["apiVersion"] == sent["apiVersion"]
    assert r["kind"] == "AdmissionReview"
    assert r["response"] == {"uid": sent["request"]["uid"], "allowed": True}


def denied(code: int, message: str) -> Check:
    def check(resp: Resp, sent: dict[str, Any]) -> None:
        r = resp.json["response"]
        assert r["uid"] == sent["request"]["uid"]
        assert r["allowed"] is False
        assert r["status"]["code"] == code
        assert r["status"]["message"] == message

    return check


def denied_without_message(resp: Resp, sent: dict[str, Any]) -> None:
    assert resp.json["response"] == {"uid": sent["request"]["uid"], "allowed": False}


def labels_after_patch(expected: dict[str, str]) -> Check:
    def check(resp: Resp, sent: dict[str, Any]) -> None:
        r = resp.json
        assert r["response"]["allowed"] is True
        assert patched(r, sent["request"]["object"])["metadata"]["labels"] == expected

    return check


def annotations_after_patch(expected: dict[str, str]) -> Check:
    def check(resp: Resp, sent: dict[str, Any]) -> None:
        assert patched(resp.json, sent["request"]["object"])["metadata"]["annotations"] == expected

    return check


def invalid_patch(resp: Resp, sent: dict[str, Any]) -> None:
    with pytest.raises(jsonpatch.JsonPatchException):
        patched(resp.json, sent["request"]["object"])


def undecodable_patch(resp: Resp, sent: dict[str, Any]) -> None:
    assert resp.json["response"]["patchType"] == "JSONPatch"
    assert not isinstance(json.loads(base64.b64decode(resp.json["response"]["patch"])), list)


def wrong_uid(resp: Resp, sent: dict[str, Any]) -> None:
    assert resp.json["response"]["uid"] != sent["request"]["uid"]
    assert resp.json["apiVersion"] == sent["apiVersion"]


def wrong_api_version(resp: Resp, sent: dict[str, Any]) -> None:
    assert resp.json["apiVersion"] != sent["apiVersion"]
    assert resp.json["apiVersion"].startswith("admission.k8s.io/v1")
    assert resp.json["response"]["uid"] == sent["request"]["uid"]


def no_response(resp: Resp, sent: dict[str, Any]) -> None:
    assert resp.status == 200
    assert resp.json == {"apiVersion": sent["apiVersion"], "kind": "AdmissionReview"}


def empty_body(resp: Resp, sent: dict[str, Any]) -> None:
    assert (resp.status, resp.body) == (200, b"")


def plain_status(code: int, text: str) -> Check:
    def check(resp: Resp, sent: dict[str, Any]) -> None:
        assert resp.status == code
        assert resp.headers["content-type"].startswith("text/plain")
        assert resp.body.decode().strip() == text

    return check


def redirected(location: str) -> Check:
    def check(resp: Resp, sent: dict[str, Any]) -> None:
        assert (resp.status, resp.headers["location"]) == (307, location)

    return check


def huge(resp: Resp, sent: dict[str, Any]) -> None:
    assert resp.status == 200
    assert len(resp.body) == HUGE_DEFAULT_BYTES
    assert json.loads(resp.body)["response"]["allowed"] is True


def echoed(resp: Resp, sent: dict[str, Any]) -> None:
    r = resp.json["response"]
    assert r["allowed"] is True
    assert json.loads(r["auditAnnotations"]["echo"]) == sent


def warned_and_annotated(resp: Resp, sent: dict[str, Any]) -> None:
    r = resp.json["response"]
    assert r["warnings"] == ["tag latest is discouraged", "second"]
    assert r["auditAnnotations"] == {"violation": "registry", "team": "a/b"}
    assert r["allowed"] is False
    assert r["status"]["message"] == "nope"


def closed(resp: Resp | None, sent: dict[str, Any]) -> None:
    assert resp is None


BEHAVIOURS = [
    pytest.param("/allow", "v1", allowed, id="REV-10: /allow answers allowed true with the request's uid"),
    pytest.param("/", "v1", allowed, id="REV-10: the empty path means allow"),
    pytest.param("/allow?timeout=10s", "v1", allowed, id="TRN-04: the timeout query is ignored"),
    pytest.param("/allow", "v1beta1", allowed, id="REV-02: a v1beta1 review gets a v1beta1 reply"),
    pytest.param(
        "/deny", "v1", denied(403, "denied by test backend"), id="REV-10: /deny gives 403 with a message"
    ),
    pytest.param(
        "/deny/403/image%20registry%20not%20allowed",
        "v1",
        denied(403, "image registry not allowed"),
        id="ERR-05: /deny/<code>/<message> carries the code and the message",
    ),
    pytest.param(
        "/deny/422/a/b", "v1beta1", denied(422, "a/b"), id="ERR-05: remaining segments form the message"
    ),
    pytest.param(
        "/deny-no-message", "v1", denied_without_message, id="REV-10: /deny-no-message has no status"
    ),
    pytest.param(
        "/patch/checked",
        "v1",
        labels_after_patch({"app": "web", "checked": "true"}),
        id="MUT-02: /patch/<name> adds a label",
    ),
    pytest.param(
        "/patch/a/patch/example.com%2Fb",
        "v1",
        labels_after_patch({"app": "web", "a": "true", "example.com/b": "true"}),
        id="MUT-02: patches compose and escape '/' in the JSON pointer",
    ),
    pytest.param(
        "/patch-annotation/owner/team-a",
        "v1",
        annotations_after_patch({"owner": "team-a"}),
        id="MUT-02: /patch-annotation creates the annotations map when absent",
    ),
    pytest.param(
        "/jsonpatch/" + quote('[{"op":"add","path":"/spec/hostNetwork","value":false}]', safe="") + "/allow",
        "v1",
        lambda resp, sent: (
            patched(resp.json, sent["request"]["object"])["spec"]["hostNetwork"] is False
            or pytest.fail("jsonpatch not applied")
        ),
        id="MUT-02: /jsonpatch/<ops> sends the given operations",
    ),
    pytest.param(
        "/invalid-patch", "v1", invalid_patch, id="MUT-06: /invalid-patch sends a patch that cannot apply"
    ),
    pytest.param(
        "/undecodable-patch",
        "v1",
        undecodable_patch,
        id="ERR-03: /undecodable-patch sends a patch that is not an array",
    ),
    pytest.param("/wrong-uid", "v1", wrong_uid, id="REV-12: /wrong-uid answers another uid"),
    pytest.param(
        "/wrong-api-version", "v1", wrong_api_version, id="REV-12: /wrong-api-version answers v1beta1 to v1"
    ),
    pytest.param(
        "/wrong-api-version",
        "v1beta1",
        wrong_api_version,
        id="REV-14: /wrong-api-version answers v1 to v1beta1",
    ),
    pytest.param("/no-response", "v1", no_response, id="REV-12: /no-response omits the response member"),
    pytest.param("/empty-body", "v1", empty_body, id="REV-08: /empty-body answers 200 with no body"),
    pytest.param(
        "/status/500/boom",
        "v1",
        plain_status(500, "boom"),
        id="REV-09: /status/<code>/<text> is a plain HTTP error",
    ),
    pytest.param(
        "/status/503",
        "v1",
        plain_status(503, "status 503 from test backend"),
        id="REV-09: /status/<code> has a default text",
    ),
    pytest.param(
        "/sleep/20/deny",
        "v1",
        denied(403, "denied by test backend"),
        id="FPT-06: /sleep/<ms>/deny then denies",
    ),
    pytest.param("/latency/uniform/1/5/allow", "v1", allowed, id="FPT-06: uniform latency then allow"),
    pytest.param("/latency/lognormal/2/0.5", "v1", allowed, id="FPT-06: lognormal latency then allow"),
    pytest.param(
        "/errors/1/allow",
        "v1",
        plain_status(500, "injected backend error"),
        id="FPT-01: errors/1 always fails",
    ),
    pytest.param("/errors/0/allow", "v1", allowed, id="FPT-01: errors/0 never fails"),
    pytest.param(
        "/only-v1beta1",
        "v1",
        plain_status(400, "this backend only accepts admission.k8s.io/v1beta1, got 'admission.k8s.io/v1'"),
        id="REV-03: /only-v1beta1 refuses a v1 review with 400",
    ),
    pytest.param("/only-v1beta1", "v1beta1", allowed, id="REV-03: /only-v1beta1 answers a v1beta1 review"),
    pytest.param(
        "/warn/tag%20latest%20is%20discouraged/warn/second/annotate/violation/registry/annotate/team/a%2Fb/deny/nope",
        "v1",
        warned_and_annotated,
        id="AUD-01: warnings and audit annotations ride along with a denial",
    ),
    pytest.param("/redirect", "v1", redirected("/allow"), id="REV-09: /redirect answers 307 to /allow"),
    pytest.param(
        "/redirect/deny/x", "v1", redirected("/deny/x"), id="REV-09: /redirect/<path> answers 307 to it"
    ),
    pytest.param("/huge", "v1", huge, id="TRN-12: /huge answers a body over 16 MiB"),
    pytest.param("/echo", "v1", echoed, id="REV-06: /echo returns the received review in auditAnnotations"),
    pytest.param("/close", "v1", closed, id="TRN: /close drops the connection without answering"),
    pytest.param(
        "/no-such-step",
        "v1",
        plain_status(404, "unknown behaviour step 'no-such-step'"),
        id="unknown steps get 404",
    ),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("path", "version", "check"), BEHAVIOURS)
async def test_behaviour(
    client: Client, backend: BackendServer, path: str, version: str, check: Check
) -> None:
    """Each path answers its documented behaviour, the same over every protocol and with or without TLS."""
    sent = review(version)
    resp = await client.post(path, encode(sent))
    check(resp, sent)  # type: ignore[arg-type]
    assert len(backend.calls) == 1
    assert backend.calls[0].path == path
    assert backend.calls[0].review == sent


PATCH_TARGETS = [
    pytest.param(pod(None), {"checked": "true"}, id="MUT-02: absent labels are created as a map"),
    pytest.param(pod({}), {"checked": "true"}, id="MUT-02: an empty labels map gets the label added"),
    pytest.param(
        {"apiVersion": "v1", "kind": "Pod"},
        {"checked": "true"},
        id="MUT-02: absent metadata is created first",
    ),
]


@pytest.mark.parametrize("transport", [TRANSPORTS[0]])
@pytest.mark.parametrize(("obj", "expected"), PATCH_TARGETS)
async def test_label_patch_applies_whatever_the_object_has(
    client: Client, obj: dict[str, Any], expected: dict[str, str]
) -> None:
    """The label patch is built against the received object so that it always applies."""
    sent = review(obj=obj)
    resp = await client.post("/patch/checked", encode(sent))
    assert resp is not None
    assert patched(resp.json, obj)["metadata"]["labels"] == expected


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_keep_alive_and_call_log(client: Client, backend: BackendServer, transport: Transport) -> None:
    """Several reviews share one connection, and the call log records path, headers, body and protocol."""
    for k in range(5):
        sent = review(uid=f"uid-{k}")
        resp = await client.post(f"/allow?timeout={k}s", encode(sent))
        assert resp is not None
        assert resp.json["response"]["uid"] == f"uid-{k}"
    assert backend.connections == 1
    assert backend.requests == 5
    assert [c.path for c in backend.calls] == [f"/allow?timeout={k}s" for k in range(5)]
    assert [c.review["request"]["uid"] for c in backend.calls] == [f"uid-{k}" for k in range(5)]
    assert {c.http_version for c in backend.calls} == {"1.1" if transport.protocol == "http1" else "2"}
    assert backend.calls[0].header("Content-Type") == "application/json"
    assert backend.url("/x") == f"{'https' if transport.tls else 'http'}://127.0.0.1:{backend.port}/x"


@pytest.mark.parametrize("transport", [TRANSPORTS[1], TRANSPORTS[3]])
async def test_h2_streams_are_concurrent(client: Client, backend: BackendServer) -> None:
    """Over HTTP/2 a slow stream does not hold back a fast one sent after it on the same connection."""
    conn = client.h2
    conn.initiate_connection()
    body = encode(review())
    for path in ("/sleep/300/allow", "/deny"):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"x"), (b":path", path.encode())],
        )
        conn.send_data(sid, body, end_stream=True)
    await client.stream.send_all(conn.data_to_send())
    finished: list[int] = []
    with trio.fail_after(10):
        while len(finished) < 2:
            for ev in conn.receive_data(await client.stream.receive_some(65536)):
                if isinstance(ev, h2.events.StreamEnded):
                    finished.append(ev.stream_id)
    assert finished == [3, 1]
    assert backend.connections == 1


@pytest.mark.parametrize("transport", [TRANSPORTS[0]])
@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        pytest.param("GET", "/allow", 405, id="non-POST methods get 405"),
        pytest.param("GET", "/healthz", 200, id="GET /healthz answers 200 for readiness probes"),
        pytest.param("POST", "/sleep/notanumber", 404, id="a malformed step argument gets 404"),
    ],
)
async def test_non_review_requests(client: Client, method: str, path: str, status: int) -> None:
    """Requests that are not reviews get plain HTTP answers."""
    resp = await client.post(path, b"", method=method)
    assert resp is not None
    assert resp.status == status


@pytest.mark.parametrize("transport", [TRANSPORTS[0]])
async def test_undecodable_review_gets_400(client: Client) -> None:
    """A body that is not an AdmissionReview is answered with 400, not a crash."""
    resp = await client.post("/allow", b"{not json")
    assert resp is not None
    assert resp.status == 400
    resp = await client.post("/allow", b'{"kind":"AdmissionReview"}')
    assert resp is not None
    assert (resp.status, resp.body) == (400, b"AdmissionReview has no request\n")


BAD_CLIENTS = [
    pytest.param(b"GARBAGE\r\n\r\n", id="garbage instead of an HTTP request"),
    pytest.param(b"POST /allow HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc", id="a truncated body"),
    pytest.param(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x04\xff\xff\xff\xff", id="a broken HTTP/2 frame"),
    pytest.param(b"\x16\x03\x01\x00\x05hello", id="a TLS hello to a plaintext server"),
    pytest.param(b"", id="connect and leave"),
]


@pytest.mark.parametrize("transport", [TRANSPORTS[0]])
@pytest.mark.parametrize("junk", BAD_CLIENTS)
async def test_bad_clients_do_not_stop_the_server(
    backend: BackendServer, transport: Transport, junk: bytes, ca: trustme.CA
) -> None:
    """A misbehaving client ends only its own connection; the next client is served."""
    tcp = await trio.open_tcp_stream(backend.host, backend.port)
    if junk:
        await tcp.send_all(junk)
    await tcp.aclose()
    c = await connect(backend, transport, ca)
    resp = await c.post("/allow", encode(review()))
    assert resp is not None
    assert resp.status == 200
    await c.stream.aclose()


PLANS = [
    pytest.param("/", Plan(), id="the empty path is allow"),
    pytest.param(
        "/sleep/5/latency/uniform/1/2/deny",
        Plan(terminal="deny", args=("403", ""), delays=(Delay("fixed", 5), Delay("uniform", 1, 2))),
        id="delays accumulate in order",
    ),
    pytest.param(
        "/errors/0.25/patch/a", Plan(error_rate=0.25, labels=("a",)), id="error rate and label patch"
    ),
    pytest.param("/huge/100", Plan(terminal="huge", args=("100",)), id="huge takes an optional size"),
]


@pytest.mark.parametrize(("path", "plan"), PLANS)
def test_parse_plan(path: str, plan: Plan) -> None:
    """Paths parse into the documented plans."""
    assert parse_plan(path) == plan


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/allow/extra", id="segments after a terminal are refused"),
        pytest.param("/latency/pareto/1", id="unknown distributions are refused"),
        pytest.param("/sleep", id="a missing argument is refused"),
        pytest.param("/status/99", id="a status outside 100-599 is refused"),
        pytest.param("/jsonpatch/%7B%7D", id="a jsonpatch that is not an array is refused"),
    ],
)
def test_parse_plan_refuses(path: str) -> None:
    """Malformed paths raise PlanError (answered with 404)."""
    with pytest.raises(PlanError):
        parse_plan(path)


@pytest.mark.slow
def test_cli_serves_several_ports(tmp_path: Any) -> None:
    """``python -m gateway.devtools.backends --count 2`` prints its ports and answers reviews on each."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.devtools.backends", "--count", "2"],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert info["scheme"] == "http"
        assert len(set(info["ports"])) == 2

        async def check() -> None:
            for port in info["ports"]:
                server = BackendServer(host="127.0.0.1", port=port, tls=False)
                c = await connect(server, Transport("http1", False), trustme.CA())
                resp = await c.post("/deny/x", encode(review()))
                assert resp is not None
                assert resp.json["response"]["status"]["message"] == "x"
                await c.stream.aclose()

        trio.run(check)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    ("http1_only", "selected"),
    [
        pytest.param(False, "h2", id="TRN-08: a TLS backend offers h2 first, as loopback backends may"),
        pytest.param(True, "http/1.1", id="TRN-08: --http1-only offers http/1.1 only, like Service backends"),
    ],
)
async def test_alpn_offer(nursery: trio.Nursery, ca: trustme.CA, http1_only: bool, selected: str) -> None:
    """A client offering h2 and http/1.1 gets what the backend's ALPN setting allows."""
    ctx = server_context(ca)
    server: BackendServer = await nursery.start(
        lambda task_status: serve_backend(ssl_context=ctx, http1_only=http1_only, task_status=task_status)
    )
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    client_ctx.set_alpn_protocols(["h2", "http/1.1"])
    tls = trio.SSLStream(
        await trio.open_tcp_stream(server.host, server.port), client_ctx, server_hostname="127.0.0.1"
    )
    await tls.do_handshake()
    assert tls.selected_alpn_protocol() == selected
    await tls.aclose()


@pytest.mark.parametrize(
    ("strict", "answered"),
    [
        pytest.param(
            True,
            False,
            id="HTTP/2 header rules are enforced by default: the gateway's framer is checked by h2",
        ),
        pytest.param(
            False, True, id="--lenient-http2 skips h2's header checks (load tests: a cheap stand-in backend)"
        ),
    ],
)
async def test_http2_header_checks(nursery: trio.Nursery, strict: bool, answered: bool) -> None:
    """A request header h2 forbids (an upper-case name) ends a strict backend's connection; a lenient
    backend answers it. Load tests run the lenient one: its CPU shares the machine with the gateway's."""
    server: BackendServer = await nursery.start(
        lambda task_status: serve_backend(strict_http2=strict, task_status=task_status)
    )
    stream = await trio.open_tcp_stream(server.host, server.port)
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
    )
    conn.initiate_connection()
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"x"), (b":path", b"/allow")]
    conn.send_headers(1, [*headers, (b"X-Upper", b"1")])
    conn.send_data(1, encode(review()), end_stream=True)
    await stream.send_all(conn.data_to_send())
    statuses: list[bytes] = []
    ended = False
    with trio.fail_after(10):
        while not ended:
            data = await stream.receive_some(65536)
            if not data:
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    statuses += [v for k, v in ev.headers if k == b":status"]
                ended = ended or isinstance(ev, h2.events.StreamEnded | h2.events.ConnectionTerminated)
    assert (statuses == [b"200"]) is answered
    await stream.aclose()
