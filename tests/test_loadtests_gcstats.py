"""``--gc-stats``: the hook a gateway is started with records each collection, and a phase's summary
counts those that ended within it. A real Python process runs the hook; it collects on purpose, so the
counts do not depend on how much a load run allocates on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loadtests import gcstats

_COLLECT = textwrap.dedent(
    """
    import gc, sys, time
    from loadtests import gcstats
    gc.disable()  # only the collections asked for below
    print(gcstats.now(), flush=True)
    for generation in (0, 0, 1, 2):
        gc.collect(generation)
    print(gcstats.now(), flush=True)
    time.sleep(0.5)  # the recorder flushes every 0.2 s, from its own thread
    """
)


def _run(tmp_path: Path, *, hooked: bool) -> tuple[Path, float, float]:
    out = tmp_path / "gc.bin"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*([str(gcstats.HOOK_DIR)] if hooked else []), str(Path(__file__).resolve().parents[1])]
    )}  # fmt: skip
    env.update(gcstats.env(out))
    proc = subprocess.run(
        [sys.executable, "-c", _COLLECT], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    start, end = (float(line) for line in proc.stdout.split())
    return out, start, end


@pytest.mark.parametrize(
    ("hooked", "counts"),
    [
        pytest.param(True, {"gen0": 2, "gen1": 1, "gen2": 1}, id="the hook records every collection of the phase, per generation"),
        pytest.param(False, {"gen0": 0, "gen1": 0, "gen2": 0}, id="without the hook on the path nothing is recorded"),
    ],
)  # fmt: skip
def test_the_gc_hook_records_each_collection_and_the_summary_counts_those_of_the_phase(
    tmp_path: Path, hooked: bool, counts: dict[str, int]
) -> None:
    path, start, end = _run(tmp_path, hooked=hooked)
    summary = gcstats.summarize(path, start, end, settle=0)
    assert {gen: int(row["count"]) for gen, row in summary.items()} == counts
    for row in summary.values():
        if row["count"]:
            assert row["cpu_pct_of_phase"] >= 0 and row["max_ms"] >= row["p99_ms"] > 0
    assert gcstats.summarize(path, end + 1, end + 2, settle=0)["gen0"]["count"] == 0, "none after the phase"
