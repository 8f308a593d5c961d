"""The inbound limits' arithmetic: the derived connection bound and the HTTP/2 control-frame budget."""

from __future__ import annotations

import pytest

from gateway.server.limits import ControlFrameBudget, connection_bound
from tests.support.inbound import DATA, HEADERS, PING, PREFACE, frame, settings


@pytest.mark.parametrize(
    ("configured", "nofile", "expected"),
    [
        pytest.param(100, 1024, 100, id="an explicit --max-inbound-connections wins"),
        pytest.param(0, 1024, 512, id="derived: fd limit 1024 minus the 512 reserve"),
        pytest.param(0, 128, 64, id="derived: a small fd limit gives at most half to the reserve"),
        pytest.param(0, 1 << 20, 4096, id="derived: never more than 4096 connections"),
    ],
)
def test_connection_bound(configured: int, nofile: int, expected: int) -> None:
    assert connection_bound(configured, nofile=nofile) == expected


def _feed_all(budget: ControlFrameBudget, data: bytes, *, step: int | None = None, now: float = 0.0) -> bool:
    step = step or len(data)
    ok = True
    for i in range(0, len(data), step):
        ok = budget.feed(data[i : i + step], now) and ok
    return ok


BUDGET_CASES = [
    pytest.param(PREFACE + settings((4, 1)) * 10, True, id="a few SETTINGS frames are within budget"),
    pytest.param(PREFACE + frame(PING, payload=bytes(8)) * 101, False, id="101 PINGs exceed a burst of 100"),
    pytest.param(PREFACE + settings(*[(4, 1)] * 33), False, id="one SETTINGS frame with 33 entries"),
    pytest.param(
        PREFACE + (frame(HEADERS, 0x5, 1, b"\x82") + frame(DATA, 0, 1, b"x" * 1000)) * 200,
        True,
        id="requests and DATA with payload cost nothing",
    ),
    pytest.param(PREFACE + frame(DATA, 0, 1) * 101, False, id="empty DATA without END_STREAM costs a token"),
    pytest.param(PREFACE + frame(DATA, 0x1, 1) * 101, True, id="empty DATA with END_STREAM is free"),
]


@pytest.mark.parametrize(("data", "within"), BUDGET_CASES)
@pytest.mark.parametrize("step", [None, 1, 7], ids=["in one read", "byte by byte", "in 7-byte reads"])
def test_control_frame_budget(data: bytes, within: bool, step: int | None) -> None:
    """The frame scanner sees the same frames however the bytes are split into reads."""
    assert _feed_all(ControlFrameBudget(100, 10.0, 32), data, step=step) is within


def test_control_frame_budget_refills_over_time() -> None:
    budget = ControlFrameBudget(100, 10.0, 32)
    assert budget.feed(PREFACE + frame(PING, payload=bytes(8)) * 100, 0.0)
    assert not ControlFrameBudget(100, 10.0, 32).feed(PREFACE + frame(PING, payload=bytes(8)) * 101, 0.0)
    assert budget.feed(frame(PING, payload=bytes(8)) * 10, 1.0)  # 10 tokens back after one second
    assert not budget.feed(frame(PING, payload=bytes(8)), 1.0)
