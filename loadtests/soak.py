"""Soak mode: live configuration reloads during the measured gateway phases (``--reload-every``),
confirmed through the gateway's ``config_reloads_total`` counter, and the gateway's resident set
sampled as a series (``--rss-every``) so that a long run shows whether memory stays flat."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import yaml

from loadtests import processes
from loadtests.client import ConnectionLostError, Endpoint

SETTLE_S = 300.0
"""Growth is measured from the end of the first 5 minutes: allocator arenas and pools warm up before."""

RELOAD_ANNOTATION = "loadtests.webhook-gateway.dev/reload"
EXTRA_FILE = "soak-extra.yaml"
_RELOADS = re.compile(r'^webhook_gateway_config_reloads_total\{result="(success|failure)"\}\s+(\S+)', re.M)


def poll_seconds(reload_every: float, gateway_args: Sequence[str]) -> float | None:
    """The ``--config-poll-seconds`` to give the gateway so that every rewrite is seen on its own
    (it applies a change once two polls agree), or None when its default (2 s) is quick enough or
    the caller chose one."""
    if any(a.startswith("--config-poll-seconds") for a in gateway_args):
        return None
    return reload_every / 4 if reload_every < 8 else None


class ConfigChurn:
    """Rewrites the run's configuration directory so that the gateway must reload it, without
    changing any decision: every rewrite bumps an annotation on each configuration object, and
    every other one adds (then removes) a validating webhook whose rules match no resource the
    load sends, so per-backend state is built and dropped too."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.documents = {p: yaml.safe_load(p.read_text()) for p in sorted(directory.glob("*.yaml"))}
        self.written = 0

    def _extra(self) -> dict[str, Any]:
        first = next(iter(self.documents.values()))["webhooks"][0]
        hook = {
            "name": "soak-extra.loadtests.webhook-gateway.dev",
            "clientConfig": first["clientConfig"],
            "rules": [
                {
                    "operations": ["CREATE"],
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["replicationcontrollers"],  # never sent: reviews are Pods
                    "scope": "Namespaced",
                }
            ],
            "failurePolicy": "Ignore",
            "matchPolicy": "Exact",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 1,
        }
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "loadtest-soak-extra"},
            "webhooks": [hook],
        }

    def rewrite(self) -> None:
        """One change for the gateway to apply; each file is replaced atomically."""
        self.written += 1
        for path, doc in self.documents.items():
            changed = {**doc, "metadata": dict(doc["metadata"])}
            annotations = dict(changed["metadata"].get("annotations") or {})
            annotations[RELOAD_ANNOTATION] = str(self.written)
            changed["metadata"]["annotations"] = annotations
            _replace(path, changed)
        extra = self.directory / EXTRA_FILE
        if self.written % 2:
            _replace(extra, self._extra())
        else:
            extra.unlink(missing_ok=True)


def _replace(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name("." + path.name + ".tmp")  # hidden: the gateway's loader skips it
    tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
    os.replace(tmp, path)


def reload_counts(metrics: str) -> tuple[int, int]:
    """(success, failure) of ``webhook_gateway_config_reloads_total`` in a /metrics text."""
    found = {k: int(float(v)) for k, v in _RELOADS.findall(metrics)}
    return found.get("success", 0), found.get("failure", 0)


async def read_reload_counts(endpoint: Endpoint) -> tuple[int, int]:
    """The gateway's reload counters now (GET /metrics on its serving port)."""
    return reload_counts(await processes.scrape_metrics(endpoint))


@dataclass
class Reloads:
    """Reloads over the whole run: asked for (rewrites), applied (success), refused (failure)."""

    requested: int = 0
    applied: int = 0
    refused: int = 0

    @property
    def not_seen(self) -> int:
        return max(self.requested - self.applied - self.refused, 0)


async def churn_during_phase(churn: ConfigChurn, every: float) -> None:
    """Rewrite the configuration every ``every`` seconds until cancelled (the phase's end)."""
    while True:
        await trio.sleep(every)
        churn.rewrite()


async def settle(
    endpoint: Endpoint, before: tuple[int, int], requested: int, timeout: float
) -> tuple[int, int]:
    """After a phase: wait (at most ``timeout``) until the gateway has acted on ``requested``
    rewrites, then return how many it applied and how many it refused."""
    applied = refused = 0
    with trio.move_on_after(timeout):
        while True:
            with contextlib.suppress(OSError, ConnectionLostError, trio.TooSlowError):
                success, failure = await read_reload_counts(endpoint)
                applied, refused = success - before[0], failure - before[1]
                if applied + refused >= requested:
                    break
            await trio.sleep(0.2)
    return applied, refused


@dataclass
class RssSeries:
    """The gateway's VmRSS (all its processes) over the run: (seconds since the first measured
    gateway phase began, MiB)."""

    every: float
    samples: list[tuple[float, float]] = field(default_factory=list)
    origin: float | None = None

    def sample(self, pid: int) -> None:
        now = trio.current_time()
        if self.origin is None:
            self.origin = now
        t = round(now - self.origin, 1)
        if self.samples and self.samples[-1][0] == t:
            return  # the phase ended just as the loop sampled
        with contextlib.suppress(OSError):
            self.samples.append((t, round(processes.proc_rss_mb(pid), 1)))

    async def during_phase(self, pid: int) -> None:
        """Sample now and every ``every`` seconds until cancelled (the caller samples the end)."""
        while True:
            self.sample(pid)
            await trio.sleep(self.every)


def summarize_rss(
    samples: Sequence[tuple[float, float]], settle_s: float = SETTLE_S
) -> dict[str, float] | None:
    """First, last and max MiB, and the growth from the end of the first ``settle_s`` seconds (the
    last sample at or before it) to the last sample; from the first sample when the run is shorter."""
    if not samples:
        return None
    mbs = [mb for _, mb in samples]
    later = samples[-1][0] > settle_s
    base_t, base_mb = [s for s in samples if s[0] <= settle_s][-1] if later else samples[0]
    growth = mbs[-1] - base_mb
    return {
        "first_mb": mbs[0],
        "last_mb": mbs[-1],
        "max_mb": max(mbs),
        "baseline_s": base_t,
        "baseline_mb": base_mb,
        "end_s": samples[-1][0],
        "growth_mb": round(growth, 1),
        "growth_pct": round(growth / base_mb * 100, 1) if base_mb else float("nan"),
    }


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def describe_rss(series: RssSeries, per_line: int = 8) -> list[str]:
    """The series as compact lines (m:ss MB), then the summary line."""
    summary = summarize_rss(series.samples)
    if summary is None:
        return []
    lines = [
        f"gateway RSS (VmRSS, all its processes) every {series.every:g} s during gateway phases, m:ss MB:"
    ]
    cells = [f"{_clock(t)} {mb:.1f}" for t, mb in series.samples]
    lines += ["  " + " | ".join(cells[k : k + per_line]) for k in range(0, len(cells), per_line)]
    since = (
        f"from {_clock(summary['baseline_s'])}"
        if summary["end_s"] > SETTLE_S
        else "from the first sample (run shorter than 5 minutes)"
    )
    lines.append(
        f"  first {summary['first_mb']:.1f} MB, last {summary['last_mb']:.1f} MB,"
        f" max {summary['max_mb']:.1f} MB;"
        f" growth {since} to the end ({_clock(summary['end_s'])}): {summary['growth_mb']:+.1f} MB"
        f" ({summary['growth_pct']:+.1f} %)"
    )
    return lines
