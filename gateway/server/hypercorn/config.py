"""``GatewayConfig`` replaces hypercorn's ``Config``: the listener's inbound runtime, the settings
for long-lived apiserver connections, and a ``Date`` header made once a second.

Reasons:

- **Limit.** Every connection of a listener finds the listener's ``InboundRuntime`` (limits, open
  connections, draining) on its config (``runtime_of``), so limits reach the per-connection
  server and the protocols without module globals.
- **Measured speed.** hypercorn formats the ``Date`` header anew for every response (~6 µs); it
  changes once a second, so the whole header list is kept per protocol for the second it was made
  in (docs/performance.md, the HTTP/1.1 inbound row of the second-pass table).

Byte-level tests: tests/test_server_inbound.py (keep-alive, header, idle limits through a real
gateway) and tests/test_server_http11.py (what a caller receives, byte for byte, against plain
hypercorn).
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import Any, Protocol

from hypercorn.config import Config

from gateway.server.limits import InboundRuntime

__all__ = ["GatewayConfig", "ServingCertificate", "runtime_of", "server_config"]


class ServingCertificate(Protocol):
    """The serving certificate's current context (``gateway.server.serve.ReloadableTLS``)."""

    context: ssl.SSLContext


class GatewayConfig(Config):
    """hypercorn's Config, with the listener's inbound runtime (limits, open connections)."""

    tls: ServingCertificate | None = None
    inbound: InboundRuntime | None = None

    def __init__(self) -> None:
        super().__init__()
        self._response_headers: dict[str, tuple[int, list[tuple[bytes, bytes]]]] = {}

    def create_ssl_context(self) -> ssl.SSLContext | None:
        return self.tls.context if self.tls is not None else None

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        # Speed: the Date header changes once a second; the list is made once per second.
        second = int(time.time())
        cached = self._response_headers.get(protocol)
        if cached is None or cached[0] != second:
            cached = (second, super().response_headers(protocol))
            self._response_headers[protocol] = cached
        return list(cached[1])

    @property
    def ssl_enabled(self) -> bool:
        return self.tls is not None


def server_config(
    bind: str,
    *,
    tls: ServingCertificate | None,
    shutdown_timeout: float,
    runtime: InboundRuntime | None = None,
) -> GatewayConfig:
    """Tuned for long-lived apiserver connections (docs/performance.md, docs/inbound.md)."""
    cfg = GatewayConfig()
    cfg.tls = tls
    cfg.inbound = runtime or InboundRuntime()
    cfg.bind = [bind]
    cfg.accesslog = None  # the canonical review line is the access log
    cfg.errorlog = logging.getLogger("hypercorn.error")  # through our log pipeline, once
    # hypercorn closes a connection after 1,000 requests by default (for HTTP/2 too); kube-apiserver
    # keeps connections for a long time, and reconnecting costs a TLS handshake per 1,000 reviews.
    cfg.keep_alive_max_requests = 2**31
    cfg.keep_alive_timeout = cfg.inbound.limits.idle_timeout  # > the apiserver's 90 s idle timeout
    cfg.h2_max_concurrent_streams = 250
    cfg.ssl_handshake_timeout = cfg.inbound.limits.handshake_timeout  # enforced by handshake.py
    cfg.graceful_timeout = shutdown_timeout
    cfg.backlog = 1024
    return cfg


def runtime_of(config: Any) -> InboundRuntime:
    """The listener's shared state; a plain hypercorn Config gets a default one (tests)."""
    runtime: InboundRuntime | None = getattr(config, "inbound", None)
    if runtime is None:
        runtime = InboundRuntime()
        config.inbound = runtime
    return runtime
