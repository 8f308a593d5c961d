"""``python -m loadtests overload``: its schedule, its per-second windows and its recovery measure,
and a real (short) run against the gateway, shedding on and off."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.overload import Answers, recovery_seconds, schedule, summarize_segment, windows

ROOT = Path(__file__).resolve().parent.parent


def test_schedule_is_half_capacity_then_the_overload_then_half_again() -> None:
    """The three segments follow each other, at 0.5 x, F x and 0.5 x the measured capacity."""
    segments, offsets = schedule(200.0, factor=5.0, before=10.0, overload=60.0, after=20.0, seed=1)
    assert [(s.name, s.start, s.seconds, s.rate) for s in segments] == [
        ("before", 0.0, 10.0, 100.0),
        ("overload", 10.0, 60.0, 1000.0),
        ("after", 70.0, 20.0, 100.0),
    ]
    assert offsets == sorted(offsets)
    counts = [sum(1 for o in offsets if s.start <= o < s.start + s.seconds) for s in segments]
    assert counts[0] == pytest.approx(1_000, rel=0.1)  # Poisson: about rate x seconds
    assert counts[1] == pytest.approx(60_000, rel=0.05)
    assert counts[2] == pytest.approx(2_000, rel=0.1)


def _answers(rows: list[tuple[float, float]]) -> Answers:
    answers = Answers()
    for due, latency in rows:
        answers.add(due, latency)
    return answers


WINDOWS = [
    pytest.param(
        [(0.1, 0.01), (0.5, 0.02), (1.2, 0.03)],
        [(0.0, 2, 0), (1.0, 1, 0)],
        id="answers are counted in the second they were due, not the one they came back in",
    ),
    pytest.param(
        [(0.1, 0.01), (0.2, math.nan), (0.3, 2.5)],
        [(0.0, 1, 2)],
        id="no answer, or one later than the caller's timeout, is late",
    ),
]


@pytest.mark.parametrize(("rows", "expected"), WINDOWS)
def test_windows(rows: list[tuple[float, float]], expected: list[tuple[float, int, int]]) -> None:
    got = windows(_answers(rows), timeout=2.0, total=max(due for due, _ in rows) + 0.1)
    assert [(w["second"], int(w["in_time"]), int(w["late"])) for w in got] == expected


RECOVERY = [
    pytest.param(
        [10.0, 500.0, 12.0, 11.0], 0, 2.0, id="normal again from the third window after the drop on"
    ),
    pytest.param([10.0, 12.0, 500.0, 11.0], 0, 3.0, id="a slow window later resets the recovery"),
    pytest.param([10.0, 12.0, 11.0, 500.0], 0, None, id="still slow at the end: never recovered"),
    pytest.param([10.0, 12.0, 11.0, 13.0], 1, None, id="a late answer makes its window abnormal"),
]


@pytest.mark.parametrize(("p99s", "late", "expected"), RECOVERY)
def test_recovery_seconds(p99s: list[float], late: int, expected: float | None) -> None:
    """Recovery is the time from the drop until every later one-second window is normal."""
    rows = [{"second": 5.0 + i, "in_time": 10.0, "late": 0.0, "p99_ms": p} for i, p in enumerate(p99s)]
    rows[-1]["late"] = float(late)
    before_drop = {"second": 4.0, "in_time": 10.0, "late": 0.0, "p99_ms": 900.0}
    assert recovery_seconds([before_drop, *rows], drop=5.0, normal_p99_ms=50.0) == expected


def test_segment_summary_counts_fail_open_answers() -> None:
    """The fail-open share is of the answers in time (each shed review is one)."""
    segments, _ = schedule(10.0, factor=5.0, before=1.0, overload=1.0, after=1.0, seed=0)
    answers = Answers()
    answers.add(1.1, 0.01, failed_open=True)
    answers.add(1.2, 0.02, failed_open=False)
    answers.add(1.3, math.nan)
    result = summarize_segment(segments[1], answers, timeout=2.0)
    assert (result.late, result.failed_open_pct, result.answered_rps) == (1, 50.0, 2.0)


def test_quick_run_sheds_and_answers_every_review_correctly(tmp_path: Path) -> None:
    """A real run (a few seconds): the gateway with shedding and without, every answer correct
    (allowed, uid echoed; shed ones with the fail-open annotations); timings are not asserted."""
    out = tmp_path / "overload.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests", "overload", "--quick", "--run", "both,off", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["capacity_rps"] > 0
    assert [m["mode"] for m in doc["modes"]] == ["both", "off"]
    for mode in doc["modes"]:
        assert [s["name"] for s in mode["segments"]] == ["before", "overload", "after"]
        assert mode["rss_mb"], "RSS was sampled during the run"
        assert all(kind == "connection-lost" for kind in mode["errors"]), mode["errors"]
        assert mode["connections"]["dials"] >= mode["connections"]["opened"] >= 0, "the caller's churn"
        assert all("new_connections_per_s" in s for s in mode["segments"])
    assert doc["modes"][1]["shed"] == 0, "without shedding flags nothing is shed"
    assert "normal again after the drop" in proc.stdout


def test_segment_summary_counts_full_decisions_and_the_generators_own_lateness() -> None:
    """Full decisions are the answers in time that were not failed open; the generator's lateness
    is how late it started its reviews (when it is large, the generator set the pace)."""
    segments, _ = schedule(10.0, factor=5.0, before=1.0, overload=1.0, after=1.0, seed=0)
    answers = Answers()
    answers.add(1.1, 0.01, failed_open=True, start_lag=0.001)
    answers.add(1.2, 0.02, failed_open=False, start_lag=0.3)
    answers.add(1.3, math.nan, start_lag=0.002)
    result = summarize_segment(segments[1], answers, timeout=2.0)
    assert result.full_rps == 1.0
    assert 200.0 < result.generator_lag_p99_ms <= 300.0


def test_shed_cost_run_measures_a_full_and_a_shed_review(tmp_path: Path) -> None:
    """``--shed-cost``: a closed loop against a gateway deciding every review and one shedding
    every review (each answer checked: allowed, uid echoed), the gateway's CPU per review in each."""
    out = tmp_path / "cost.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests", "overload", "--quick", "--shed-cost", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    full, shed = json.loads(out.read_text())
    assert (full["mode"], shed["mode"]) == ("full", "shed")
    assert full["failed_open_pct"] == 0.0 and shed["failed_open_pct"] == 100.0
    assert full["cpu_us_per_review"] > 0 and shed["cpu_us_per_review"] > 0
    assert "shedding alone absorbs at most" in proc.stdout
