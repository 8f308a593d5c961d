"""``python -m gateway.observability.metrics_doc > docs/metrics.md``: the metric reference, from the code.

Every family a fresh ``Metrics`` exports, with its type, labels and help text, in export order; a
test regenerates it and fails when docs/metrics.md differs, so the reference cannot drift.
"""

from __future__ import annotations

import sys

from gateway.observability.metrics import Metrics

HEADER = """# Metrics

Generated from the code by `python -m gateway.observability.metrics_doc > docs/metrics.md`; do not
edit by hand. The gateway serves them at `/metrics` (on `--metrics-bind` when set). Alerts and the
dashboard built on them: `deploy/components/monitoring/`, runbooks in `docs/runbooks.md`.

Histograms also export `_bucket`, `_sum` and `_count` series; counters end in `_total` except the two
`..._count` families that keep the kube-apiserver's names.

| metric | type | labels | meaning |
| --- | --- | --- | --- |
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    metrics = Metrics()
    rows: list[tuple[str, str, tuple[str, ...], str]] = [
        (f.name, f.kind, f.labelnames, f.documentation) for f in metrics.families
    ]
    pool = metrics.connection_metric()
    rows.append((pool.name, pool.type, ("origin",), pool.documentation))
    lines = [
        f"| `{name}` | {kind} | {', '.join(f'`{label}`' for label in labels) or '—'} | {_cell(doc)} |"
        for name, kind, labels, doc in rows
    ]
    return HEADER + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
