"""``--gc-stats``: the gateway's garbage collections during each measured phase, per generation.

The gateway is started with ``loadtests/gchook`` first on its ``PYTHONPATH``; its ``sitecustomize``
records each collection's end time and pause through ``gc.callbacks`` into a file (see there). Here
the records of one phase are read back and summarised: how many collections of each generation, their
total and longest pause, and the pauses' share of the phase (the event loop can do nothing else then).
"""

from __future__ import annotations

import math
import struct
import time
from pathlib import Path
from typing import Any, Final

from loadtests.stats import percentile

HOOK_DIR: Final = Path(__file__).resolve().parent / "gchook"
_RECORD: Final = struct.Struct("<dffi")


def now() -> float:
    """The clock the records use (the monotonic clock, shared by processes)."""
    return time.monotonic()


def env(path: Path) -> dict[str, str]:
    """What a gateway's environment needs for its collections to be recorded into ``path``."""
    return {"LOADTEST_GC_STATS": str(path)}


def read(path: Path) -> list[tuple[float, float, float, int]]:
    """Every record so far: (end time, pause seconds, CPU seconds, generation)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    usable = len(data) - len(data) % _RECORD.size
    return list(_RECORD.iter_unpack(data[:usable]))


def summarize(path: Path, start: float, end: float, *, settle: float = 0.5) -> dict[str, Any]:
    """Collections that ended between ``start`` and ``end``, per generation: count, per second, total,
    p99 and longest pause (ms), the share of the phase spent paused (%), and the longest pause's
    and the total's CPU (ms; a pause longer than its CPU waited for a CPU)."""
    time.sleep(settle)  # the recorder flushes every 0.2 s
    seconds = max(end - start, 1e-9)
    out: dict[str, Any] = {}
    records = [r for r in read(path) if start <= r[0] <= end]
    for gen in (0, 1, 2):
        pauses = sorted(p for _, p, _cpu, g in records if g == gen)
        cpus = sorted(c for _, _p, c, g in records if g == gen)
        out[f"gen{gen}"] = {
            "count": float(len(pauses)),
            "per_s": len(pauses) / seconds,
            "total_ms": 1000 * sum(pauses),
            "p99_ms": 1000 * percentile(pauses, 99) if pauses else math.nan,
            "max_ms": 1000 * pauses[-1] if pauses else math.nan,
            "pct_of_phase": 100 * sum(pauses) / seconds,
            "max_cpu_ms": 1000 * cpus[-1] if cpus else math.nan,
            "cpu_pct_of_phase": 100 * sum(cpus) / seconds,
        }
    return out
