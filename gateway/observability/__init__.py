"""Observability: tell the operator what happened, per review and per backend.

Consumes what the server and dispatch recorded; nothing below this layer imports it.

- ``metrics.Metrics``: Prometheus families (upstream's admission metrics renamed, MET-01..09, and
  the gateway's own), in a registry of its own.
- ``logs.configure_logging``: the structlog pipeline (JSON or console), called once by ``__main__``;
  the serving processes write through ``logsink.LineSink`` (never blocks on stdout, bounded).
- ``canonical``: the one-line-per-review event.
- ``observer.Observability``: the server's ``ReviewObserver``, combining the two.
"""

from gateway.observability.logs import configure_logging, count_dropped_lines, flush_logs
from gateway.observability.metrics import Metrics
from gateway.observability.observer import Observability

__all__ = ["Metrics", "Observability", "configure_logging", "count_dropped_lines", "flush_logs"]
