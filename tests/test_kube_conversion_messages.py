"""CRD conversion verification messages against the real kube-apiserver, for a misbehaving conversion
webhook called directly and behind the gateway (CNV-11, CNV-13), kubectl as the client.

(The conversion path itself, behind the gateway: tests/test_kube_conversion.py.)

Each case is one CRD per phase, served in v1 (storage) and v2: ``direct`` points the live CRD at the
sample conversion backend itself, ``gateway`` at the gateway's ``/convert/<crd name>`` with the
gateway's copy of the CRD naming that backend. A CronTab is created in v1 (no conversion) and read
in v2 (a conversion call). The apiserver prints what it makes of the reply: for the direct phase
its own verification's words, behind the gateway the gateway's Failure message, wrapped once more
(GW-06).
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.controlplane import ControlPlane
from tests.support.processes import Backends, GatewayProcess, TLSFiles, start_backends, start_gateway_process

RUN = uuid.uuid4().hex[:6]
NAME = "nightly"


@dataclass(frozen=True)
class Case:
    behaviour: str  # the sample conversion backend's path below /convert
    direct: str  # what the apiserver says calling the backend itself
    gateway: str  # the gateway's reason, as the apiserver passes it on


CASES = {
    "missing-metadata": Case(
        "missing-metadata",
        # upstream compares the identity before it looks at the metadata itself; so does the gateway
        f"returned invalid object: must have the same name: {NAME} != ",
        f"returned invalid object at index 0: must have the same name: {NAME} != ",
    ),
    "non-string-label": Case(
        "non-string-label",
        "returned invalid metadata: metadata.labels[converted] must be a string, but is int64 in converted object",
        "returned invalid metadata in object at index 0: "
        "metadata.labels[converted] must be a string, but is int64 in converted object",
    ),
    "change-name": Case(
        "change-name",
        f"returned invalid object: must have the same name: {NAME} != {NAME}-changed",
        f"returned invalid object at index 0: must have the same name: {NAME} != {NAME}-changed",
    ),
}


def _crd(key: str, phase: str, url: str, ca_pem: bytes) -> dict[str, Any]:
    group = f"{key}-{phase}-{RUN}.conv.example.com"
    open_schema = {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"crontabs.{group}"},
        "spec": {
            "group": group,
            "names": {"plural": "crontabs", "singular": "crontab", "kind": "CronTab"},
            "scope": "Namespaced",
            "versions": [
                {"name": "v1", "served": True, "storage": True, "schema": open_schema},
                {"name": "v2", "served": True, "storage": False, "schema": open_schema},
            ],
            "conversion": {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {"url": url, "caBundle": base64.b64encode(ca_pem).decode()},
                    "conversionReviewVersions": ["v1"],
                },
            },
        },
    }


@dataclass
class Setup:
    plane: ControlPlane
    backends: Backends
    gateway: GatewayProcess
    namespace: str


@pytest.fixture(scope="module")
def setup(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work: Path = tmp_path_factory.mktemp("kube-conversion")
    tls = TLSFiles(work / "tls")
    ca = tls.ca.cert_pem.bytes()
    backends = start_backends(work / "backends", tls)
    config = work / "config"
    config.mkdir()
    copies = [_crd(key, "gateway", backends.url(f"/convert/{c.behaviour}"), ca) for key, c in CASES.items()]
    (config / "crds.yaml").write_text(yaml.safe_dump_all(copies))
    gateway = start_gateway_process(work / "gateway", config, tls)
    live = [_crd(key, "direct", backends.url(f"/convert/{c.behaviour}"), ca) for key, c in CASES.items()]
    live += [{**c, "spec": {**c["spec"], "conversion": _pointed_at(gateway, c, ca)}} for c in copies]
    try:
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(live))
        for doc in live:
            control_plane.wait_established(doc["metadata"]["name"])
        namespace = control_plane.create_namespace(f"conv-{RUN}")
        yield Setup(control_plane, backends, gateway, namespace)
    finally:
        gateway.stop()
        backends.stop()


def _pointed_at(gateway: GatewayProcess, copy: dict[str, Any], ca_pem: bytes) -> dict[str, Any]:
    url = f"{gateway.url}/convert/{copy['metadata']['name']}"
    client_config = {"url": url, "caBundle": base64.b64encode(ca_pem).decode()}
    return {
        "strategy": "Webhook",
        "webhook": {"clientConfig": client_config, "conversionReviewVersions": ["v1"]},
    }


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(
            "missing-metadata",
            id="CNV-11 an object without metadata: must have the same name, in the apiserver's words and order",
        ),
        pytest.param(
            "non-string-label",
            id="CNV-11 a non-string label value: must be a string, but is int64, in the apiserver's words",
        ),
        pytest.param(
            "change-name", id="CNV-11 a changed name: must have the same name, in the apiserver's words"
        ),
    ],
)
@pytest.mark.parametrize("phase", ["direct", "gateway"])
def test_the_apiservers_message_for_a_bad_converted_object(setup: Setup, key: str, phase: str) -> None:
    case = CASES[key]
    group = f"{key}-{phase}-{RUN}.conv.example.com"
    crontab = {
        "apiVersion": f"{group}/v1",
        "kind": "CronTab",
        "metadata": {"name": NAME, "namespace": setup.namespace, "labels": {"app": "cron"}},
        "spec": {"cronSpec": "0 1 * * *"},
    }
    setup.plane.kubectl("apply", "-f", "-", input=json.dumps(crontab))  # stored in v1: no conversion
    read = setup.plane.kubectl(
        "get", f"crontabs.v2.{group}", NAME, "-n", setup.namespace, "-o", "json", check=False
    )
    assert read.returncode != 0, read.stdout
    message = read.stderr.strip()
    assert f"conversion webhook for {group}/v1, Kind=CronTab" in message, message
    if phase == "direct":
        assert message.endswith(case.direct.rstrip()), message
    else:
        backend = setup.backends.url(f"/convert/{case.behaviour}")
        assert message.endswith(
            f'conversion webhook "crontabs.{group}" ({backend}) failed: {case.gateway}'.rstrip()
        ), message
