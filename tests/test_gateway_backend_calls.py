"""What the gateway sends to backends over the wire: headers, credentials, trace context (TRN-05/10/11)."""

from __future__ import annotations

import json
from pathlib import Path

import trio
import yaml

from gateway.devtools.backends import serve_backend
from tests.support.gateway import gateway_client, hook, review, start_gateway, write_config

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


async def test_request_headers_and_trace_context(nursery: trio.Nursery, tmp_path: Path) -> None:
    """TRN-05: a JSON POST with the gateway's User-Agent; the caller's trace continues in a child span."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    write_config(
        tmp_path / "c", validating={"a": [hook("b.example.com", f"http://127.0.0.1:{server.port}/allow")]}
    )
    running = await start_gateway(nursery, tmp_path / "c")
    client = await gateway_client(running)
    client.extra_headers = [("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01")]
    got = await client.post("/validate", json.dumps(review()).encode())
    assert got is not None and got.status == 200
    (call,) = server.calls
    assert call.method == "POST"
    assert call.header("content-type") == "application/json"
    assert call.header("accept") == "application/json, */*"
    assert (call.header("user-agent") or "").startswith("webhook-gateway/")
    version, trace_id, span_id, flags = (call.header("traceparent") or "").split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert span_id != "00f067aa0ba902b7"


async def test_backend_credentials_rotate_without_restart(nursery: trio.Nursery, tmp_path: Path) -> None:
    """TRN-10/11: the bearer token comes from --backend-kubeconfig, and a rewritten file is picked up."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    write_config(
        tmp_path / "c", validating={"a": [hook("b.example.com", f"http://127.0.0.1:{server.port}/allow")]}
    )
    kubeconfig = tmp_path / "backends.kubeconfig"

    def write_token(token: str) -> None:
        kubeconfig.write_text(
            yaml.safe_dump(
                {"apiVersion": "v1", "kind": "Config", "users": [{"name": "*", "user": {"token": token}}]}
            )
        )

    write_token("first")
    running = await start_gateway(
        nursery, tmp_path / "c", "--backend-kubeconfig", str(kubeconfig), "--config-poll-seconds", "0.05"
    )
    client = await gateway_client(running)
    await client.post("/validate", json.dumps(review()).encode())
    assert server.calls[-1].header("authorization") == "Bearer first"

    write_token("second")
    with trio.fail_after(5):
        while server.calls[-1].header("authorization") != "Bearer second":
            await trio.sleep(0.05)
            await client.post("/validate", json.dumps(review()).encode())
