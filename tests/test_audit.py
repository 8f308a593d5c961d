"""`webhook-gateway audit`: existing objects as dry-run reviews to the validating backends that allow dry
runs, denials grouped by backend; read-only against the (fake) apiserver, real backends (issue 16 §3)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import trio
import yaml

from gateway.devtools.backends import BackendServer, serve_backend
from tests.support.gateway import hook, pod, write_config
from tests.support.kubeapi import FakeKubeAPI, write_kubeconfig

REPO = Path(__file__).resolve().parent.parent
RULES = [
    {
        "operations": ["CREATE"],
        "apiGroups": ["", "apps"],
        "apiVersions": ["v1"],
        "resources": ["pods", "deployments"],
    }
]


async def audit(*args: str) -> tuple[int, str, str]:
    got = await trio.run_process(
        [sys.executable, "-m", "gateway", "audit", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=REPO,
        env=dict(os.environ),
    )
    return got.returncode, got.stdout.decode(), got.stderr.decode()


def _config(directory: Path, server: BackendServer) -> Path:
    base = f"http://127.0.0.1:{server.port}"
    write_config(
        directory,
        validating={
            "images": [hook("images.example.com", f"{base}/deny/403/untrusted%20registry", rules=RULES,
                            objectSelector={"matchLabels": {"trust": "none"}})],
            "prod": [hook("prod.example.com", f"{base}/deny/403/prod%20needs%20an%20owner", rules=RULES,
                          namespaceSelector={"matchLabels": {"env": "prod"}})],
            "quiet": [hook("allow.example.com", f"{base}/allow", rules=RULES)],
        },
        mutating={"m": [hook("mutator.example.com", f"{base}/patch/never", rules=RULES)]},
    )  # fmt: skip
    write_config(  # v1beta1 still accepts sideEffects Unknown: never dry-run safe, never called
        directory,
        validating={
            "zz": [hook("unknown-effects.example.com", f"{base}/deny", rules=RULES, sideEffects="Unknown")]
        },
        api_version="admissionregistration.k8s.io/v1beta1",
        filename="legacy.yaml",
    )
    return directory


def _cluster(api: FakeKubeAPI) -> None:
    api.put("shop", {"env": "prod"})
    api.put("dev", {"env": "dev"})
    api.add_object("/api/v1", "pods", pod("web", "shop", {"app": "web"}))
    api.add_object("/api/v1", "pods", pod("miner", "dev", {"trust": "none"}))
    api.add_object("/api/v1", "pods", pod("ok", "dev", {"app": "ok"}))
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "api", "namespace": "shop"},
                  "spec": {"replicas": 1}}  # fmt: skip
    api.add_object("/apis/apps/v1", "deployments", deployment)


async def test_audit_a_cluster_reports_denials_by_backend(
    nursery: trio.Nursery, tmp_path: Path, kube_api: FakeKubeAPI
) -> None:
    """Objects listed from the cluster (GET only) go to the validating backends that match and allow dry
    run, as dry runs; denials are grouped by backend; a backend with sideEffects Unknown is never called."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    config = _config(tmp_path / "c", server)
    _cluster(kube_api)
    kubeconfig = write_kubeconfig(kube_api, tmp_path / "kubeconfig")
    code, out, err = await audit(
        "--config",
        str(config),
        "--kubeconfig",
        str(kubeconfig),
        "--resource",
        "pods,deployments",
        "-o",
        "json",
    )
    assert code == 1, err  # objects would be denied
    report = json.loads(out)
    assert report["audited"] == 4
    assert report["summary"] == {"pass": 4, "fail": 3, "warn": 0, "error": 0, "skip": 0}
    denied = {b: sorted(f"{d['object']['kind']} {d['object']['namespace']}/{d['object']['name']}" for d in found)
              for b, found in report["denials"].items()}  # fmt: skip
    assert denied == {
        "images.example.com": ["Pod dev/miner"],
        "prod.example.com": ["Deployment shop/api", "Pod shop/web"],
    }
    assert report["denials"]["prod.example.com"][0]["message"].startswith(
        'admission webhook "prod.example.com" denied'
    )
    assert report["backends"]["skipped (sideEffects refuse dry run)"] == ["unknown-effects.example.com"]
    assert set(kube_api.methods) == {"GET"}  # never a write to the cluster
    assert server.calls and all(c.review["request"]["dryRun"] is True for c in server.calls)
    paths = {c.path.split("?")[0] for c in server.calls}
    assert "/deny" not in paths and "/patch/never" not in paths  # no Unknown side effects, no mutation


async def test_audit_one_namespace_as_policy_reports(
    nursery: trio.Nursery, tmp_path: Path, kube_api: FakeKubeAPI
) -> None:
    """--namespace lists only that namespace; -o policyreport gives a PolicyReport per namespace."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    config = _config(tmp_path / "c", server)
    _cluster(kube_api)
    kubeconfig = write_kubeconfig(kube_api, tmp_path / "kubeconfig")
    code, out, err = await audit(
        "--config", str(config), "--kubeconfig", str(kubeconfig), "--namespace", "dev", "-o", "policyreport"
    )
    assert code == 1, err
    (report,) = list(yaml.safe_load_all(out))
    assert (report["apiVersion"], report["kind"]) == ("wgpolicyk8s.io/v1alpha2", "PolicyReport")
    assert report["metadata"]["namespace"] == "dev"
    # miner: images denies, prod (env=prod only) skips it, allow passes; ok: allow passes
    assert report["summary"] == {"pass": 2, "fail": 1, "warn": 0, "error": 0, "skip": 0}
    results = sorted((r["resources"][0]["name"], r["policy"], r["result"]) for r in report["results"])
    assert results == [
        ("miner", "allow.example.com", "pass"),
        ("miner", "images.example.com", "fail"),
        ("ok", "allow.example.com", "pass"),
    ]
    assert any(path == "/api/v1/namespaces/dev/pods" for path, _, _ in kube_api.requests)


async def test_audit_resumes_from_its_state_file(
    nursery: trio.Nursery, tmp_path: Path, kube_api: FakeKubeAPI
) -> None:
    """--state: finished objects are recorded at once; a second run skips them and reviews only new ones,
    reporting the earlier findings too. Progress is shown on stderr."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    config = _config(tmp_path / "c", server)
    _cluster(kube_api)
    kubeconfig = write_kubeconfig(kube_api, tmp_path / "kubeconfig")
    state = tmp_path / "audit.state"
    args = [
        "--config",
        str(config),
        "--kubeconfig",
        str(kubeconfig),
        "--state",
        str(state),
        "--progress",
        "always",
    ]
    code, out, err = await audit(*args)
    assert code == 1, err
    assert "3/3 objects, 2 denied" in err
    assert len(state.read_text().splitlines()) == 3
    first_calls = len(server.calls)
    kube_api.add_object("/api/v1", "pods", pod("new", "shop", {"app": "new"}))
    code, out, err = await audit(*args)
    assert code == 1, err
    assert "1/1 objects" in err
    assert "audited 4 object(s) (3 from the state file)" in out
    assert "Pod dev/miner: " in out  # found by the first run, still reported
    assert len(server.calls) - first_calls == 2  # the new pod only: prod.example.com and allow.example.com


async def test_audit_objects_from_files(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Objects can come from YAML files (a List is unwrapped); namespace labels from Namespace objects there."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    config = _config(tmp_path / "c", server)
    objects = tmp_path / "objects.yaml"
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop", "labels": {"env": "prod"}}},
        {"apiVersion": "v1", "kind": "List", "items": [pod("a", "shop"), pod("b", "dev", {"trust": "none"})]},
    ]
    objects.write_text(yaml.safe_dump_all(docs))
    code, out, err = await audit("--config", str(config), str(objects), "--unknown-namespace", "emptyLabels")
    assert code == 1, err
    assert "images.example.com: would deny 1 object(s)\n  Pod dev/b: " in out
    assert "prod.example.com: would deny 1 object(s)\n  Pod shop/a: " in out


async def test_audit_needs_a_source(tmp_path: Path) -> None:
    code, _out, err = await audit("--config", str(tmp_path))
    assert code == 2 and "needs --kubeconfig FILE or object FILEs" in err
