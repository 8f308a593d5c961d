"""A real Kubernetes control plane for tests: etcd + kube-apiserver + kubectl from ``KUBEBUILDER_ASSETS``.

``start_control_plane(workdir)`` starts etcd and kube-apiserver on free loopback ports in ``workdir``
(certificates, tokens, audit policy and log, kubeconfig, data and process logs all live there) and
returns a ``ControlPlane`` once ``/readyz`` answers 200; ``stop()`` ends both processes by PID.
Fixtures, shared by every test that uses them (a plane takes ~320 MB and 3-5 s of CPU to start):

- ``control_plane`` (session scope): the one plane most tests share; isolate by namespace.
- ``kube_namespace`` (function scope): a fresh namespace in it, deleted (and finalized) afterwards.
- ``control_plane_running(workdir, extra_apiserver_args=...)``: a plane of a module's own, for tests
  that restart or reconfigure it (tests/test_kube_reflector.py).

What a test gets (``ControlPlane``): ``url`` (``https://127.0.0.1:PORT``), ``token`` (an admin in
``system:masters``), ``ca_pem``/``ca_path`` (the serving CA), ``kubeconfig`` (a file for kubectl and for
``webhook-gateway --kubeconfig``), ``kubectl(*args)``, ``api(method, path, body)`` (a plain HTTPS
call with the token), ``audit`` (the apiserver's audit log: events with their admission annotations),
``create_namespace()``/``delete_namespace()``, ``etcd_url``, ``compact()`` (compacts etcd at its
current revision through etcd's own JSON gateway, as the apiserver's compactor does every
``--etcd-compaction-interval``), ``restart_apiserver(*extra_args)``.

Without ``KUBEBUILDER_ASSETS`` every test using these fixtures skips with one line saying how to get
the binaries (``tests/support/tools.py``); CI sets it and turns that skip into a failure.
The binaries are never copied: they run from the assets directory.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from loadtests.processes import free_port
from tests.support.tools import require_kube_assets

START_TIMEOUT = 60.0  # seconds for etcd and then the apiserver to become ready (3-5 s on an idle machine)
STOP_TIMEOUT = 10.0

# Every write, at Metadata level: what the admission chain annotated (webhook decisions, the
# gateway's own annotations, patches) is in each event's "annotations". Reads are left out: the
# gateway's watches and Lease renewals would otherwise fill the log.
AUDIT_POLICY: dict[str, Any] = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "verbs": ["get", "list", "watch"]},
        {"level": "None", "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}]},
        {"level": "Metadata"},
    ],
}


def stop_process(
    proc: subprocess.Popen[bytes] | None, *, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT
) -> int | None:
    """End one process by its PID: ``sig``, then SIGKILL if it does not exit in time; its exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
    return proc.returncode


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class AuditLog:
    """The apiserver's audit log (JSON lines, one ``audit.k8s.io/v1`` Event each).

    ``mark()`` remembers where the log ends now; ``events(since=mark)`` reads what was written after
    it; ``wait_for(predicate)`` waits (the log is written as the request completes) for a matching one.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(since)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], *, since: int = 0, timeout: float = 10.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events(since):
                if predicate(event):
                    return event
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching audit event in {self.path} within {timeout} s")
            time.sleep(0.05)


@dataclass
class ControlPlane:
    """A running etcd + kube-apiserver; see the module docstring."""

    assets: Path
    workdir: Path
    url: str
    token: str
    ca_pem: bytes
    ca_path: Path
    kubeconfig: Path
    etcd_url: str
    audit: AuditLog
    apiserver_args: list[str]
    etcd: subprocess.Popen[bytes] | None = None
    apiserver: subprocess.Popen[bytes] | None = None
    _ssl: ssl.SSLContext = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ssl = ssl.create_default_context(cadata=self.ca_pem.decode())

    # --- clients -------------------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the assets' kubectl against this plane; ``check`` raises with its stderr on failure."""
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBECACHEDIR": str(self.workdir / "kubecache"),
        }
        proc = subprocess.run(
            [str(self.assets / "kubectl"), *args],
            input=input,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def api(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        """One HTTPS request with the admin token: (status, decoded JSON body or None)."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self._ssl, timeout=30) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        return status, (json.loads(raw) if raw else None)

    def wait_established(self, name: str, *, timeout: float = 60.0) -> None:
        """Wait until the CRD ``name`` is served (its ``Established`` condition is True).

        Not ``kubectl wait --for=condition=Established``: it fails at once, instead of waiting, when
        it reads a CRD whose ``status.conditions`` is not set yet (kubernetes/kubernetes#66439).
        """
        deadline = time.monotonic() + timeout
        conditions: Any = None
        while True:
            status, crd = self.api("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            if status == 200:
                conditions = (crd.get("status") or {}).get("conditions") or []
                if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
                    return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"CRD {name} not Established within {timeout} s (HTTP {status}, conditions {conditions})"
                )
            time.sleep(0.05)

    def create_namespace(self, name: str | None = None, labels: dict[str, str] | None = None) -> str:
        name = name or f"t-{uuid.uuid4().hex[:10]}"
        status, body = self.api(
            "POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels or {}}}
        )
        assert status == 201, body
        return name

    def delete_namespace(self, name: str) -> None:
        """Delete a namespace and finalize it, as the namespace controller (not running here) would
        once the namespace is empty: without that it stays Terminating for ever."""
        self.api("DELETE", f"/api/v1/namespaces/{name}")
        status, current = self.api("GET", f"/api/v1/namespaces/{name}")
        if status == 200:
            current["spec"]["finalizers"] = []
            self.api("PUT", f"/api/v1/namespaces/{name}/finalize", current)

    # --- etcd ----------------------------------------------------------------------------------

    def etcd_call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """A call to etcd's v3 JSON gateway (``/v3/kv/range``, ``/v3/kv/compaction`` ...)."""
        req = urllib.request.Request(
            f"{self.etcd_url}/v3/{method}", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            result: dict[str, Any] = json.loads(resp.read())
            return result

    def etcd_revision(self) -> int:
        key = base64.b64encode(b"/registry/").decode()
        return int(
            self.etcd_call("kv/range", {"key": key, "limit": 1, "keys_only": True})["header"]["revision"]
        )

    def compact(self) -> int:
        """Compact etcd at its current revision (physically), as the apiserver's compactor does every
        ``--etcd-compaction-interval``; a watch from any older resourceVersion then fails with 410."""
        revision = self.etcd_revision()
        self.etcd_call("kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    # --- lifecycle -----------------------------------------------------------------------------

    def start_etcd(self) -> None:
        client, peer = self.etcd_url, f"http://127.0.0.1:{free_port()}"
        self.etcd = spawn(
            [
                str(self.assets / "etcd"),
                "--name",
                "default",
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"default={peer}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
            self.workdir / "etcd.log",
        )
        _wait_ready(
            self.etcd, self.workdir / "etcd.log", lambda: http_status(f"{client}/health", None) == 200, "etcd"
        )

    def start_apiserver(self) -> None:
        self.apiserver = spawn(
            [str(self.assets / "kube-apiserver"), *self.apiserver_args], self.workdir / "apiserver.log"
        )
        _wait_ready(
            self.apiserver,
            self.workdir / "apiserver.log",
            lambda: http_status(f"{self.url}/readyz", self._ssl, self.token) == 200,
            "kube-apiserver",
        )

    def restart_apiserver(self, *extra_args: str) -> None:
        """Kill kube-apiserver and start it again on the same port and etcd (with ``extra_args`` this
        time): every watch breaks, and the new instance's watch cache starts at etcd's current
        revision, so a watch from an older resourceVersion gets 410 (as after an apiserver upgrade).
        SIGKILL, as a crash: on SIGTERM the apiserver waits more than 10 s for open watches."""
        stop_process(self.apiserver, sig=signal.SIGKILL)
        self.apiserver = None
        base = self.apiserver_args
        self.apiserver_args = [*base, *extra_args]
        try:
            self.start_apiserver()
        finally:
            self.apiserver_args = base

    def stop(self) -> None:
        stop_process(self.apiserver)
        stop_process(self.etcd)


def spawn(
    argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start a process with its output appended to ``log``, in a session of its own (a Ctrl-C at the
    terminal reaches pytest, which then stops it by PID)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True,
        )  # fmt: skip


def http_status(url: str, context: ssl.SSLContext | None, token: str | None = None) -> int:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, context=context, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ssl.SSLError):
        return 0


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {proc.returncode} while starting; {log}:\n{log_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {START_TIMEOUT} s; {log}:\n{log_tail(log)}")
        time.sleep(0.1)


def start_control_plane(
    workdir: Path, *, assets: Path, extra_apiserver_args: tuple[str, ...] = ()
) -> ControlPlane:
    """Start etcd and kube-apiserver in ``workdir``; on any failure both are stopped before raising."""
    workdir.mkdir(parents=True, exist_ok=True)
    pki = workdir / "pki"
    pki.mkdir(exist_ok=True)
    ca = trustme.CA()
    serving = ca.issue_cert("127.0.0.1", "localhost")
    ca_path = pki / "ca.crt"
    ca.cert_pem.write_to_path(str(ca_path))
    serving.cert_chain_pems[0].write_to_path(str(pki / "apiserver.crt"))
    serving.private_key_pem.write_to_path(str(pki / "apiserver.key"))
    sa_key = ec.generate_private_key(ec.SECP256R1())
    (pki / "sa.key").write_bytes(
        sa_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (pki / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    token = uuid.uuid4().hex
    (pki / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    (workdir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
    secure_port = free_port()
    url = f"https://127.0.0.1:{secure_port}"
    etcd_url = f"http://127.0.0.1:{free_port()}"
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "test", "cluster": {"server": url, "certificate-authority": str(ca_path)}}
                ],
                "users": [{"name": "admin", "user": {"token": token}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
                "current-context": "test",
            }
        )
    )
    args = [
        "--etcd-servers",
        etcd_url,
        "--bind-address",
        "127.0.0.1",
        "--advertise-address",
        "127.0.0.1",
        "--secure-port",
        str(secure_port),
        "--cert-dir",
        str(pki),
        "--tls-cert-file",
        str(pki / "apiserver.crt"),
        "--tls-private-key-file",
        str(pki / "apiserver.key"),
        "--client-ca-file",
        str(ca_path),
        "--token-auth-file",
        str(pki / "tokens.csv"),
        "--service-account-issuer",
        "https://kubernetes.default.svc",
        "--service-account-key-file",
        str(pki / "sa.pub"),
        "--service-account-signing-key-file",
        str(pki / "sa.key"),
        "--service-cluster-ip-range",
        "10.0.0.0/24",
        "--authorization-mode",
        "RBAC",
        "--disable-admission-plugins",
        "ServiceAccount",
        "--endpoint-reconciler-type",
        "none",
        "--audit-policy-file",
        str(workdir / "audit-policy.yaml"),
        "--audit-log-path",
        str(workdir / "audit.log"),
        "--audit-log-mode",
        "blocking",
        *extra_apiserver_args,
    ]
    plane = ControlPlane(
        assets=assets,
        workdir=workdir,
        url=url,
        token=token,
        ca_pem=ca.cert_pem.bytes(),
        ca_path=ca_path,
        kubeconfig=kubeconfig,
        etcd_url=etcd_url,
        audit=AuditLog(workdir / "audit.log"),
        apiserver_args=args,
    )
    try:
        plane.start_etcd()
        plane.start_apiserver()
    except BaseException:
        plane.stop()
        raise
    return plane


@contextlib.contextmanager
def control_plane_running(
    workdir: Path, *, extra_apiserver_args: tuple[str, ...] = ()
) -> Iterator[ControlPlane]:
    """A control plane for the ``with`` block (skips without ``KUBEBUILDER_ASSETS``)."""
    assets = require_kube_assets()
    plane = start_control_plane(workdir, assets=assets, extra_apiserver_args=extra_apiserver_args)
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """The session's shared control plane; tests isolate themselves by namespace (``kube_namespace``)."""
    with control_plane_running(tmp_path_factory.mktemp("controlplane")) as plane:
        yield plane


@pytest.fixture
def kube_namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace in the shared plane, deleted (and finalized) after the test."""
    name = control_plane.create_namespace()
    yield name
    control_plane.delete_namespace(name)
