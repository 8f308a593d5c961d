"""The gateway's HTTP surface over real sockets: bad input, methods, limits, health, protocols, TLS."""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import pytest
import trio
import trustme

from gateway.devtools.backends import serve_backend
from gateway.server.serve import Running
from tests.support.client import connect
from tests.support.gateway import (
    backend,
    gateway_client,
    port_of,
    review,
    start_gateway,
    write_config,
)


async def _gateway(nursery: trio.Nursery, tmp_path: Path, *args: str, hooks: Any = None) -> Running:
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    base = f"http://127.0.0.1:{server.port}"
    hooks = hooks or [backend("ok.example.com", "/allow")]
    for h in hooks:
        h["clientConfig"]["url"] = h["clientConfig"]["url"].replace("__backend__", base)
    write_config(tmp_path / "config", validating={"a": hooks}, mutating={"m": hooks})
    return await start_gateway(nursery, tmp_path / "config", *args)


BAD_REVIEWS: list[Any] = [
    pytest.param(b"{not json", "REV-01: a body that is not JSON is a 400", id="REV-01: malformed JSON"),
    pytest.param(b"[]", "", id="REV-01: a JSON array instead of an object"),
    pytest.param(
        json.dumps({**review(), "kind": "ConversionReview"}).encode(), "kind", id="REV-01: wrong kind"
    ),
    pytest.param(
        json.dumps({**review(), "apiVersion": "admission.k8s.io/v2"}).encode(),
        "apiVersion",
        id="REV-01: unknown apiVersion",
    ),
    pytest.param(
        json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(),
        "request",
        id="REV-01: missing request",
    ),
    pytest.param(
        json.dumps({**review(), "request": {**review()["request"], "uid": ""}}).encode(),
        "uid",
        id="REV-01: empty uid",
    ),
    pytest.param(
        json.dumps({**review(), "request": {**review()["request"], "operation": "PATCH"}}).encode(),
        "operation",
        id="REV-01: unknown operation",
    ),
]


@pytest.mark.parametrize(("body", "mentions"), BAD_REVIEWS)
@pytest.mark.parametrize("endpoint", ["validate", "mutate"])
async def test_malformed_reviews_get_400(
    nursery: trio.Nursery, tmp_path: Path, body: bytes, mentions: str, endpoint: str
) -> None:
    """REV-01: malformed input gets HTTP 400 with a Status saying what is wrong; the gateway keeps serving."""
    running = await _gateway(nursery, tmp_path)
    client = await gateway_client(running)
    resp = await client.post(f"/{endpoint}", body)
    assert resp is not None
    assert resp.status == 400
    status = resp.json
    assert (status["kind"], status["status"], status["reason"], status["code"]) == (
        "Status",
        "Failure",
        "BadRequest",
        400,
    )
    assert status["message"]
    if mentions and not mentions.startswith("REV"):
        assert mentions in status["message"]
    ok = await client.post(f"/{endpoint}", json.dumps(review()).encode())
    assert ok is not None and ok.status == 200


async def test_methods_paths_and_health(nursery: trio.Nursery, tmp_path: Path) -> None:
    """REV-16: 405 for other methods, 404 for unknown paths; /healthz and /readyz answer 200 when ready."""
    running = await _gateway(nursery, tmp_path)
    client = await gateway_client(running)
    got = await client.post("/validate", b"", method="GET")
    assert got is not None and got.status == 405 and got.json["reason"] == "MethodNotAllowed"
    got = await client.post("/nope", b"", method="GET")
    assert got is not None and got.status == 404
    for path in ("/healthz", "/readyz"):
        got = await client.post(path, b"", method="GET")
        assert got is not None and got.status == 200, path


async def test_oversize_body_gets_413(nursery: trio.Nursery, tmp_path: Path) -> None:
    """TRN-13: a body over --max-request-bytes gets 413 with a Status body, and the gateway keeps serving."""
    running = await _gateway(nursery, tmp_path, "--max-request-bytes", "20000")
    client = await gateway_client(running)
    big = review()
    big["request"]["object"]["metadata"]["annotations"] = {"blob": "x" * 30000}
    got = await client.post("/validate", json.dumps(big).encode())
    assert got is not None and got.status == 413
    assert got.json["code"] == 413
    client = await gateway_client(running)
    ok = await client.post("/validate", json.dumps(review()).encode())
    assert ok is not None and ok.status == 200


@pytest.mark.parametrize("protocol", ["http1", "h2"], ids=["HTTP/1.1 keep-alive", "h2c prior knowledge"])
async def test_keep_alive_and_h2c(nursery: trio.Nursery, tmp_path: Path, protocol: str) -> None:
    """REV-02: many reviews on one connection, each answered with its own uid, in either protocol."""
    running = await _gateway(nursery, tmp_path)
    client = await gateway_client(running, protocol=protocol)
    for i in range(20):
        doc = review(uid=f"uid-{i}", version="v1" if i % 2 else "v1beta1")
        got = await client.post("/validate?timeout=10s", json.dumps(doc).encode())
        assert got is not None and got.status == 200
        assert got.json["response"]["uid"] == f"uid-{i}"
        assert got.json["apiVersion"] == doc["apiVersion"]
        assert "request" not in got.json


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


def _session_after_a_request(port: int, ca: trustme.CA) -> ssl.SSLSession | None:
    """A new connection with a full handshake and one request, its answer read (TLS 1.3 tickets
    arrive after the handshake, before the answer): the client's session afterwards."""
    import socket

    context = ssl.create_default_context()
    ca.configure_trust(context)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(b"GET /readyz HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert tls.recv(65536).startswith(b"HTTP/1.1 200")  # tickets come before the answer
        assert tls.version() == "TLSv1.3"
        return tls.session


async def test_tls_sends_no_session_tickets(nursery: trio.Nursery, tmp_path: Path, ca: trustme.CA) -> None:
    """A new connection gets no TLS 1.3 session ticket: the kube-apiserver never resumes a session
    (client-go has no session cache), so a ticket would cost every handshake work and bytes."""
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "tls.pem")
    running = await _gateway(
        nursery, tmp_path, "--certfile", str(tmp_path / "tls.pem"), "--keyfile", str(tmp_path / "tls.pem")
    )
    session = await trio.to_thread.run_sync(_session_after_a_request, port_of(running.urls[0]), ca)
    assert session is not None and not session.has_ticket


@pytest.mark.parametrize("protocol", ["http1", "h2"], ids=["HTTP/1.1 over TLS", "h2 over TLS (ALPN)"])
async def test_tls_with_client_certificates(
    nursery: trio.Nursery, tmp_path: Path, ca: trustme.CA, protocol: str
) -> None:
    """TRN-14: the gateway serves TLS with ALPN h2/http1.1 and requires a client certificate when asked."""
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(tmp_path / "tls.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    running = await _gateway(
        nursery,
        tmp_path,
        "--certfile",
        str(tmp_path / "tls.pem"),
        "--keyfile",
        str(tmp_path / "tls.pem"),
        "--client-ca",
        str(tmp_path / "ca.pem"),
    )
    assert running.urls[0].startswith("https://")
    port = port_of(running.urls[0])

    anonymous = ssl.create_default_context()
    ca.configure_trust(anonymous)
    try:  # TLS 1.3 reports the missing client certificate after the handshake: no answer either way
        client = await connect("127.0.0.1", port, protocol=protocol, ssl_context=anonymous)
        assert await client.post("/validate", json.dumps(review()).encode()) is None
    except (trio.BrokenResourceError, ssl.SSLError):
        pass

    identified = ssl.create_default_context()
    ca.configure_trust(identified)
    ca.issue_cert("kube-apiserver").configure_cert(identified)
    client = await connect("127.0.0.1", port, protocol=protocol, ssl_context=identified)
    got = await client.post("/validate", json.dumps(review()).encode())
    assert got is not None and got.status == 200 and got.json["response"]["allowed"] is True


@pytest.mark.parametrize("tls", [False, True], ids=["h2c", "h2 over TLS"])
async def test_h2_clients_dropping_streams_do_not_kill_the_server(
    nursery: trio.Nursery, tmp_path: Path, ca: trustme.CA, tls: bool
) -> None:
    """HTTP/2 clients that vanish with many reviews in flight leave the server serving.

    Unpatched, hypercorn 0.18 dies here (KeyError in its HTTP/2 protocol, BusyResourceError in its
    TCP server): see gateway/server/hypercorn/http2.py and tcp_server.py.
    """
    args: tuple[str, ...] = ()
    ctx = None
    if tls:
        ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
            tmp_path / "tls.pem"
        )
        args = ("--certfile", str(tmp_path / "tls.pem"), "--keyfile", str(tmp_path / "tls.pem"))
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        ctx.set_alpn_protocols(["h2"])
    running = await _gateway(
        nursery, tmp_path, *args, hooks=[backend("slow.example.com", "/sleep/30/huge/300000")]
    )
    port = port_of(running.urls[0])
    body = json.dumps(review()).encode()
    for attempt in range(30):
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        stream: trio.abc.Stream = raw
        if ctx is not None:
            stream = trio.SSLStream(raw, ctx, server_hostname="localhost")
            await stream.do_handshake()
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        for _ in range(60):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(
                sid, [(":method", "POST"), (":path", "/validate"), (":scheme", "https"), (":authority", "gw")]
            )
            conn.send_data(sid, body, end_stream=True)
        await stream.send_all(conn.data_to_send())
        await trio.sleep(0.02 * (attempt % 5))
        await raw.aclose()  # gone, without a GOAWAY or a TLS close_notify
    client = (
        await connect("127.0.0.1", port, protocol="h2", ssl_context=ctx)
        if tls
        else await gateway_client(running)
    )
    got = await client.post("/validate", body)
    assert got is not None
    assert got.status == 200


async def test_caller_going_away_cancels_backend_calls(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A caller that disconnects cancels its review: the backend connection is abandoned, nothing answers."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    write_config(tmp_path / "c", validating={"a": [backend("slow.example.com", "")]})
    (tmp_path / "c" / "webhooks.yaml").write_text(
        (tmp_path / "c" / "webhooks.yaml")
        .read_text()
        .replace("__backend__", f"http://127.0.0.1:{server.port}/sleep/3000/allow")
    )
    running = await start_gateway(nursery, tmp_path / "c")
    client = await gateway_client(running)
    with trio.move_on_after(0.3):
        await client.post("/validate", json.dumps(review()).encode())
    pool = running.app.dispatcher.caller.pool  # type: ignore[attr-defined]
    assert sum(pool.open_connections().values()) == 1  # the backend call is in flight
    await client.aclose()
    with trio.fail_after(2):  # the cancelled HTTP/1.1 call's connection is closed, not reused
        while sum(pool.open_connections().values()):
            await trio.sleep(0.02)
    assert len(server.calls) == 1


async def test_an_inbound_h2_connection_remembers_a_bounded_number_of_closed_streams(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A caller cycling many streams on one HTTP/2 connection: the gateway's side remembers 1,024
    closed streams, not h2's 65,536 (~11.5 MB per connection a client could make it hold)."""
    import gc

    write_config(tmp_path / "c", validating={})
    running = await start_gateway(nursery, tmp_path / "c", "--allow-empty-config")
    client = await connect("127.0.0.1", port_of(running.urls[0]), protocol="h2")
    for _ in range(1_100):
        got = await client.post("/healthz", b"", method="GET")
        assert got is not None and got.status == 200
    servers = [
        o for o in gc.get_objects() if isinstance(o, h2.connection.H2Connection) and not o.config.client_side
    ]
    assert servers, "the gateway's side of the connection"
    assert max(len(o._closed_streams) for o in servers) == 1_024  # h2's own bookkeeping
