"""The gateway and sample backends as separate processes, as an operator runs them beside a cluster.

Tests against the real control plane use these instead of the in-process servers: kube-apiserver
calls them over real TLS, and a test can block on ``kubectl`` while they answer. Each process is
started with its output in a log file, waited for until it serves, and stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trustme

from tests.support.controlplane import free_port, http_status, log_tail, spawn, stop_process

READY_TIMEOUT = 30.0


@dataclass
class TLSFiles:
    """A throwaway CA and a serving certificate for 127.0.0.1, as files."""

    directory: Path
    ca: trustme.CA = field(default_factory=trustme.CA)

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        leaf = self.ca.issue_cert("127.0.0.1", "localhost")
        self.ca.cert_pem.write_to_path(str(self.ca_path))
        leaf.private_key_and_cert_chain_pem.write_to_path(str(self.certfile))
        leaf.private_key_pem.write_to_path(str(self.keyfile))

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def certfile(self) -> Path:
        return self.directory / "tls.crt"

    @property
    def keyfile(self) -> Path:
        return self.directory / "tls.key"

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_path))


@dataclass
class Backends:
    """``python -m gateway.devtools.backends`` over TLS: the sample webhooks at ``url(path)``."""

    proc: subprocess.Popen[bytes]
    port: int
    tls: TLSFiles
    log: Path

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        stop_process(self.proc)


def start_backends(workdir: Path, tls: TLSFiles) -> Backends:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "backends.log"
    port = free_port()
    proc = spawn(
        [
            sys.executable, "-m", "gateway.devtools.backends",
            "--port", str(port), "--certfile", str(tls.certfile), "--keyfile", str(tls.keyfile),
        ],
        log,
    )  # fmt: skip
    backends = Backends(proc, port, tls, log)
    _wait_serving(proc, f"https://127.0.0.1:{port}/healthz", tls.client_context(), log, "backends")
    return backends


@dataclass
class GatewayProcess:
    """``webhook-gateway serve`` over TLS on ``url``; ``log`` holds its JSON log lines."""

    proc: subprocess.Popen[bytes]
    url: str
    tls: TLSFiles
    log: Path
    argv: list[str]

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return stop_process(self.proc, sig=sig)

    def log_events(self) -> list[dict[str, object]]:
        events = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                decoded = json.loads(line)
                if isinstance(decoded, dict):
                    events.append(decoded)
        return events

    def ready(self) -> bool:
        return http_status(f"{self.url}/readyz", self.tls.client_context()) == 200


def start_gateway_process(
    workdir: Path,
    config: Path,
    tls: TLSFiles,
    *args: str,
    port: int | None = None,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    tree: Path | None = None,
) -> GatewayProcess:
    """Start the gateway (``--drain-seconds 0``, JSON logs) and wait until ``/readyz`` answers 200.

    ``tree``: run the gateway package of that checkout (another version, for before/after numbers)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = workdir / f"gateway-{port}.log"
    argv = [
        sys.executable, "-m", "gateway", "serve",
        "--config", str(config),
        "--bind", f"127.0.0.1:{port}",
        "--certfile", str(tls.certfile), "--keyfile", str(tls.keyfile),
        "--drain-seconds", "0",
        "--log-format", "json",
        *args,
    ]  # fmt: skip
    environ = {**os.environ, **(env or {})}
    if tree is not None:
        environ["PYTHONPATH"] = str(tree)
    proc = spawn(argv, log, environ, cwd=tree)
    gateway = GatewayProcess(proc, f"https://127.0.0.1:{port}", tls, log, argv)
    if wait_ready:
        _wait_serving(proc, f"{gateway.url}/readyz", tls.client_context(), log, "webhook-gateway")
    return gateway


def _wait_serving(
    proc: subprocess.Popen[bytes], url: str, context: ssl.SSLContext, log: Path, what: str
) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while http_status(url, context) != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; {log}:\n{log_tail(log, 20)}")
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(
                f"{what} did not serve {url} within {READY_TIMEOUT} s; {log}:\n{log_tail(log, 20)}"
            )
        time.sleep(0.05)


@contextlib.contextmanager
def running(*stoppables: Backends | GatewayProcess) -> Iterator[None]:
    """Stop every process given when the block ends, whatever happened in it."""
    try:
        yield
    finally:
        for each in stoppables:
            each.stop()
