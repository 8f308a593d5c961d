"""The operator's tools against the real kube-apiserver (issues 29 and 33): `audit` listing page by page,
its PolicyReports stored by `kubectl apply` once the wgpolicyk8s.io CRDs are installed, and the
registration `webhook-gateway registration` computes applied with kubectl: a gateway outage fails open
exactly where the backends would (the -fail/-ignore split), and what the registration excludes never
reaches the gateway — as `explain` says beforehand.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.controlplane import ControlPlane
from tests.support.processes import TLSFiles, start_backends, start_gateway_process

REPO = Path(__file__).resolve().parent.parent
CRDS = REPO / "tests" / "configs" / "wgpolicyk8s"
RUN = uuid.uuid4().hex[:8]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, check=False, timeout=120
    )


def _hook(name: str, url: str, ca: bytes, rules: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name,
        "clientConfig": {"url": url, "caBundle": base64.b64encode(ca).decode()},
        "rules": rules,
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "failurePolicy": "Fail",
        "timeoutSeconds": 5,
    }
    doc.update(fields)
    return doc


def _validating(name: str, *hooks: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": list(hooks),
    }


CONFIGMAPS = [
    {
        "operations": ["CREATE", "UPDATE"],
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "resources": ["configmaps"],
    }
]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return TLSFiles(tmp_path_factory.mktemp("operator-tls"))


def test_audit_lists_page_by_page_and_its_policy_reports_are_stored(
    control_plane: ControlPlane, tmp_path: Path, tls: TLSFiles
) -> None:
    """25 ConfigMaps listed 10 at a time (continue tokens of the real apiserver) are all audited; the
    PolicyReport (wgpolicyk8s.io/v1alpha2) `kubectl apply` stores carries every result and its counts."""
    backends = start_backends(tmp_path / "backends", tls)
    try:
        namespace = control_plane.create_namespace(f"audit-{RUN}", labels={"audit": RUN})
        items = [
            {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": f"cm-{i:02d}", "labels": {"trust": "none"} if i % 5 == 0 else {}},
             "data": {"i": str(i)}}
            for i in range(25)
        ]  # fmt: skip
        control_plane.kubectl(
            "-n",
            namespace,
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )
        config = tmp_path / "config"
        config.mkdir()
        ca = tls.ca.cert_pem.bytes()
        (config / "policies.yaml").write_text(
            yaml.safe_dump(
                _validating(
                    "audit-policies",
                    _hook("trust.example.com", backends.url("/deny/403/untrusted"), ca, CONFIGMAPS,
                          objectSelector={"matchLabels": {"trust": "none"}}),
                    _hook("allow.example.com", backends.url("/allow"), ca, CONFIGMAPS),
                )
            )
        )  # fmt: skip
        args = ["audit", "--config", str(config), "--kubeconfig", str(control_plane.kubeconfig),
                "--namespace", namespace, "--resource", "configmaps", "--chunk-size", "10"]  # fmt: skip
        got = _cli(*args, "-o", "json")
        assert got.returncode == 1, got.stderr  # 5 objects would be denied
        report = json.loads(got.stdout)
        names = sorted(e["object"]["name"] for e in report["objects"])
        assert [n for n in names if n.startswith("cm-")] == [f"cm-{i:02d}" for i in range(25)], "every page"
        # allow.example.com passes every object; trust.example.com matches 5 and denies them
        assert (report["summary"]["pass"], report["summary"]["fail"]) == (report["audited"], 5)

        reports = _cli(*args, "-o", "policyreport")
        assert reports.returncode == 1, reports.stderr
        (tmp_path / "report.yaml").write_text(reports.stdout)
        for crd in sorted(CRDS.glob("*.yaml")):
            control_plane.kubectl("apply", "--server-side", "-f", str(crd))
        control_plane.wait_established("policyreports.wgpolicyk8s.io")
        stored = control_plane.kubectl("apply", "-f", str(tmp_path / "report.yaml"), check=False)
        assert stored.returncode == 0, stored.stderr
        (kept,) = json.loads(
            control_plane.kubectl(
                "-n", namespace, "get", "policyreports.v1alpha2.wgpolicyk8s.io", "-o", "json"
            ).stdout
        )["items"]
        assert kept["summary"]["fail"] == 5 and kept["summary"]["pass"] == report["summary"]["pass"]
        assert len(kept["results"]) == report["summary"]["pass"] + 5
    finally:
        backends.stop()


def test_registration_keeps_each_backends_failure_semantics_through_an_outage(
    control_plane: ControlPlane, tmp_path: Path, tls: TLSFiles
) -> None:
    """A Gatekeeper-like wildcard backend with failurePolicy Ignore and a Fail backend on Secrets, behind
    the gateway with the computed registration applied: while the gateway runs, the registration keeps
    Leases from it (as explain says); with the gateway down, a ConfigMap is admitted (only the -ignore
    registration covers it) and a Secret is rejected by the -fail one."""
    backends = start_backends(tmp_path / "backends", tls)
    gateway = None
    registration = tmp_path / "registration.yaml"
    try:
        namespace = control_plane.create_namespace(f"split-{RUN}", labels={"split": RUN})
        ca = tls.ca.cert_pem.bytes()
        scope = {"namespaceSelector": {"matchLabels": {"split": RUN}}}
        config = tmp_path / "config"
        config.mkdir()
        (config / "policies.yaml").write_text(
            yaml.safe_dump_all([
                _validating("gatekeeper-like", _hook(
                    "everything.example.com", backends.url("/allow"), ca,
                    [{"operations": ["CREATE", "UPDATE"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*"]}],
                    failurePolicy="Ignore", **scope)),
                _validating("secrets-policy", _hook(
                    "secrets.example.com", backends.url("/allow"), ca,
                    [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["secrets"]}],
                    **scope)),
            ])
        )  # fmt: skip
        gateway = start_gateway_process(
            tmp_path / "gateway", config, tls,
            "--namespace-source", "cluster", "--kubeconfig", str(control_plane.kubeconfig),
        )  # fmt: skip
        printed = _cli("registration", "--config", str(config), "--name", f"split-{RUN}", "--url", gateway.url,
                       "--ca-bundle", str(tls.ca_path))  # fmt: skip
        assert printed.returncode == 0, printed.stderr
        registration.write_text(printed.stdout)
        hooks = {w["name"]: w for d in yaml.safe_load_all(printed.stdout) if d for w in d["webhooks"]}
        assert {n: w["failurePolicy"] for n, w in hooks.items()} == {
            "validate.webhook-gateway.io-fail": "Fail",
            "validate.webhook-gateway.io-ignore": "Ignore",
        }
        control_plane.kubectl("apply", "-f", str(registration))

        def create(kind: str, name: str) -> subprocess.CompletedProcess[str]:
            body = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name}, "data": {}}
            if kind == "Lease":
                body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
                        "spec": {"holderIdentity": "node-1"}}  # fmt: skip
            return control_plane.kubectl(
                "-n", namespace, "create", "-f", "-", input=json.dumps(body), check=False
            )

        # The apiserver's webhook configuration cache takes a moment after the apply.
        deadline = time.monotonic() + 20
        while not any(e.get("event") == "review" for e in gateway.log_events()):
            assert create("ConfigMap", f"warmup-{time.monotonic_ns()}").returncode == 0
            assert time.monotonic() < deadline, "the registration never reached the gateway"
            time.sleep(0.3)
        before = len([e for e in gateway.log_events() if e.get("event") == "review"])
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": "holder", "namespace": namespace}}  # fmt: skip
        (tmp_path / "lease.yaml").write_text(yaml.safe_dump(lease))
        explained = _cli("explain", "--config", str(config), "--registration", str(registration),
                         str(tmp_path / "lease.yaml"), "-o", "json")  # fmt: skip
        assert explained.returncode == 0, explained.stderr
        assert json.loads(explained.stdout)["verdict"]["outcome"] == "not sent"
        assert create("Lease", "holder").returncode == 0
        assert create("ConfigMap", "seen").returncode == 0
        time.sleep(1)
        reviews = [e for e in gateway.log_events() if e.get("event") == "review"][before:]
        assert [e["resource"] for e in reviews] == ["core/v1/configmaps"], (
            "the Lease never reached the gateway"
        )

        gateway.stop()
        gateway = None
        admitted = create("ConfigMap", "while-down")
        assert admitted.returncode == 0, admitted.stderr  # the -ignore registration fails open
        rejected = create("Secret", "while-down")
        assert rejected.returncode != 0
        assert 'failed calling webhook "validate.webhook-gateway.io-fail"' in rejected.stderr
    finally:
        control_plane.kubectl("delete", "--wait=false", "-f", str(registration), check=False)
        if gateway is not None:
            gateway.stop()
        backends.stop()
