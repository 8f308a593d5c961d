"""Run the real gateway in-process (hypercorn on 127.0.0.1:0) against real backend servers.

``write_config`` turns small Python descriptions into v1 / v1beta1 webhook configuration YAML;
``start_gateway`` runs ``gateway.server.serve.serve`` under the test's nursery with CLI-parsed
options, so tests exercise exactly what ``webhook-gateway`` runs.
"""

from __future__ import annotations

import base64
import json
import ssl
import uuid
from pathlib import Path
from typing import Any

import trio
import yaml

from gateway.cli import parse
from gateway.server.serve import Running, serve
from tests.support.client import Client, Resp, connect

ALL_RULES = [{"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*/*"]}]


def hook(name: str, url: str, **fields: Any) -> dict[str, Any]:
    """A v1 webhook entry with the fields tests usually leave alone already set."""
    doc: dict[str, Any] = {
        "name": name,
        "clientConfig": {"url": url},
        "rules": ALL_RULES,
        "sideEffects": "None",
        "admissionReviewVersions": ["v1", "v1beta1"],
        "failurePolicy": "Fail",
        "timeoutSeconds": 5,
    }
    doc.update(fields)
    return doc


def write_config(
    directory: Path,
    *,
    validating: dict[str, list[dict[str, Any]]] | None = None,
    mutating: dict[str, list[dict[str, Any]]] | None = None,
    namespaces: dict[str, dict[str, str]] | None = None,
    api_version: str = "admissionregistration.k8s.io/v1",
    filename: str = "webhooks.yaml",
) -> Path:
    """Write configurations (name → webhooks) and Namespace objects as one multi-document file."""
    docs: list[dict[str, Any]] = []
    for kind, configs in (
        ("ValidatingWebhookConfiguration", validating),
        ("MutatingWebhookConfiguration", mutating),
    ):
        for name, hooks in (configs or {}).items():
            docs.append(
                {"apiVersion": api_version, "kind": kind, "metadata": {"name": name}, "webhooks": hooks}
            )
    for name, labels in (namespaces or {}).items():
        docs.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / filename
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


async def start_gateway(nursery: trio.Nursery, config_dir: Path, *args: str) -> Running:
    """Start the gateway on a free port; extra ``args`` are CLI options."""
    options = parse(
        ["--config", str(config_dir), "--bind", "127.0.0.1:0", "--drain-seconds", "0", *args]
    ).options
    running: Running = await nursery.start(
        lambda task_status: serve(options, handle_signals=False, task_status=task_status)
    )
    return running


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def pod(name: str = "web-1", namespace: str = "shop", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels if labels is not None else {"app": "web"},
        },
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/web:1.2.3"}]},
    }


def review(
    obj: dict[str, Any] | None = None,
    *,
    version: str = "v1",
    operation: str = "CREATE",
    old: dict[str, Any] | None = None,
    dry_run: bool = False,
    uid: str | None = None,
    namespace: str = "shop",
    resource: tuple[str, str, str] = ("", "v1", "pods"),
    kind: tuple[str, str, str] = ("", "v1", "Pod"),
    sub_resource: str = "",
) -> dict[str, Any]:
    """An inbound AdmissionReview as kube-apiserver sends it."""
    obj = pod(namespace=namespace) if obj is None and operation != "DELETE" else obj
    request: dict[str, Any] = {
        "uid": uid or str(uuid.uuid4()),
        "kind": dict(zip(("group", "version", "kind"), kind, strict=True)),
        "resource": dict(zip(("group", "version", "resource"), resource, strict=True)),
        "requestKind": dict(zip(("group", "version", "kind"), kind, strict=True)),
        "requestResource": dict(zip(("group", "version", "resource"), resource, strict=True)),
        "name": (obj or old or {}).get("metadata", {}).get("name", ""),
        "namespace": namespace,
        "operation": operation,
        "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
        "object": obj,
        "oldObject": old,
        "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.capitalize()}Options"},
    }
    if sub_resource:
        request["subResource"] = sub_resource
        request["requestSubResource"] = sub_resource
    return {"apiVersion": f"admission.k8s.io/{version}", "kind": "AdmissionReview", "request": request}


async def send_review(
    client: Client, endpoint: str, doc: dict[str, Any], *, timeout: str | None = "10s"
) -> Resp:
    path = f"/{endpoint}" + (f"?timeout={timeout}" if timeout else "")
    resp = await client.post(path, json.dumps(doc).encode())
    assert resp is not None, "the gateway closed the connection without answering"
    return resp


def decoded_patch(response: dict[str, Any]) -> list[dict[str, Any]] | None:
    patch = response.get("patch")
    return None if patch is None else json.loads(base64.b64decode(patch))


async def gateway_client(
    running: Running, *, protocol: str = "http1", ssl_context: ssl.SSLContext | None = None
) -> Client:
    return await connect("127.0.0.1", port_of(running.urls[0]), protocol=protocol, ssl_context=ssl_context)
