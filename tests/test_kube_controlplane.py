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
