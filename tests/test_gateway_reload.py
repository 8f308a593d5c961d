"""Live configuration through the running gateway: reloads (CFG-25, ORD-04) and certificate rotation."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import trio
import trustme

from gateway.devtools.backends import serve_backend
from tests.support.client import connect
from tests.support.gateway import gateway_client, hook, port_of, review, start_gateway, write_config

POLL = ("--config-poll-seconds", "0.05")


async def _validate(running: object) -> dict[str, object]:
    client = await gateway_client(running)  # type: ignore[arg-type]
    got = await client.post("/validate?timeout=5s", json.dumps(review()).encode())
    assert got is not None and got.status == 200
    await client.aclose()
    return dict(got.json["response"])


async def _eventually(predicate: object, seconds: float = 5.0) -> None:
    with trio.fail_after(seconds):
        while not await predicate():  # type: ignore[operator]
            await trio.sleep(0.05)


async def test_valid_change_is_swapped_in_and_invalid_one_refused(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """CFG-25: a valid change is used by later reviews; an invalid one is refused and the old one keeps serving."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    base = f"http://127.0.0.1:{server.port}"
    config = tmp_path / "config"
    write_config(config, validating={"a": [hook("gate.example.com", f"{base}/allow")]})
    running = await start_gateway(nursery, config, *POLL)
    assert (await _validate(running))["allowed"] is True

    write_config(config, validating={"a": [hook("gate.example.com", f"{base}/deny/403/closed")]})

    async def denied() -> bool:
        return (await _validate(running))["allowed"] is False

    await _eventually(denied)

    broken = [hook("gate.example.com", f"{base}/allow", timeoutSeconds=99)]
    write_config(config, validating={"a": broken})
    await trio.sleep(0.5)  # several polls: the broken file was seen and refused
    assert (await _validate(running))["allowed"] is False  # still the last good configuration
    assert running.app.snapshot().generation == 2  # type: ignore[union-attr]


async def test_configmap_symlink_swap_is_detected(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A ConfigMap volume's atomic `..data` symlink swap reloads the configuration."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    base = f"http://127.0.0.1:{server.port}"
    mount = tmp_path / "mount"
    mount.mkdir()
    write_config(mount / "..2026_01", validating={"a": [hook("gate.example.com", f"{base}/allow")]})
    (mount / "..data").symlink_to("..2026_01")
    (mount / "webhooks.yaml").symlink_to("..data/webhooks.yaml")
    running = await start_gateway(nursery, mount, *POLL)
    assert (await _validate(running))["allowed"] is True

    write_config(mount / "..2026_02", validating={"a": [hook("gate.example.com", f"{base}/deny")]})
    (mount / "..data_tmp").symlink_to("..2026_02")
    (mount / "..data_tmp").replace(mount / "..data")  # what kubelet does: rename over the old link

    async def denied() -> bool:
        return (await _validate(running))["allowed"] is False

    await _eventually(denied)


async def test_serving_certificate_rotation(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A new certificate written over the old files is served to new connections without a restart."""
    ca = trustme.CA()
    first = ca.issue_cert("localhost", "127.0.0.1", organization_name="first")
    first.private_key_and_cert_chain_pem.write_to_path(tmp_path / "tls.pem")
    write_config(tmp_path / "config")
    running = await start_gateway(
        nursery,
        tmp_path / "config",
        "--certfile",
        str(tmp_path / "tls.pem"),
        "--keyfile",
        str(tmp_path / "tls.pem"),
        "--allow-empty-config",  # no backends needed to watch the certificate
        *POLL,
    )
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)

    async def served_organization() -> str:
        client = await connect("127.0.0.1", port_of(running.urls[0]), ssl_context=ctx)
        cert = client.stream.getpeercert()  # type: ignore[attr-defined]
        await client.aclose()
        subject = dict(item[0] for item in cert["subject"])
        return str(subject.get("organizationName"))

    assert await served_organization() == "first"
    second = ca.issue_cert("localhost", "127.0.0.1", organization_name="second")
    second.private_key_and_cert_chain_pem.write_to_path(tmp_path / "tls.pem")

    async def rotated() -> bool:
        return await served_organization() == "second"

    await _eventually(rotated)
