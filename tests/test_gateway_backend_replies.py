"""Backends answering with deeply nested JSON, over real sockets: decided, never a crash (REV-08, MUT-04).

A backend is as untrusted as a caller: its reply is decoded as deep as the apiserver's own decoder
allows (10,000 levels); deeper is a call error governed by the backend's failurePolicy, never a
500 from the gateway or a traceback.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h11
import pytest
import trio

from tests.support.gateway import gateway_client, hook, review, start_gateway, write_config

Reply = Callable[[dict[str, Any]], bytes]


async def serve_replies(
    reply: Reply, status: int = 200, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """A real HTTP/1.1 backend answering every review with ``status`` and ``reply(review)``."""

    async def handle(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        body = b""
        with trio.move_on_after(10):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    out = reply(json.loads(body))
                    headers = [("content-type", "application/json"), ("content-length", str(len(out)))]
                    await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
                    await stream.send_all(conn.send(h11.Data(data=out)) or b"")
                    await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
                    body = b""
                elif isinstance(event, h11.ConnectionClosed):
                    return

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def allowed_with_deep_member(depth: int) -> Reply:
    def reply(doc: dict[str, Any]) -> bytes:
        uid = json.dumps(doc["request"]["uid"])
        return (
            f'{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview",'
            f'"response":{{"uid":{uid},"allowed":true,"extra":{nested(depth)}}}}}'
        ).encode()

    return reply


def deep_patch(depth: int) -> Reply:
    def reply(doc: dict[str, Any]) -> bytes:
        patch = base64.b64encode(nested(depth).encode()).decode()
        return json.dumps(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {
                    "uid": doc["request"]["uid"],
                    "allowed": True,
                    "patchType": "JSONPatch",
                    "patch": patch,
                },
            }
        ).encode()

    return reply


CASES: list[Any] = [
    pytest.param(
        "validate",
        allowed_with_deep_member(5_000),
        "Fail",
        (True, None),
        id="REV-08: a reply nesting 5,000 levels is decoded like any other",
    ),
    pytest.param(
        "validate",
        allowed_with_deep_member(20_000),
        "Fail",
        (False, "nested more than 10000 levels"),
        id="REV-08/FPT-02: a reply nesting 20,000 levels is a call error denying under Fail",
    ),
    pytest.param(
        "validate",
        allowed_with_deep_member(20_000),
        "Ignore",
        (True, None),
        id="REV-08/FPT-03: a reply nesting 20,000 levels is a call error ignored under Ignore",
    ),
    pytest.param(
        "mutate",
        deep_patch(5_000),
        "Fail",
        (False, "cannot unmarshal array into Go value of type jsonpatch.Operation"),
        id="MUT-04: a patch of arrays nested 5,000 levels is an undecodable patch",
    ),
    pytest.param(
        "mutate",
        deep_patch(20_000),
        "Fail",
        (False, "nested more than 10000 levels"),
        id="MUT-04: a patch nesting 20,000 levels is an undecodable patch",
    ),
]


def deep_status(depth: int) -> Reply:
    def reply(doc: dict[str, Any]) -> bytes:
        return f'{{"kind":"Status","status":"Failure","code":500,"details":{nested(depth)}}}'.encode()

    return reply


@pytest.mark.parametrize(
    ("endpoint", "reply", "policy", "expected", "status"),
    [
        *[pytest.param(*case.values, 200, id=case.id) for case in CASES],
        pytest.param(
            "validate",
            deep_status(20_000),
            "Fail",
            (False, "failed to call webhook: an error on the server"),
            500,
            id="ERR-07: an error reply nesting 20,000 levels is a plain HTTP error call error",
        ),
    ],
)
async def test_deeply_nested_replies_are_decided(
    nursery: trio.Nursery,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    endpoint: str,
    reply: Reply,
    policy: str,
    expected: tuple[bool, str | None],
    status: int,
) -> None:
    port = await nursery.start(serve_replies, reply, status)
    hooks = [hook("deep.example.com", f"http://127.0.0.1:{port}/", failurePolicy=policy)]
    kind = "validating" if endpoint == "validate" else "mutating"
    write_config(tmp_path / "config", **{kind: {"c": hooks}})  # type: ignore[arg-type]
    running = await start_gateway(nursery, tmp_path / "config")
    client = await gateway_client(running)
    resp = await client.post(f"/{endpoint}?timeout=10s", json.dumps(review()).encode())
    assert resp is not None and resp.status == 200, resp and resp.body
    response = resp.json["response"]
    allowed, mentions = expected
    assert response["allowed"] is allowed, response
    if mentions is not None:
        assert mentions in response["status"]["message"]
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err


# --- integers the apiserver decodes as int32 (metav1.Status.Code, StatusDetails.RetryAfterSeconds) ---

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def answering(allowed: bool, status: dict[str, Any]) -> Reply:
    def reply(doc: dict[str, Any]) -> bytes:
        response = {"uid": doc["request"]["uid"], "allowed": allowed, "status": status}
        return json.dumps(
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
        ).encode()

    return reply


def _go_field(value: int, struct: str, path: str) -> str:
    return f"json: cannot unmarshal number {value} into Go struct field {struct}.{path} of type int32"


INT32_CASES: list[Any] = [
    pytest.param(
        answering(False, {"code": INT32_MAX + 1, "message": "no"}),
        "Fail",
        (False, _go_field(INT32_MAX + 1, "Status", "response.status.code")),
        id="REV-08/FPT-02: a status.code above int32 is a call error, denying under Fail",
    ),
    pytest.param(
        answering(False, {"code": INT32_MIN - 1, "message": "no"}),
        "Fail",
        (False, _go_field(INT32_MIN - 1, "Status", "response.status.code")),
        id="REV-08: a status.code below int32 is a call error",
    ),
    pytest.param(
        answering(True, {"code": 10**30}),
        "Fail",
        (False, _go_field(10**30, "Status", "response.status.code")),
        id="REV-08: an allowing reply's status is decoded too: beyond int32 it is a call error",
    ),
    pytest.param(
        answering(False, {"code": INT32_MAX + 1, "message": "no"}),
        "Ignore",
        (True, None),
        id="REV-08/FPT-03: a status.code beyond int32 is a call error ignored under Ignore",
    ),
    pytest.param(
        answering(False, {"code": 429, "message": "no", "details": {"retryAfterSeconds": INT32_MAX + 1}}),
        "Fail",
        (
            False,
            _go_field(INT32_MAX + 1, "StatusDetails", "response.status.details.retryAfterSeconds"),
        ),
        id="REV-08/FPT-02: a status.details.retryAfterSeconds beyond int32 is a call error",
    ),
    pytest.param(
        answering(False, {"code": INT32_MAX, "message": "no", "details": {"retryAfterSeconds": INT32_MAX}}),
        "Fail",
        (False, 'admission webhook "big.example.com" denied the request: no'),
        id="ERR-01: int32's largest code and retryAfterSeconds pass through unchanged",
    ),
]


def _integers(value: Any) -> list[int]:
    """Every integer in a decoded JSON value (booleans excepted)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, dict):
        return [i for v in value.values() for i in _integers(v)]
    if isinstance(value, list):
        return [i for v in value for i in _integers(v)]
    return []


@pytest.mark.parametrize(("reply", "policy", "expected"), INT32_CASES)
async def test_integers_beyond_int32_never_reach_the_reply(
    nursery: trio.Nursery, tmp_path: Path, reply: Reply, policy: str, expected: tuple[bool, str | None]
) -> None:
    """The apiserver decodes ``status.code`` and ``status.details.retryAfterSeconds`` as int32: a
    backend reply with a larger one is that backend's call error (as upstream's decoder makes it),
    never forwarded into a gateway reply the apiserver could not decode at all."""
    port = await nursery.start(serve_replies, reply, 200)
    hooks = [hook("big.example.com", f"http://127.0.0.1:{port}/", failurePolicy=policy)]
    write_config(tmp_path / "config", validating={"c": hooks})
    running = await start_gateway(nursery, tmp_path / "config")
    client = await gateway_client(running)
    resp = await client.post("/validate?timeout=10s", json.dumps(review()).encode())
    assert resp is not None and resp.status == 200, resp and resp.body
    response = resp.json["response"]
    allowed, mentions = expected
    assert response["allowed"] is allowed, response
    if mentions is not None:
        assert mentions in response["status"]["message"], response["status"]
    assert all(INT32_MIN <= i <= INT32_MAX for i in _integers(response)), response
