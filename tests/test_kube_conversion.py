"""CRD conversion as the real kube-apiserver calls it, behind the gateway (CNV-01..11).

A CronTab CRD served in v1 and v2 (stored in v2) whose live ``spec.conversion`` points at the
gateway's ``/convert/<crd name>``; the gateway's copy of the CRD names the sample conversion backend
(``gateway.devtools.conversion``: v1 ``spec.cronSpec`` <-> v2 ``spec.schedule.cron``). kubectl creates
in v1, reads and lists in v2 and back, a watch in v1 sees a change made in v2, and a failing backend
surfaces in kubectl's error with the message docs/behaviour.md promises.
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.controlplane import ControlPlane
from tests.support.processes import Backends, GatewayProcess, TLSFiles, start_backends, start_gateway_process

CRD = "crontabs.stable.example.com"


def crd(client_config: dict[str, Any]) -> dict[str, Any]:
    schema = {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD, "annotations": {"webhook-gateway.io/conversion-timeout-seconds": "5"}},
        "spec": {
            "group": "stable.example.com",
            "names": {"plural": "crontabs", "singular": "crontab", "kind": "CronTab"},
            "scope": "Namespaced",
            "versions": [
                {"name": "v1", "served": True, "storage": False, "schema": schema},
                {"name": "v2", "served": True, "storage": True, "schema": schema},
            ],
            "conversion": {
                "strategy": "Webhook",
                "webhook": {"clientConfig": client_config, "conversionReviewVersions": ["v1", "v1beta1"]},
            },
        },
    }


def _ca(tls: TLSFiles) -> str:
    return base64.b64encode(tls.ca.cert_pem.bytes()).decode()


@pytest.fixture(scope="module")
def conversion(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ControlPlane, str, Path, GatewayProcess, Backends]]:
    workdir = tmp_path_factory.mktemp("conversion")
    tls = TLSFiles(workdir / "tls")
    backends = start_backends(workdir, tls)
    config = workdir / "config"
    config.mkdir()
    (config / "crontabs.yaml").write_text(
        yaml.safe_dump(crd({"url": backends.url("/convert"), "caBundle": _ca(tls)}))
    )
    gateway = start_gateway_process(workdir, config, tls)
    live = crd({"url": f"{gateway.url}/convert/{CRD}", "caBundle": _ca(tls)})
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(live))
    control_plane.kubectl("wait", "--for=condition=Established", f"crd/{CRD}")
    namespace = control_plane.create_namespace()
    try:
        yield control_plane, namespace, config, gateway, backends
    finally:
        control_plane.kubectl("delete", "--wait=false", f"crd/{CRD}", check=False)
        control_plane.delete_namespace(namespace)
        gateway.stop()
        backends.stop()


def _get(plane: ControlPlane, namespace: str, version: str, name: str) -> dict[str, Any]:
    done = plane.kubectl("-n", namespace, "get", f"crontabs.{version}.stable.example.com", name, "-o", "json")
    return dict(json.loads(done.stdout))


def test_created_in_v1_read_and_listed_in_both_versions(
    conversion: tuple[ControlPlane, str, Path, GatewayProcess, Backends],
) -> None:
    plane, namespace, _config, _gateway, _backends = conversion
    v1 = {
        "apiVersion": "stable.example.com/v1",
        "kind": "CronTab",
        "metadata": {"name": "nightly"},
        "spec": {"cronSpec": "0 3 * * *"},
    }
    plane.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(v1))  # stored as v2: converted
    assert _get(plane, namespace, "v2", "nightly")["spec"] == {"schedule": {"cron": "0 3 * * *"}}
    assert _get(plane, namespace, "v1", "nightly")["spec"] == {"cronSpec": "0 3 * * *"}
    listed = plane.kubectl("-n", namespace, "get", "crontabs.v1.stable.example.com", "-o", "json").stdout
    assert [item["spec"] for item in json.loads(listed)["items"]] == [{"cronSpec": "0 3 * * *"}]


def test_a_v1_watch_sees_a_change_made_in_v2(
    conversion: tuple[ControlPlane, str, Path, GatewayProcess, Backends],
) -> None:
    plane, namespace, _config, _gateway, _backends = conversion
    v2 = {
        "apiVersion": "stable.example.com/v2",
        "kind": "CronTab",
        "metadata": {"name": "hourly"},
        "spec": {"schedule": {"cron": "0 * * * *"}},
    }
    plane.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(v2))
    watch = subprocess.Popen(
        [str(plane.assets / "kubectl"), "--kubeconfig", str(plane.kubeconfig), "-n", namespace, "get",
         "crontabs.v1.stable.example.com", "hourly", "--watch", "--output-watch-events", "-o", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert watch.stdout is not None
        decoder, buffered = json.JSONDecoder(), ""

        def next_event() -> dict[str, Any]:
            nonlocal buffered
            while True:
                try:
                    event, end = decoder.raw_decode(buffered.lstrip())
                    buffered = buffered.lstrip()[end:]
                    return dict(event)
                except ValueError:
                    line = watch.stdout.readline()  # type: ignore[union-attr]
                    assert line, watch.stderr.read() if watch.stderr else "the watch ended"
                    buffered += line

        assert next_event()["object"]["spec"] == {"cronSpec": "0 * * * *"}
        v2["spec"] = {"schedule": {"cron": "30 * * * *"}}
        plane.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(v2))
        modified = next_event()
        assert (modified["type"], modified["object"]["spec"]) == ("MODIFIED", {"cronSpec": "30 * * * *"})
    finally:
        watch.kill()
        watch.wait()


def test_a_failing_backend_surfaces_in_kubectls_error(
    conversion: tuple[ControlPlane, str, Path, GatewayProcess, Backends],
) -> None:
    """CNV: the gateway answers Failure naming the CRD and the backend; the apiserver passes it on."""
    plane, namespace, config, gateway, backends = conversion
    v2 = {
        "apiVersion": "stable.example.com/v2",
        "kind": "CronTab",
        "metadata": {"name": "weekly"},
        "spec": {"schedule": {"cron": "0 0 * * 0"}},
    }
    plane.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(v2))
    broken = backends.url("/convert/wrong-count")
    (config / "crontabs.yaml").write_text(yaml.safe_dump(crd({"url": broken, "caBundle": _ca(backends.tls)})))
    try:
        deadline_tries = 50
        for _ in range(deadline_tries):  # the gateway reloads its configuration within a second
            done = plane.kubectl(
                "-n", namespace, "get", "crontabs.v1.stable.example.com", "weekly", check=False
            )
            if done.returncode != 0:
                break
        assert done.returncode == 1, done.stdout
        # The apiserver's own prefix, then the gateway's message (docs/behaviour.md, conversion).
        assert done.stderr.strip() == (
            "Error from server: conversion webhook for stable.example.com/v2, Kind=CronTab failed: "
            f'conversion webhook "{CRD}" ({broken}) failed: returned 2 objects, expected 1'
        ), done.stderr
        assert gateway.proc.poll() is None
    finally:
        (config / "crontabs.yaml").write_text(
            yaml.safe_dump(crd({"url": backends.url("/convert"), "caBundle": _ca(backends.tls)}))
        )
