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


# --- scenario runner ---------------------------------------------------------------------------


def backend(name: str, path: str, **fields: Any) -> dict[str, Any]:
    """A webhook entry whose URL is ``path`` on the test's sample backend server (filled in later)."""
    entry = hook(name, "", **fields)
    entry["clientConfig"] = {"url": "__backend__" + path}
    return entry


def _fill_urls(
    configs: dict[str, list[dict[str, Any]]] | None, base: str
) -> dict[str, list[dict[str, Any]]] | None:
    if configs is None:
        return None
    out: dict[str, list[dict[str, Any]]] = {}
    for name, hooks in configs.items():
        filled = []
        for original in hooks:
            h = json.loads(json.dumps(original))
            url = h.get("clientConfig", {}).get("url", "")
            if url.startswith("__backend__"):
                h["clientConfig"]["url"] = base + url.removeprefix("__backend__")
            filled.append(h)
        out[name] = filled
    return out


class Outcome:
    """What the caller got back, and what the backend saw."""

    def __init__(self, resp: Resp, sent: dict[str, Any], backend: Any, elapsed: float) -> None:
        self.http_status = resp.status
        self.body: dict[str, Any] = resp.json if resp.body else {}
        self.response: dict[str, Any] = self.body.get("response", {})
        self.sent = sent
        self.backend = backend
        self.elapsed = elapsed

    @property
    def allowed(self) -> bool:
        return bool(self.response.get("allowed"))

    @property
    def status(self) -> dict[str, Any]:
        return self.response.get("status", {})

    @property
    def message(self) -> str:
        return str(self.status.get("message", ""))

    @property
    def calls(self) -> list[Any]:
        return list(self.backend.calls)

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.response.get("auditAnnotations", {}))

    @property
    def warnings(self) -> list[str]:
        return list(self.response.get("warnings", []))

    @property
    def patch(self) -> list[dict[str, Any]] | None:
        return decoded_patch(self.response)


async def run_scenario(
    nursery: trio.Nursery,
    config_dir: Path,
    *,
    endpoint: str = "validate",
    validating: dict[str, list[dict[str, Any]]] | None = None,
    mutating: dict[str, list[dict[str, Any]]] | None = None,
    namespaces: dict[str, dict[str, str]] | None = None,
    api_version: str = "admissionregistration.k8s.io/v1",
    doc: dict[str, Any] | None = None,
    caller_version: str = "v1",
    timeout: str | None = "10s",
    gateway_args: tuple[str, ...] = (),
    protocol: str = "http1",
) -> Outcome:
    """Start a sample backend and the gateway, send one review, return what happened."""
    from gateway.devtools.backends import serve_backend

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    base = f"http://127.0.0.1:{server.port}"
    write_config(
        config_dir,
        validating=_fill_urls(validating, base),
        mutating=_fill_urls(mutating, base),
        namespaces=namespaces,
        api_version=api_version,
    )
    running = await start_gateway(nursery, config_dir, *gateway_args)
    client = await gateway_client(running, protocol=protocol)
    sent = doc if doc is not None else review(version=caller_version)
    if doc is not None and caller_version != "v1":
        sent = {**doc, "apiVersion": f"admission.k8s.io/{caller_version}"}
    started = trio.current_time()
    resp = await send_review(client, endpoint, sent, timeout=timeout)
    elapsed = trio.current_time() - started
    await client.aclose()
    running.shutdown()
    return Outcome(resp, sent, server, elapsed)


class Expect:
    """What a scenario must produce; only the fields given are checked."""

    def __init__(
        self,
        *,
        allowed: bool,
        code: int | None = None,
        reason: str | None = None,
        message: str | None = None,
        message_prefix: str | None = None,
        message_suffix: str | None = None,
        calls: int | None = None,
        warnings: list[str] | None = None,
        annotations: dict[str, str] | None = None,
        no_annotations: tuple[str, ...] = (),
        patch: list[dict[str, Any]] | bool | None = False,  # False: not checked; None: no patch
    ) -> None:
        self.allowed, self.code, self.reason = allowed, code, reason
        self.message, self.message_prefix, self.message_suffix = message, message_prefix, message_suffix
        self.calls, self.warnings, self.annotations = calls, warnings, annotations
        self.no_annotations, self.patch = no_annotations, patch

    def check(self, o: Outcome) -> None:
        assert o.http_status == 200, f"HTTP {o.http_status}: {o.body}"
        assert o.body["apiVersion"] == o.sent["apiVersion"]
        assert o.body["kind"] == "AdmissionReview"
        assert o.response["uid"] == o.sent["request"]["uid"]
        assert o.allowed is self.allowed, o.response
        if self.allowed:
            assert "status" not in o.response, o.response  # ERR-10: allowed replies carry no status
        else:
            assert o.status.get("status") == "Failure"
            assert o.status.get("code", 0) >= 400
            assert o.message
        if self.code is not None:
            assert o.status.get("code") == self.code, o.status
        if self.reason is not None:
            assert o.status.get("reason") == self.reason, o.status
        if self.message is not None:
            assert o.message == self.message
        if self.message_prefix is not None:
            assert o.message.startswith(self.message_prefix), o.message
        if self.message_suffix is not None:
            assert o.message.endswith(self.message_suffix), o.message
        if self.calls is not None:
            assert len(o.calls) == self.calls, [c.path for c in o.calls]
        if self.warnings is not None:
            assert o.warnings == self.warnings
        if self.annotations is not None:
            for key, value in self.annotations.items():
                assert o.annotations.get(key) == value, (key, o.annotations)
        for key in self.no_annotations:
            assert key not in o.annotations, o.annotations
        if self.patch is not False:
            assert o.patch == self.patch, o.patch
        if not self.allowed or o.sent["request"]["operation"] == "DELETE":
            assert "patch" not in o.response
