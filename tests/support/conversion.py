"""CRD conversion through the real gateway: CRD documents, ConversionReviews, a running setup.

``start_conversion`` writes CRDs pointing at the sample conversion backend (``gateway.devtools.conversion``,
served by the sample backend server), starts the gateway in-process with metrics on and returns a
``ConversionSetup`` that sends ConversionReviews over a real socket.
"""

from __future__ import annotations

import base64
import json
import ssl
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
import yaml

from gateway.devtools.backends import BackendServer, serve_backend
from gateway.observability import Observability
from gateway.server.serve import Running
from tests.support.client import Client, Resp
from tests.support.gateway import gateway_client, port_of

CRD_V1 = "apiextensions.k8s.io/v1"
CRD_V1BETA1 = "apiextensions.k8s.io/v1beta1"
CRD = "crontabs.stable.example.com"


def crd(
    name: str = CRD,
    *,
    url: str | None = None,
    service: dict[str, Any] | None = None,
    api_version: str = CRD_V1,
    review_versions: list[str] | None = None,
    annotations: dict[str, str] | None = None,
    ca_bundle: bytes | None = None,
    strategy: str = "Webhook",
) -> dict[str, Any]:
    """A CRD document with two versions whose conversion webhook is ``url`` (or ``service``)."""
    plural, _, group = name.partition(".")
    client_config: dict[str, Any] = {"url": url} if service is None else {"service": service}
    if ca_bundle is not None:
        client_config["caBundle"] = base64.b64encode(ca_bundle).decode()
    versions = review_versions if review_versions is not None else ["v1", "v1beta1"]
    conversion: dict[str, Any] = {"strategy": strategy}
    if strategy == "Webhook":
        if api_version == CRD_V1:
            conversion["webhook"] = {"clientConfig": client_config, "conversionReviewVersions": versions}
        else:
            conversion["webhookClientConfig"] = client_config
            conversion["conversionReviewVersions"] = versions
    metadata: dict[str, Any] = {"name": name}
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": api_version,
        "kind": "CustomResourceDefinition",
        "metadata": metadata,
        "spec": {
            "group": group,
            "names": {"plural": plural, "kind": "CronTab"},
            "scope": "Namespaced",
            "versions": [{"name": "v1", "served": True, "storage": True}, {"name": "v2", "served": True}],
            "conversion": conversion,
        },
    }


def crontab(
    name: str = "nightly", *, version: str = "v1", namespace: str = "ops", cron: str = "0 1 * * *"
) -> dict[str, Any]:
    spec: dict[str, Any] = {"cronSpec": cron} if version == "v1" else {"schedule": {"cron": cron}}
    return {
        "apiVersion": f"stable.example.com/{version}",
        "kind": "CronTab",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": {"app": name}},
        "spec": spec,
    }


def conversion_review(
    objects: list[Any], *, desired: str = "stable.example.com/v2", version: str = "v1", uid: str | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": f"apiextensions.k8s.io/{version}",
        "kind": "ConversionReview",
        "request": {"uid": uid or str(uuid.uuid4()), "desiredAPIVersion": desired, "objects": objects},
    }


def write_crds(directory: Path, docs: list[dict[str, Any]], filename: str = "crds.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / filename
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


@dataclass
class ConversionSetup:
    running: Running
    backend: BackendServer
    client: Client
    observer: Observability

    async def send(
        self,
        doc: dict[str, Any] | bytes,
        *,
        crd_name: str = CRD,
        timeout: str | None = "30s",
        method: str = "POST",
    ) -> Resp:
        path = f"/convert/{crd_name}" + (f"?timeout={timeout}" if timeout else "")
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        resp = await self.client.post(path, body, method=method)
        assert resp is not None, "the gateway closed the connection without answering"
        return resp

    def metrics(self) -> str:
        rendered = self.observer.metrics()
        assert rendered is not None
        return rendered[0].decode()


async def start_conversion(
    nursery: trio.Nursery,
    config_dir: Path,
    crds: list[dict[str, Any]] | None = None,
    *,
    backend_path: str = "/convert",
    backend_tls: ssl.SSLContext | None = None,
    extra_docs: list[dict[str, Any]] | None = None,
    gateway_args: tuple[str, ...] = (),
    protocol: str = "http1",
    client_ssl: ssl.SSLContext | None = None,
) -> ConversionSetup:
    """A sample conversion backend and the gateway; ``crds`` default to one CRD at ``backend_path``.

    In ``crds`` a url starting with ``__backend__`` is completed with the backend's base URL.
    """
    from gateway.cli import parse
    from gateway.server.serve import serve

    backend: BackendServer = await nursery.start(
        lambda task_status: serve_backend(ssl_context=backend_tls, task_status=task_status)
    )
    base = backend.url("").rstrip("/")
    docs = crds if crds is not None else [crd(url="__backend__" + backend_path)]
    filled = json.loads(json.dumps(docs).replace('"__backend__', '"' + base))
    write_crds(config_dir, [*filled, *(extra_docs or [])])
    observer = Observability(metrics=True, review_log=True)
    options = parse(
        ["--config", str(config_dir), "--bind", "127.0.0.1:0", "--drain-seconds", "0", *gateway_args]
    ).options
    running: Running = await nursery.start(
        lambda task_status: serve(options, observer=observer, handle_signals=False, task_status=task_status)
    )
    assert port_of(running.urls[0])
    client = await gateway_client(running, protocol=protocol, ssl_context=client_ssl)
    return ConversionSetup(running, backend, client, observer)
