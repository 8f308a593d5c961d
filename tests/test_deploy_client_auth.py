"""Only kube-apiserver may call the gateway: client certificates (deploy/components/client-auth,
docs/deploy.md "Authenticate the kube-apiserver").

- The shipped manifests: the production overlay (cert-manager) and deploy/ with gen-certs.sh both
  require a client certificate, probe on the metrics port, and (cert-manager) issue the apiserver's.
- gen-certs.sh's certificates through real sockets: the apiserver's client certificate (from the
  kubeconfig the scripts write) is accepted; no certificate, the serving certificate, or one from
  another CA are refused in the handshake.
- The real kube-apiserver, given the AdmissionConfiguration that scripts/apiserver-admission-config.sh
  writes, calls the gateway (which requires client certificates) with its certificate: reviews are
  decided by the gateway's backend.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from tests.support.controlplane import ControlPlane, control_plane_running, free_port
from tests.support.gateway import hook, write_config
from tests.support.processes import TLSFiles, start_backends, start_gateway_process

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SERVICE_NAME = "webhook-gateway.webhook-gateway.svc"

Doc = dict[str, Any]


def _render(directory: Path) -> list[Doc]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _gen_certs(out: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen-certs.sh"), "-o", str(out)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )


def _openssl_deploy(tmp_path: Path, components: list[str]) -> Path:
    """deploy/ completed with gen-certs.sh, with ``components`` added to its kustomization."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    _gen_certs(copy)
    kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
    kustomization["components"] = [f"components/{c}" for c in components]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return copy


def _gateway(docs: list[Doc]) -> Doc:
    deployment = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "webhook-gateway"
    )
    containers: list[Doc] = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "gateway")


def _variant(name: str, tmp_path: Path) -> list[Doc]:
    if name == "production":
        return _render(DEPLOY / "overlays" / "production")
    return _render(_openssl_deploy(tmp_path, ["client-auth"]))


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(
            "production", id="deploy/overlays/production (cert-manager) requires the apiserver's certificate"
        ),
        pytest.param("openssl", id="deploy/ with components/client-auth (gen-certs.sh) requires it too"),
    ],
)
def test_the_manifests_require_a_client_certificate(tmp_path: Path, variant: str) -> None:
    docs = _variant(variant, tmp_path)
    gateway = _gateway(docs)
    args = gateway["args"]
    assert args[args.index("--client-ca") + 1] == "/etc/webhook-gateway/tls/ca.crt"
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    assert mounts["tls"] == "/etc/webhook-gateway/tls"
    # The kubelet presents no certificate: every probe goes to the plain metrics port.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert gateway[probe]["httpGet"]["port"] == "metrics", probe
        assert gateway[probe]["httpGet"]["scheme"] == "HTTP", probe
    assert {"metrics", "https"} <= {p["name"] for p in gateway["ports"]}
    certificates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    if variant == "production":
        client = certificates["webhook-gateway-apiserver-client"]["spec"]
        assert client["usages"] == ["client auth", "digital signature"]
        assert client["issuerRef"]["name"] == "webhook-gateway-ca"
        assert client["secretName"] == "webhook-gateway-apiserver-client"
        serving = certificates["webhook-gateway-serving"]["spec"]
        assert "client auth" not in serving["usages"]  # the serving certificate cannot log in
    else:
        assert not certificates


# --- gen-certs.sh's certificates through real sockets --------------------------------------------


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """gen-certs.sh's output, and the gateway serving with its certificate and requiring client ones."""
    out = tmp_path_factory.mktemp("scripted")
    _gen_certs(out)
    certs = out / "certs"
    config = out / "config"
    write_config(config, validating={"v": [hook("v.example.com", "http://127.0.0.1:9/never")]})
    port = free_port()
    log = (out / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "gateway", "--config", str(config), "--bind", f"127.0.0.1:{port}"),
            *("--certfile", str(certs / "tls.crt"), "--keyfile", str(certs / "tls.key")),
            *("--client-ca", str(certs / "ca.crt"), "--workers", "1"),
        ],
        cwd=ROOT,
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 30
        while _status(port, certs, _kubeconfig_client(certs)) != 200:
            assert proc.poll() is None and time.monotonic() < deadline, (out / "gateway.log").read_text()
            time.sleep(0.2)
        yield certs, port
    finally:
        proc.kill()
        proc.wait()


def _kubeconfig_client(certs: Path) -> tuple[Path, str]:
    """The client certificate and key of the apiserver's kubeconfig (as files), and its user's name."""
    kubeconfig = yaml.safe_load((certs / "admission-kubeconfig.yaml").read_text())
    (user,) = kubeconfig["users"]
    pem = base64.b64decode(user["user"]["client-certificate-data"]) + base64.b64decode(
        user["user"]["client-key-data"]
    )
    path = certs / "from-kubeconfig.pem"
    path.write_bytes(pem)
    return path, user["name"]


def _status(port: int, certs: Path, client: tuple[Path, str] | Path | None) -> int:
    """GET /healthz over TLS as the apiserver would verify the gateway (its Service name); 0 if refused."""
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if isinstance(client, tuple):
        client = client[0]
    if client is not None:
        context.load_cert_chain(str(client))
    try:
        with context.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname=SERVICE_NAME
        ) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
            reply = s.recv(4096)  # TLS 1.3: a refused certificate shows here, after the handshake
    except (ssl.SSLError, OSError):
        return 0
    return int(reply.split(b" ", 2)[1]) if reply else 0


def test_the_scripted_apiserver_kubeconfig_names_the_gateway(scripted: tuple[Path, int]) -> None:
    certs, _ = scripted
    assert _kubeconfig_client(certs)[1] == SERVICE_NAME
    admission = yaml.safe_load((certs / "admission-configuration.yaml").read_text())
    assert admission["kind"] == "AdmissionConfiguration"
    assert {p["name"] for p in admission["plugins"]} == {
        "ValidatingAdmissionWebhook",
        "MutatingAdmissionWebhook",
    }
    assert {p["configuration"]["kubeConfigFile"] for p in admission["plugins"]} == {
        "/etc/kubernetes/webhook-gateway/admission-kubeconfig.yaml"
    }


CLIENTS = [
    pytest.param("apiserver", 200, id="the apiserver's client certificate (from its kubeconfig) is accepted"),
    pytest.param("none", 0, id="no client certificate: refused in the handshake"),
    pytest.param("serving", 0, id="the serving certificate (server authentication only) cannot log in"),
    pytest.param("other-ca", 0, id="a client certificate from another CA is refused"),
]


@pytest.mark.parametrize(("client", "status"), CLIENTS)
def test_only_the_apiserver_certificate_gets_in(
    scripted: tuple[Path, int], tmp_path: Path, client: str, status: int
) -> None:
    certs, port = scripted
    presented: tuple[Path, str] | Path | None = None
    if client == "apiserver":
        presented = _kubeconfig_client(certs)
    elif client == "serving":
        presented = tmp_path / "serving.pem"
        presented.write_bytes((certs / "tls.crt").read_bytes() + (certs / "tls.key").read_bytes())
    elif client == "other-ca":
        presented = tmp_path / "other.pem"
        trustme.CA().issue_cert("kube-apiserver").private_key_and_cert_chain_pem.write_to_path(presented)
    assert _status(port, certs, presented) == status


# --- the real kube-apiserver --------------------------------------------------------------------


def test_the_kube_apiserver_calls_the_gateway_with_its_client_certificate(
    tmp_path: Path, control_plane: ControlPlane
) -> None:
    """kube-apiserver started with the AdmissionConfiguration that scripts/apiserver-admission-config.sh
    writes (a kubeconfig whose user is named after the gateway, here HOST:PORT of its URL): a ConfigMap
    labelled deny=yes is refused by the gateway's backend, another one is stored; the gateway requires
    client certificates, so every review it decided came through the apiserver's. The shared control
    plane, started without that configuration, is refused in the handshake (and its registration's
    failurePolicy Fail refuses the ConfigMap)."""
    tls = TLSFiles(tmp_path / "tls")
    client = tls.ca.issue_cert("kube-apiserver")  # trustme: client authentication among its usages
    client.cert_chain_pems[0].write_to_path(str(tmp_path / "client.crt"))
    client.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    port = free_port()
    apiserver_files = tmp_path / "apiserver"
    subprocess.run(
        [
            *("bash", str(ROOT / "scripts" / "apiserver-admission-config.sh")),
            *("--cert", str(tmp_path / "client.crt"), "--key", str(tmp_path / "client.key")),
            *("--name", f"127.0.0.1:{port}", "--dir", str(apiserver_files), "-o", str(apiserver_files)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    backends = start_backends(tmp_path / "backends", tls)
    config = tmp_path / "config"
    run = uuid.uuid4().hex[:8]
    deny = hook(
        "deny.client-auth.example.com",
        backends.url("/deny/403/refused%20by%20the%20backend"),
        objectSelector={"matchLabels": {"deny": "yes", "client-auth-run": run}},
        timeoutSeconds=5,
    )
    deny["clientConfig"]["caBundle"] = base64.b64encode(tls.ca.cert_pem.bytes()).decode()
    deny["rules"] = [
        {"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"]}
    ]
    write_config(config, validating={"client-auth": [deny]})
    with control_plane_running(
        tmp_path / "plane",
        extra_apiserver_args=(
            "--admission-control-config-file",
            str(apiserver_files / "admission-configuration.yaml"),
        ),
    ) as plane:
        gateway = start_gateway_process(
            tmp_path / "gateway",
            config,
            tls,
            *("--client-ca", str(tls.ca_path), "--metrics-bind", f"127.0.0.1:{free_port()}"),
            port=port,
            wait_ready=False,
        )
        try:
            _wait_ready(port, tls, tmp_path / "client.crt", tmp_path / "client.key")
            registration = subprocess.run(
                [
                    *(sys.executable, "-m", "gateway", "registration", "--config", str(config)),
                    *("--name", f"client-auth-{run}", "--url", gateway.url, "--ca-bundle", str(tls.ca_path)),
                ],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
                cwd=ROOT,
            ).stdout
            plane.kubectl("apply", "-f", "-", input=registration)
            namespace = plane.create_namespace()
            denied = _create_configmap(plane, namespace, "denied", {"deny": "yes", "client-auth-run": run})
            assert denied.returncode != 0
            assert "refused by the backend" in denied.stderr, denied.stderr
            allowed = _create_configmap(plane, namespace, "allowed", {})
            assert allowed.returncode == 0, allowed.stderr
            events = [e for e in gateway.log_events() if e.get("event") == "review"]
            assert any(e.get("decision") == "denied" for e in events), events[-3:]
            # Without the admission configuration the apiserver presents no certificate. The shared
            # plane gets the registration for one namespace of its own only (other tests use it).
            other = control_plane.create_namespace()
            narrowed = _only_namespace(registration, other)
            control_plane.kubectl("apply", "-f", "-", input=narrowed)
            try:
                reviews = sum(1 for e in gateway.log_events() if e.get("event") == "review")
                refused = _create_configmap(
                    control_plane, other, "denied", {"deny": "yes", "client-auth-run": run}
                )
                assert refused.returncode != 0
                # Go names the gateway's TLS alert, or, when its HTTP/2 connection setup lost the
                # race with the alert, only that the connection could not be established.
                assert any(
                    m in refused.stderr
                    for m in ("tls: certificate required", "http2: client conn could not be established")
                ), refused.stderr
                assert sum(1 for e in gateway.log_events() if e.get("event") == "review") == reviews
            finally:
                control_plane.kubectl("delete", "-f", "-", input=narrowed, check=False)
                control_plane.delete_namespace(other)
        finally:
            gateway.stop()
            backends.stop()


def _only_namespace(registration: str, namespace: str) -> str:
    docs = [d for d in yaml.safe_load_all(registration) if d]
    for doc in docs:
        for webhook in doc.get("webhooks") or []:
            webhook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    return yaml.safe_dump_all(docs)


def _wait_ready(port: int, tls: TLSFiles, cert: Path, key: Path) -> None:
    context = tls.client_context()
    context.load_cert_chain(str(cert), str(key))
    deadline = time.monotonic() + 30
    while True:
        try:
            with context.wrap_socket(
                socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="127.0.0.1"
            ) as s:
                s.sendall(b"GET /readyz HTTP/1.1\r\nhost: gw\r\n\r\n")
                if b" 200 " in s.recv(4096):
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the gateway did not become ready"
        time.sleep(0.2)


def _create_configmap(
    plane: Any, namespace: str, name: str, labels: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
    }
    # The registration takes a moment to reach the apiserver's webhook cache: retry while it lets
    # a denied object through unreviewed (then delete it and try again).
    deadline = time.monotonic() + 20
    while True:
        result: subprocess.CompletedProcess[str] = plane.kubectl(
            "create", "-f", "-", input=json.dumps(doc), check=False
        )
        if result.returncode != 0 or not labels or time.monotonic() > deadline:
            return result
        plane.kubectl("-n", namespace, "delete", "configmap", name, check=False)
        time.sleep(0.5)
