"""Strict HTTP/1.1 framing and one rule for methods, versions and paths (docs/inbound.md, "Request
framing"): request-smuggling probes through real sockets, over TLS as the gateway is deployed.

Each probe is raw bytes written to the real gateway; what comes back is read until the gateway
closes the connection or stays quiet. A probe passes when the gateway answers exactly the replies
listed — a request smuggled behind a refused one is never answered — and closes the connection
when it must (RFC 9112 §6.3: after faulty framing the connection cannot be trusted).
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import h2.events
import pytest
import trio
import trustme

from gateway.devtools.backends import serve_backend
from tests.support.gateway import review
from tests.support.inbound import H2Client, start

BODY = json.dumps(review()).encode()
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nhost: gw\r\n\r\n"


def _post(
    *headers: str, body: bytes = BODY, target: str = "/validate?timeout=5s", method: str = "POST"
) -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
    return (head + "".join(h + "\r\n" for h in headers) + "\r\n").encode() + body


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def _get(target: str, version: str = "HTTP/1.1", method: str = "GET") -> bytes:
    return f"{method} {target} {version}\r\nhost: gw\r\n\r\n".encode()


# (probe, statuses answered in order, whether the gateway closes the connection afterwards)
PROBES = [
    pytest.param(
        _post("transfer-encoding: chunked", f"content-length: {len(BODY)}", body=_chunked(BODY)) + SMUGGLED,
        [400],
        True,
        id="Transfer-Encoding and Content-Length together: 400 and close; the request behind it is never "
        "answered (RFC 9112 §6.3)",
    ),
    pytest.param(
        _post("content-length: 4", "transfer-encoding: chunked", body=_chunked(BODY)) + SMUGGLED,
        [400],
        True,
        id="Content-Length before Transfer-Encoding: 400 and close as well",
    ),
    pytest.param(
        _post("transfer-encoding: chunked", "content-length: 0", body=_chunked(b"x")) + SMUGGLED,
        [400],
        True,
        id="Transfer-Encoding with Content-Length: 0: 400 and close",
    ),
    pytest.param(
        _post("transfer-encoding: chunked", "transfer-encoding: chunked", body=_chunked(BODY)) + SMUGGLED,
        [501],
        True,
        id="Transfer-Encoding twice: 501 and close",
    ),
    pytest.param(
        _post("transfer-encoding: gzip, chunked", body=_chunked(BODY)) + SMUGGLED,
        [501],
        True,
        id="a transfer coding other than chunked: 501 and close",
    ),
    pytest.param(
        _post("content-length: 4", "content-length: 5", body=b"12345") + SMUGGLED,
        [400],
        True,
        id="two different Content-Lengths: 400 and close",
    ),
    pytest.param(
        _post("content-length: +5", body=b"12345") + SMUGGLED,
        [400],
        True,
        id="Content-Length: +5: 400 and close",
    ),
    pytest.param(
        _post("content-length : 5", body=b"12345") + SMUGGLED,
        [400],
        True,
        id="whitespace between a field name and its colon: 400 and close",
    ),
    pytest.param(
        _post("transfer-encoding: chunked", body=b"zz\r\nabc\r\n0\r\n\r\n") + SMUGGLED,
        [400],
        True,
        id="a chunk size that is not hexadecimal: 400 and close",
    ),
    pytest.param(
        _post(f"content-length: {len(BODY)}", "host: other") + SMUGGLED,
        [400],
        True,
        id="two Host fields: 400 and close (RFC 9112 §3.2)",
    ),
    pytest.param(
        b"GET /healthz HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
        [400],
        True,
        id="Transfer-Encoding in an HTTP/1.0 request: faulty framing, 400 and close (RFC 9112 §6.1)",
    ),
    pytest.param(
        _post(f"content-length: {len(BODY)}", method="post") + SMUGGLED,
        [400],
        True,
        id="a lower-case method: 400 and close (methods are case-sensitive, RFC 9110 §9.1)",
    ),
    pytest.param(
        _get("/healthz", "HTTP/2.0") + SMUGGLED,
        [505],
        True,
        id="HTTP/2.0 in an HTTP/1.1 request line: 505 and close (HTTP/2 needs ALPN or the preface)",
    ),
    pytest.param(
        _get("/healthz", "HTTP/1.0"),
        [200],
        True,
        id="HTTP/1.0 is served (and closed after its reply, as HTTP/1.0 without keep-alive is)",
    ),
    pytest.param(
        b"GET /healthz HTTP/1.1\r\nhost: gw\r\nconnection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
        b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n" + _get("/healthz"),
        [200, 200],
        False,
        id="Upgrade: h2c over TLS is ignored: no 101, answered in HTTP/1.1, the connection stays usable "
        "(RFC 9113 §3.2)",
    ),
    pytest.param(
        _post("content-length: 999999999", "expect: 100-continue", body=b""),
        [413],
        True,
        id="Expect: 100-continue with a Content-Length over the limit: 413 without 100 Continue, then close",
    ),
    pytest.param(
        _get("/%6detrics") + _get("/healthz"),
        [404, 200],
        False,
        id="a percent-encoded path is matched as sent: /%6detrics is not /metrics (404)",
    ),
    pytest.param(
        _post(f"content-length: {len(BODY)}", target="/%76alidate?timeout=5s") + _get("/healthz"),
        [404, 200],
        False,
        id="a percent-encoded review path is not the review endpoint (404)",
    ),
    pytest.param(
        _get("/healthz/") + _get("/./healthz") + _get("/healthz"),
        [404, 404, 200],
        False,
        id="paths are not normalised: a trailing slash or a dot segment is another path (404)",
    ),
    pytest.param(
        _post(f"content-length: {len(BODY)}") + _post(f"content-length: {len(BODY)}"),
        [200, 200],
        False,
        id="two pipelined well-formed reviews are both answered on the connection (the control)",
    ),
    pytest.param(
        _post("transfer-encoding: chunked", body=_chunked(BODY)) + _get("/healthz"),
        [200, 200],
        False,
        id="a chunked review without Content-Length is answered, and the next request too (the control)",
    ),
]


@pytest.fixture
def tls(tmp_path: Path) -> tuple[list[str], ssl.SSLContext]:
    """The gateway's serving certificate options, and a client context (ALPN http/1.1) that trusts it."""
    ca = trustme.CA()
    pem = tmp_path / "tls.pem"
    ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(pem)
    context = ssl.create_default_context()
    ca.configure_trust(context)
    context.set_alpn_protocols(["http/1.1"])
    return ["--certfile", str(pem), "--keyfile", str(pem)], context


async def _exchange(port: int, context: ssl.SSLContext, probe: bytes) -> tuple[list[int], bool]:
    """Write ``probe`` over TLS; the statuses of every reply (1xx included) and whether the gateway closed."""
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, context, server_hostname="localhost")
    await stream.send_all(probe)
    data, closed = b"", False
    with trio.move_on_after(1.5):  # the gateway answers within ms; quiet this long = it keeps the connection
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                chunk = b""
            if not chunk:
                closed = True
                break
            data += chunk
    await trio.aclose_forcefully(stream)
    return _statuses(data), closed


def _statuses(data: bytes) -> list[int]:
    statuses = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        statuses.append(status)
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        data = rest[length:] if status >= 200 else rest
    return statuses


@pytest.mark.parametrize(("probe", "statuses", "closes"), PROBES)
async def test_http11_smuggling_probes(
    nursery: trio.Nursery,
    tmp_path: Path,
    tls: tuple[list[str], ssl.SSLContext],
    probe: bytes,
    statuses: list[int],
    closes: bool,
) -> None:
    backend = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    gw = await start(nursery, tmp_path, f"http://127.0.0.1:{backend.port}/allow", *tls[0])
    assert await _exchange(gw.port, tls[1], probe) == (statuses, closes)
    if statuses[0] >= 400:  # a refused review never reached a backend
        assert gw.counter("inbound_requests", "validating", "200") == 0


async def test_100_continue_is_sent_when_the_body_is_read(
    nursery: trio.Nursery, tmp_path: Path, tls: tuple[list[str], ssl.SSLContext]
) -> None:
    """Expect: 100-continue within the limit: 100 Continue, then the body is sent and reviewed (200)."""
    backend = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    gw = await start(nursery, tmp_path, f"http://127.0.0.1:{backend.port}/allow", *tls[0])
    tcp = await trio.open_tcp_stream("127.0.0.1", gw.port)
    stream = trio.SSLStream(tcp, tls[1], server_hostname="localhost")
    await stream.send_all(_post(f"content-length: {len(BODY)}", "expect: 100-continue", body=b""))
    with trio.fail_after(5):
        interim = await stream.receive_some(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    await stream.send_all(BODY)
    data = b""
    with trio.fail_after(5):
        while b'"allowed":true' not in data:
            data += await stream.receive_some(65536)
    assert data.startswith(b"HTTP/1.1 200 ")
    await trio.aclose_forcefully(stream)


H2_PROBES = [
    pytest.param("post", "/validate?timeout=5s", 400, id="HTTP/2: a lower-case :method is refused with 400"),
    pytest.param("GET", "/%6detrics", 404, id="HTTP/2: a percent-encoded :path is matched as sent (404)"),
    pytest.param("GET", "/healthz", 200, id="HTTP/2: GET /healthz (the control)"),
]


@pytest.mark.parametrize(("method", "path", "status"), H2_PROBES)
async def test_http2_follows_the_same_rules(
    nursery: trio.Nursery, tmp_path: Path, method: str, path: str, status: int
) -> None:
    backend = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    gw = await start(nursery, tmp_path, f"http://127.0.0.1:{backend.port}/allow")
    client = await H2Client.open(gw.port)
    sid = client.conn.get_next_available_stream_id()
    client.conn.send_headers(sid, client.headers(path, method=method), end_stream=method == "GET")
    if method != "GET":
        client.conn.send_data(sid, BODY, end_stream=True)
    await client.flush()
    with trio.fail_after(5):
        response = await client.until(h2.events.ResponseReceived, stream_id=sid)
    assert response is not None
    assert dict(response.headers)[b":status"] == str(status).encode()
