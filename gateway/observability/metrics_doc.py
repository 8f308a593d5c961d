"""``python -m gateway.observability.metrics_doc > docs/metrics.md``: the metric reference, from the code.

Every family a fresh ``Metrics`` registry collects (what ``/metrics`` serves), with its type, labels
and help text, in export order, then the families the ``--workers`` supervisor adds
(``gateway.server.workers``, listed here: that layer sits above this one). A test regenerates the
file and fails when docs/metrics.md differs; another scrapes a running gateway, with and without
worker processes, and fails on any family missing here, so the reference cannot drift.
"""

from __future__ import annotations

import sys

from gateway.observability.metrics import Metrics

HEADER = """# Metrics

Generated from the code by `python -m gateway.observability.metrics_doc > docs/metrics.md`; do not
edit by hand. The gateway serves them at `/metrics` (on `--metrics-bind` when set). Alerts and the
dashboard built on them: `deploy/components/monitoring/`, runbooks in `docs/runbooks.md`.

Histograms also export `_bucket`, `_sum` and `_count` series; counters end in `_total` except the two
`..._count` families that keep the kube-apiserver's names. Besides these, the standard `process_*`
families of the Prometheus client (CPU seconds, resident and virtual memory, open and maximum file
descriptors, start time) are exported. The last six rows exist only with `--workers` greater than 1.

| metric | type | labels | meaning |
| --- | --- | --- | --- |
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# The supervisor's families (gateway.server.workers._WorkerFamilies): name, type, labels, help.
WORKER_FAMILIES: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("webhook_gateway_workers", "gauge", (), "Worker processes the gateway runs (--workers)."),
    ("webhook_gateway_workers_ready", "gauge", (), "Worker processes that are ready now."),
    (
        "webhook_gateway_worker_restarts_total",
        "counter",
        ("worker",),
        "Worker processes restarted after they exited unexpectedly, per worker slot.",
    ),
    (
        "webhook_gateway_worker_reviews_total",
        "counter",
        ("worker",),
        "Review requests handled per worker slot (how evenly the kernel spreads connections).",
    ),
    (
        "webhook_gateway_shared_state_slots",
        "gauge",
        ("table", "state"),
        "Records of the per-backend state shared by the workers, per table (circuits, in_flight, "
        "endpoints) and state (used, free); fixed when the gateway starts.",
    ),
    (
        "webhook_gateway_shared_state_refused_total",
        "counter",
        ("table",),
        "Backends or endpoints that found their shared table full and kept a state of their own "
        "in one worker, per table.",
    ),
)
_LABELS = {  # families whose label names show only once a series exists
    "webhook_gateway_backend_open_connections": ("origin",),
    "webhook_gateway_build_info": ("version", "python"),
}


def render() -> str:
    metrics = Metrics()
    families = {f.name: f for f in metrics.families}
    rows: list[tuple[str, str, tuple[str, ...], str]] = []
    for metric in metrics.registry.collect():
        if metric.name.startswith("process_"):
            continue
        family = families.get(metric.name) or families.get(metric.name + "_total")
        name = metric.name + ("_total" if metric.type == "counter" and family is None else "")
        if metric.type == "info":
            name, kind = metric.name + "_info", "gauge"
        else:
            kind = family.kind if family is not None else metric.type
        labels = family.labelnames if family is not None else _LABELS.get(name, ())
        rows.append((family.name if family is not None else name, kind, tuple(labels), metric.documentation))
    rows.extend(WORKER_FAMILIES)
    lines = [
        f"| `{name}` | {kind} | {', '.join(f'`{label}`' for label in labels) or '—'} | {_cell(doc)} |"
        for name, kind, labels, doc in rows
    ]
    return HEADER + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
