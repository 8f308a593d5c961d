"""The shipped manifests start as shipped (issue 33 §4): every overlay, rendered by the real kustomize
after its documented steps, runs the gateway with exactly the rendered container arguments and the
rendered ConfigMap as its configuration, and the readiness probe the Deployment declares answers 200
(what `kubectl rollout status` waits for).

Only what a pod gets from its node is provided by the test: the mounted volumes become directories
(the ConfigMap's keys as files, the TLS Secret's keys as files), the listening ports become free
loopback ports, and `--namespace-source cluster` reaches the real control plane through
`--kubeconfig` (no in-cluster service account here).
"""

from __future__ import annotations

import base64
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from tests.support.controlplane import ControlPlane, free_port
from tests.support.processes import stop_process
from tests.support.tools import require_tool

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"

# overlay -> its documented steps before `kubectl apply -k` (docs/deploy.md, README "Deploying")
OVERLAYS = {
    "deploy/overlays/production": [],
    "deploy/cert-manager": [],
    "deploy": [["bash", "scripts/gen-certs.sh", "-o", "{deploy}"]],
}


def _render(kubectl: str, directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=True, timeout=120
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _ready(url: str, context: ssl.SSLContext) -> int:
    try:
        with urllib.request.urlopen(url, context=context, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ssl.SSLError):
        return 0


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_every_overlay_starts_as_shipped(overlay: str, tmp_path: Path, control_plane: ControlPlane) -> None:
    kubectl = require_tool("kubectl")
    copy = tmp_path / "repo"
    shutil.copytree(DEPLOY, copy / "deploy", ignore=shutil.ignore_patterns("tls-secret.yaml", "certs"))
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    for step in OVERLAYS[overlay]:
        argv = [a.replace("{deploy}", str(copy / "deploy")) for a in step]
        subprocess.run(argv, cwd=copy, check=True, capture_output=True, timeout=120)
    docs = _render(kubectl, copy / overlay)
    deployment = _one(docs, "Deployment", "webhook-gateway")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}

    # The volumes, as the kubelet would mount them.
    mounts: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        where = tmp_path / "mounts" / mount["name"]
        where.mkdir(parents=True)
        mounts[mount["mountPath"]] = where
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            for key, text in _one(docs, "ConfigMap", volume["configMap"]["name"])["data"].items():
                (where / key).write_text(text)
        elif "secret" in volume:
            name = volume["secret"]["secretName"]
            rendered = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name]
            if rendered:  # scripts/gen-certs.sh wrote it
                for key, value in rendered[0]["data"].items():
                    (where / key).write_bytes(base64.b64decode(value))
            else:  # cert-manager issues it in the cluster: a certificate for the same Service name
                ca = trustme.CA()
                leaf = ca.issue_cert("webhook-gateway.webhook-gateway.svc")
                leaf.cert_chain_pems[0].write_to_path(str(where / "tls.crt"))
                leaf.private_key_pem.write_to_path(str(where / "tls.key"))
                ca.cert_pem.write_to_path(str(where / "ca.crt"))
    assert (mounts["/etc/webhook-gateway/config"] / "example.yaml").is_file(), "the shipped backends"

    # The rendered arguments; ports on loopback, paths to the mounts, the cluster through a kubeconfig.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    free = {port: free_port() for port in ports.values()}
    args: list[str] = []
    for given in container["args"]:
        arg = given
        inside = [p for p in mounts if arg == p or arg.startswith(p + "/")]
        if inside:
            path = max(inside, key=len)
            arg = str(mounts[path]) + arg[len(path) :]
        args.append(next((f"127.0.0.1:{free[p]}" for p in free if arg == f"0.0.0.0:{p}"), arg))
    assert "--kubeconfig" not in args
    args += ["--kubeconfig", str(control_plane.kubeconfig)]
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        probe = container["readinessProbe"]["httpGet"]
        # HTTPS on the webhook port, or plain HTTP on the metrics port when the overlay requires
        # the apiserver's client certificate there (components/client-auth): the kubelet has none.
        scheme = probe["scheme"].lower()
        assert scheme == ("http" if "--client-ca" in args else "https"), probe
        url = f"{scheme}://127.0.0.1:{free[ports[probe['port']]]}{probe['path']}"
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the kubelet's probes do not verify either
        deadline = time.monotonic() + 60
        status = 0
        while status != 200 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            status = _ready(url, context)
        assert status == 200, f"{overlay}: readiness {status}, exit {proc.poll()}:\n{log.read_text()[-3000:]}"
    finally:
        stop_process(proc)
