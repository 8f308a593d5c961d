"""The control-plane fixture itself (tests/support/controlplane.py): what other tests rely on."""

from __future__ import annotations

import os
import urllib.error
from pathlib import Path

import pytest

from tests.support.controlplane import ControlPlane, start_control_plane
from tests.support.tools import require_kube_assets


def test_kubectl_from_the_assets_talks_to_the_plane_as_admin(control_plane: ControlPlane) -> None:
    version = control_plane.kubectl("version", "-o", "json").stdout
    assert '"gitVersion": "v1.36' in version  # client and server: the same assets directory
    assert control_plane.kubectl("auth", "can-i", "*", "*").stdout.strip() == "yes"


def test_writes_reach_the_audit_log_with_their_annotations(
    control_plane: ControlPlane, kube_namespace: str
) -> None:
    mark = control_plane.audit.mark()
    control_plane.kubectl("-n", kube_namespace, "create", "configmap", "audited", "--from-literal=a=b")
    event = control_plane.audit.wait_for(
        lambda e: e["verb"] == "create" and e.get("objectRef", {}).get("name") == "audited", since=mark
    )
    assert event["objectRef"]["namespace"] == kube_namespace
    assert event["annotations"]["authorization.k8s.io/decision"] == "allow"


@pytest.mark.parametrize(
    "exists",
    [
        pytest.param(True, id="wait_established returns once a CRD just created is Established"),
        pytest.param(False, id="wait_established fails naming a CRD that is not there when its time is up"),
    ],
)
def test_wait_established(control_plane: ControlPlane, exists: bool) -> None:
    name = f"w{os.urandom(4).hex()}s.wait.example.com"
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    if exists:
        plural, group = name.split(".", 1)
        body = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": name},
            "spec": {
                "group": group,
                "scope": "Namespaced",
                "names": {"plural": plural, "singular": plural[:-1], "kind": "W" + plural[1:-1]},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {"openAPIV3Schema": {"type": "object"}},
                    }
                ],
            },
        }
        assert control_plane.api("POST", path, body)[0] == 201
        try:
            control_plane.wait_established(name)  # at once after the create: no conditions yet, at first
            status, got = control_plane.api("GET", f"{path}/{name}")
        finally:
            control_plane.api("DELETE", f"{path}/{name}")  # the plane is shared by the session
        assert status == 200
        assert {"type": "Established", "status": "True"}.items() <= next(
            c for c in got["status"]["conditions"] if c["type"] == "Established"
        ).items()
    else:
        with pytest.raises(AssertionError, match=rf"CRD {name} not Established within 0.3 s \(HTTP 404"):
            control_plane.wait_established(name, timeout=0.3)


def test_compact_compacts_etcd_at_its_current_revision(
    control_plane: ControlPlane, kube_namespace: str
) -> None:
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    before = control_plane.etcd_revision()
    assert control_plane.api("POST", path, {"metadata": {"name": "bump"}})[0] == 201
    compacted = control_plane.compact()
    assert compacted > before
    with pytest.raises(urllib.error.HTTPError) as gone:  # etcd itself refuses the old revision
        control_plane.etcd_call("kv/range", {"key": "Lw==", "revision": str(before)})
    assert b"required revision has been compacted" in gone.value.read()


def _processes_in(directory: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(directory).encode() in cmdline:
                found.append(int(entry.name))
    return found


def test_a_plane_that_fails_to_start_leaves_no_process_behind(tmp_path: Path) -> None:
    assets = require_kube_assets()
    with pytest.raises(RuntimeError, match="kube-apiserver exited") as failed:
        start_control_plane(tmp_path / "cp", assets=assets, extra_apiserver_args=("--no-such-flag",))
    assert "unknown flag: --no-such-flag" in str(failed.value)  # the log's tail says why
    assert _processes_in(tmp_path) == [], "etcd still running"
    assert os.path.exists(tmp_path / "cp" / "etcd.log")
