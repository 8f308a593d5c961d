"""The gateway's settings: one typed, frozen value built from the command line and the environment.

``gateway.commands.serve`` parses argv and ``WEBHOOK_GATEWAY_*`` into a ``ServeSettings`` once; everything
below (the composition root, the demo, tests) receives that value and never reads argv or the
environment itself. The parser takes its defaults from this class, so a default is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

PatchMode = Literal["concat", "diff"]
NamespaceSource = Literal["config", "cluster"]
UnknownNamespace = Literal["notFound", "emptyLabels"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["json", "console"]


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """Every option of ``webhook-gateway serve`` (the attribute is the option without ``--``)."""

    # serving
    config: str = ""  # a directory or file; required (the command line says so when it is missing)
    bind: str = "127.0.0.1:8443"
    certfile: str | None = None
    keyfile: str | None = None
    client_ca: str | None = None
    metrics_bind: str | None = None
    validate_path: str = "/validate"
    mutate_path: str = "/mutate"
    max_request_bytes: int = 32 * 1024 * 1024
    drain_seconds: float = 5.0
    shutdown_timeout: float = 30.0
    config_poll_seconds: float = 2.0
    allow_empty_config: bool = False
    workers: int | None = None  # None: one per CPU this process may use (gateway.server.workers)
    # inbound connections (docs/inbound.md)
    header_read_timeout: float = 10.0
    body_read_timeout: float = 10.0
    idle_timeout: float = 120.0
    write_timeout: float = 10.0
    max_inbound_connections: int = 0  # 0: derived from the memory limit and the file-descriptor limit
    max_pending_connections: int = 0  # not established yet; 0: derived
    handshake_timeout: float = 5.0
    handshake_burst: int = 1  # TLS handshakes between two idle moments of the event loop; 0: no gate
    handshake_rate: float = 0.0  # ...and stale dials at most this many a second; 0: no such bound
    max_waiting_handshakes: int = 16  # handshakes waiting at that gate at which accepting pauses; 0: never
    memory_limit: int | None = None  # bytes; None: the cgroup's (docs/inbound.md, "Memory")
    fd_reserve: int = 512
    h2_control_frame_burst: int = 1000
    h2_control_frame_rate: float = 100.0
    # dispatch
    default_timeout: float = 10.0
    deadline_margin: float = 0.2
    patch_mode: PatchMode = "concat"
    audit_patches: bool = False
    include_virtual_resources: bool = False
    strict_https: bool = False
    # overload (docs/resilience.md)
    shed_max_in_flight: int | None = None
    shed_max_event_loop_lag: float | None = None
    shed_max_cpu: float | None = None  # of the CPU the process may use (docs/resilience.md)
    # backends
    backend_kubeconfig: str | None = None
    max_backend_response_bytes: int = 16 * 1024 * 1024
    max_connections_per_backend: int = 64
    # namespaces
    namespace_source: NamespaceSource = "config"
    kubeconfig: str | None = None
    unknown_namespace: UnknownNamespace = "notFound"
    # self-managed registration
    manage_registration: bool = False
    registration_ca_bundle: str | None = None
    registration_namespace: str = "webhook-gateway"
    registration_service: str = "webhook-gateway"
    # CRD conversion cache
    conversion_cache_ttl: float = 300.0
    conversion_cache_max_entries: int = 10_000
    conversion_cache_max_bytes: int = 64 * 1024 * 1024
    # observability
    log_level: LogLevel = "info"
    log_format: LogFormat = "json"
    log_bodies: bool = False
    no_metrics: bool = False
    no_review_log: bool = False

    @classmethod
    def from_options(cls, options: Any) -> ServeSettings:
        """From parsed options (``argparse.Namespace``); an option without a field is a programming error."""
        given = dict(vars(options))
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"options without a ServeSettings field: {', '.join(unknown)}")
        return cls(**{k: v for k, v in given.items() if k in names})


SERVE_DEFAULTS = ServeSettings()
