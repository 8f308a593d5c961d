"""Backend calls end to end over real sockets: no replays (FPT-10), fresh errors per call (TRN-07).

The backends here are scripted raw-socket servers (h11 on a trio listener) so that each test controls
exactly when a connection is read, answered or closed.
"""

from __future__ import annotations

import base64
import json
import tracemalloc
from pathlib import Path

import h11
import pytest
import trio
import yaml
from structlog.testing import capture_logs

from tests.support.gateway import gateway_client, hook, review, send_review, start_gateway, write_config


class ScriptedBackend:
    """An HTTP/1.1 backend that answers the first ``answered`` requests of each connection with
    "allowed", then reads the next request completely and closes the connection without a reply."""

    def __init__(self, answered: int) -> None:
        self.answered = answered
        self.posts: list[tuple[int, str]] = []  # (connection index, request uid), fully read
        self.connections = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(int(listeners[0].socket.getsockname()[1]))
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        index = self.connections
        self.connections += 1
        connection = h11.Connection(h11.SERVER)
        async with stream:
            for number in range(self.answered + 1):
                body = await _read_request(stream, connection)
                if body is None:
                    return
                uid = json.loads(body)["request"]["uid"]
                self.posts.append((index, uid))
                if number == self.answered:
                    return  # the whole request was read: close without answering
                reply = json.dumps(
                    {
                        "apiVersion": "admission.k8s.io/v1",
                        "kind": "AdmissionReview",
                        "response": {"uid": uid, "allowed": True},
                    }
                ).encode()
                headers = [("content-type", "application/json"), ("content-length", str(len(reply)))]
                data = connection.send(h11.Response(status_code=200, headers=headers))
                data = (data or b"") + (connection.send(h11.Data(data=reply)) or b"")
                data += connection.send(h11.EndOfMessage()) or b""
                await stream.send_all(data)
                connection.start_next_cycle()


async def _read_request(stream: trio.SocketStream, connection: h11.Connection) -> bytes | None:
    body = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            if not data:
                return None
            connection.receive_data(data)
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None


def _config(directory: Path, url: str, policy: str) -> None:
    write_config(directory, validating={"a": [hook("b.example.com", url, failurePolicy=policy)]})


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("Fail", id="FPT-10: a request the backend read and dropped is one failed call (Fail)"),
        pytest.param("Ignore", id="FPT-10: a request the backend read and dropped is never resent (Ignore)"),
    ],
)
async def test_a_request_the_backend_read_is_never_sent_again(
    nursery: trio.Nursery, tmp_path: Path, policy: str
) -> None:
    backend = ScriptedBackend(answered=1)
    port = await nursery.start(backend.serve)
    _config(tmp_path, f"http://127.0.0.1:{port}/validate", policy)
    running = await start_gateway(nursery, tmp_path)
    client = await gateway_client(running)
    one = (await send_review(client, "validate", review())).json["response"]
    two = (await send_review(client, "validate", review())).json["response"]
    await client.aclose()
    running.shutdown()

    assert one["allowed"] is True
    # Two reviews, two POSTs: the second one was read by the backend on the kept-alive connection.
    assert [connection for connection, _uid in backend.posts] == [0, 0], backend.posts
    if policy == "Fail":
        assert two["allowed"] is False
        assert "failed calling webhook" in two["status"]["message"], two
    else:
        assert two["allowed"] is True


BAD_CA_BUNDLE = base64.b64encode(
    b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n"
)


def _transport_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """Memory still allocated by the gateway's transport and caller code."""
    only = [tracemalloc.Filter(True, "*/gateway/transport/*")]
    return sum(stat.size for stat in snapshot.filter_traces(only).statistics("filename"))


async def test_an_unusable_ca_bundle_fails_every_call_with_a_fresh_error(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """TRN-07: a caBundle that cannot be loaded fails each call; the failures cost no memory.

    Every call builds a new error value: re-raising one cached exception object grows its traceback
    (and the memory it holds) on every call, without bound.
    """
    hooks = [
        hook(
            "b.example.com",
            "https://127.0.0.1:1/validate",
            failurePolicy="Fail",
            clientConfig={"url": "https://127.0.0.1:1/validate", "caBundle": BAD_CA_BUNDLE.decode()},
        )
    ]
    write_config(tmp_path, validating={"a": hooks})
    running = await start_gateway(nursery, tmp_path)
    client = await gateway_client(running)

    async def reviews(count: int) -> None:
        for _ in range(count):
            response = (await send_review(client, "validate", review())).json["response"]
            assert response["allowed"] is False
            assert (
                "could not get REST client: unable to load root certificates" in response["status"]["message"]
            )

    tracemalloc.start()
    try:
        await reviews(50)  # warm up: whatever is built once is built now
        before = _transport_bytes(tracemalloc.take_snapshot())
        await reviews(300)
        after = _transport_bytes(tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    await client.aclose()
    running.shutdown()
    # A leak of even 100 bytes per call would be 30,000 bytes here.
    assert after - before < 10_000, f"transport memory grew by {after - before} bytes over 300 calls"


SECRET = "S3CR3T-reload-4e1b"


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(
            "kubeconfig-yaml", id="a backend kubeconfig rewritten with a YAML error: no token in the log"
        ),
        pytest.param(
            "kubeconfig-both", id="TRN-11: a backend kubeconfig rewritten with token and basic: no secret"
        ),
        pytest.param(
            "url-userinfo", id="CFG-14: a reloaded URL with user information: no password in the log"
        ),
    ],
)
async def test_a_refused_reload_logs_no_secret(nursery: trio.Nursery, tmp_path: Path, breakage: str) -> None:
    """A reload that fails keeps the old files' settings and logs why, without any secret value."""
    from gateway.devtools.backends import serve_backend

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    url = f"http://127.0.0.1:{server.port}/allow"
    write_config(tmp_path / "c", validating={"a": [hook("b.example.com", url)]})
    kubeconfig = tmp_path / "backends.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({"users": [{"name": "*", "user": {"token": "good"}}]}))
    running = await start_gateway(
        nursery, tmp_path / "c", "--backend-kubeconfig", str(kubeconfig), "--config-poll-seconds", "0.05"
    )
    client = await gateway_client(running)
    with capture_logs() as logs:
        if breakage == "kubeconfig-yaml":
            kubeconfig.write_text(f"users:\n- name: '*'\n  user:\n    token: [{SECRET}\n")
        elif breakage == "kubeconfig-both":
            user = {"token": SECRET, "username": "admin", "password": SECRET}
            kubeconfig.write_text(yaml.safe_dump({"users": [{"name": "*", "user": user}]}))
        else:
            bad = f"https://admin:{SECRET}@backend.example.com/validate"
            write_config(tmp_path / "c", validating={"a": [hook("b.example.com", bad)]})
        with trio.fail_after(5):
            while not any(entry["log_level"] == "error" for entry in logs):
                await trio.sleep(0.05)
        response = (await send_review(client, "validate", review())).json["response"]
    await client.aclose()
    running.shutdown()
    assert response["allowed"] is True
    assert server.calls[-1].header("authorization") == "Bearer good"  # the old settings still serve
    assert SECRET not in repr(logs), logs
