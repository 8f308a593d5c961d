"""``--manage-registration``: build the registrar from the serve options (the composition root's part)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

from gateway.config.model import Snapshot
from gateway.errors import ConfigError, ConfigProblem
from gateway.registration import Settings
from gateway.settings import ServeSettings
from gateway.sources.kube import KubeClient, in_cluster_config, load_kubeconfig
from gateway.sources.registrar import LeaderElection, Registrar


def ca_bundle_file(options: ServeSettings) -> Path:
    """--registration-ca-bundle, else the ca.crt next to the serving certificate (cert-manager and
    scripts/gen-certs.sh both put it in the TLS Secret)."""
    if options.registration_ca_bundle:
        return Path(options.registration_ca_bundle)
    if not options.certfile:
        raise ConfigError(
            [ConfigProblem("--manage-registration", "needs TLS (--certfile) or --registration-ca-bundle")]
        )
    return Path(options.certfile).parent / "ca.crt"


def registrar_from(
    options: ServeSettings, snapshot: Callable[[], Snapshot], ready: Callable[[], bool]
) -> Registrar:
    config = load_kubeconfig(Path(options.kubeconfig)) if options.kubeconfig else in_cluster_config()
    client = KubeClient(config, request_timeout=10.0)
    bundle = ca_bundle_file(options)
    namespace = options.registration_namespace

    def settings() -> Settings:
        try:
            ca = bundle.read_bytes()
        except OSError as exc:
            raise ConfigError(
                [ConfigProblem(str(bundle), f"cannot read the CA bundle: {exc.strerror}")]
            ) from exc
        return Settings(
            namespace=namespace,
            service=options.registration_service,
            validate_path=options.validate_path,
            mutate_path=options.mutate_path,
            ca_bundle=ca,
            deadline_margin=options.deadline_margin,
        )

    identity = os.environ.get("POD_NAME") or socket.gethostname()
    election = LeaderElection(client, namespace, "webhook-gateway-registration", identity)
    return Registrar(client=client, election=election, snapshot=snapshot, ready=ready, settings=settings)
