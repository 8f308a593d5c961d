"""Hostile and unusual inbound bodies over real sockets: never a 500, never a traceback (REV-01).

Malformed input (invalid UTF-8, nesting deeper than the apiserver's decoder allows) is a 400 with a
Status naming what is wrong; well-formed reviews with deeply nested objects are decided like any
other, their objects forwarded byte for byte.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import trio

from gateway.devtools.backends import BackendServer, serve_backend
from gateway.server.serve import Running
from tests.support.gateway import backend, gateway_client, review, start_gateway, write_config


async def _gateway(nursery: trio.Nursery, tmp_path: Path) -> tuple[Running, BackendServer]:
    server: BackendServer = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    base = f"http://127.0.0.1:{server.port}"
    hooks = [
        backend("ok.example.com", "/allow"),
        # reads the object's labels: the one part of the object matching must decode
        backend("labels.example.com", "/allow", objectSelector={"matchLabels": {"app": "web"}}),
    ]
    for h in hooks:
        h["clientConfig"]["url"] = h["clientConfig"]["url"].replace("__backend__", base)
    write_config(tmp_path / "config", validating={"a": hooks}, mutating={"m": hooks})
    return await start_gateway(nursery, tmp_path / "config"), server


def _with_invalid_byte(where: str) -> bytes:
    """A valid review whose string at ``where`` carries one byte that is not UTF-8."""
    doc = review()
    marker = "MARKER-to-break"
    req = doc["request"]
    if where == "request.name":
        req["name"] = marker
    elif where == "request.userInfo.username":
        req["userInfo"]["username"] = marker
    elif where == "request.object string":
        req["object"]["spec"]["containers"][0]["image"] = marker
    elif where == "request.object key":
        req["object"]["metadata"]["annotations"] = {marker: "v"}
    elif where == "request.oldObject string":
        req["oldObject"] = {"metadata": {"name": marker}}
        req["operation"] = "UPDATE"
    elif where == "request.options string":
        req["options"]["fieldManager"] = marker
    body = json.dumps(doc).encode()
    assert body.count(marker.encode()) == 1
    return body.replace(marker.encode(), b"MARKER\xff-to-break")


def _nested_object(depth: int) -> bytes:
    """A valid review whose object holds arrays nested ``depth`` levels (inside spec)."""
    text = json.dumps(review())
    nested = "[" * depth + "1" + "]" * depth
    out = text.replace('"spec": {', '"spec": {"deep": ' + nested + ", ", 1)
    assert out != text
    return out.encode()


INVALID_UTF8 = [
    pytest.param(where, id=f"REV-01: one invalid UTF-8 byte in {where} is a 400 naming UTF-8")
    for where in (
        "request.name",
        "request.userInfo.username",
        "request.object string",
        "request.object key",
        "request.oldObject string",
        "request.options string",
    )
]


@pytest.mark.parametrize("where", INVALID_UTF8)
@pytest.mark.parametrize("endpoint", ["validate", "mutate"])
async def test_invalid_utf8_is_a_400(
    nursery: trio.Nursery, tmp_path: Path, where: str, endpoint: str
) -> None:
    running, server = await _gateway(nursery, tmp_path)
    client = await gateway_client(running)
    resp = await client.post(f"/{endpoint}", _with_invalid_byte(where))
    assert resp is not None
    assert resp.status == 400, resp.body
    status = resp.json
    assert (status["kind"], status["reason"], status["code"]) == ("Status", "BadRequest", 400)
    assert "UTF-8" in status["message"]
    assert not server.calls  # nobody is called for a malformed review
    ok = await client.post(f"/{endpoint}", json.dumps(review()).encode())
    assert ok is not None and ok.status == 200


TOO_DEEP: list[Any] = [
    pytest.param(b'{"a":' * 100_000, id="REV-01: '{\"a\":' repeated 100,000 times is a 400 saying too deep"),
    pytest.param(
        b'{"kind":"AdmissionReview","request":{"object":{"a":' + b"[" * 200_000,
        id="REV-01: an object opening 200,000 arrays is a 400 saying too deep",
    ),
    pytest.param(
        _nested_object(20_000),
        id="REV-01: a review whose object nests 20,000 levels is a 400 saying too deep",
    ),
]


@pytest.mark.parametrize("body", TOO_DEEP)
@pytest.mark.parametrize("endpoint", ["validate", "mutate"])
async def test_nesting_deeper_than_the_apiserver_allows_is_a_400(
    nursery: trio.Nursery, tmp_path: Path, body: bytes, endpoint: str
) -> None:
    running, server = await _gateway(nursery, tmp_path)
    client = await gateway_client(running)
    resp = await client.post(f"/{endpoint}", body)
    assert resp is not None
    assert resp.status == 400, resp.body
    assert resp.json["reason"] == "BadRequest"
    assert "nested more than 10000 levels" in resp.json["message"]
    assert not server.calls
    ok = await client.post(f"/{endpoint}", json.dumps(review()).encode())
    assert ok is not None and ok.status == 200


DEEP_BUT_VALID = [
    pytest.param(depth, id=f"REV-01: an object nesting {depth} levels is decided and forwarded unchanged")
    for depth in (900, 2_500, 5_000, 10_000)
]


@pytest.mark.parametrize("depth", DEEP_BUT_VALID)
@pytest.mark.parametrize("endpoint", ["validate", "mutate"])
async def test_deeply_nested_objects_are_decided_like_any_other(
    nursery: trio.Nursery, tmp_path: Path, depth: int, endpoint: str
) -> None:
    running, server = await _gateway(nursery, tmp_path)
    client = await gateway_client(running)
    body = _nested_object(depth)
    resp = await client.post(f"/{endpoint}?timeout=10s", body)
    assert resp is not None
    assert resp.status == 200, resp.body
    assert resp.json["response"]["allowed"] is True
    assert "patch" not in resp.json["response"]
    # Both backends were called (the object selector read the labels), each with the object's bytes.
    assert len(server.calls) == 2
    sent_object = body[body.index(b'"object": ') + len(b'"object": ') : body.index(b', "oldObject"')]
    for call in server.calls:
        assert b'"object":' + sent_object + b',"oldObject"' in call.body


@pytest.mark.parametrize(
    "depth",
    [
        pytest.param(depth, id=f"MUT-11: an object nesting {depth} levels is patched like any other")
        for depth in (2_500, 10_000)
    ],
)
async def test_deeply_nested_objects_are_patched(nursery: trio.Nursery, tmp_path: Path, depth: int) -> None:
    server: BackendServer = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    hooks = [backend("labeler.example.com", "/patch/x")]
    hooks[0]["clientConfig"]["url"] = hooks[0]["clientConfig"]["url"].replace(
        "__backend__", f"http://127.0.0.1:{server.port}"
    )
    write_config(tmp_path / "config", mutating={"m": hooks})
    running = await start_gateway(nursery, tmp_path / "config")
    client = await gateway_client(running)
    for mode in ("first", "second"):  # the second review of the same shape, too
        resp = await client.post("/mutate?timeout=10s", _nested_object(depth))
        assert resp is not None and resp.status == 200, (mode, resp and resp.body)
        response = resp.json["response"]
        assert response["allowed"] is True, response
        assert json.loads(base64.b64decode(response["patch"])) == [
            {"op": "add", "path": "/metadata/labels/x", "value": "true"}
        ]


def _with_member(path: str, value: Any) -> bytes:
    doc = review()
    target = doc["request"]
    *parents, last = path.split(".")
    for name in parents:
        target = target[name]
    target[last] = value
    return json.dumps(doc).encode()


WRONG_MEMBERS = [
    pytest.param(
        "userInfo.extra",
        {"scopes": [2**64]},
        id="REV-01: an integer in userInfo.extra is a 400 naming the member",
    ),
    pytest.param(
        "userInfo.groups", [2**70], id="REV-01: an integer in userInfo.groups is a 400 naming the member"
    ),
    pytest.param("dryRun", "yes", id="REV-01: a dryRun that is not a boolean is a 400 naming the member"),
]


@pytest.mark.parametrize(("path", "value"), WRONG_MEMBERS)
async def test_wrongly_typed_members_are_a_400(
    nursery: trio.Nursery, tmp_path: Path, path: str, value: Any
) -> None:
    running, server = await _gateway(nursery, tmp_path)
    client = await gateway_client(running)
    resp = await client.post("/validate", _with_member(path, value))
    assert resp is not None and resp.status == 400, resp and resp.body
    assert f"$.request.{path}" in resp.json["message"]
    assert not server.calls
