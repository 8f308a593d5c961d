"""The inbound limits' arithmetic: the derived connection bounds (descriptors, memory) and the frame
budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.server.limits import FrameBudget, InboundLimits, InboundRuntime, connection_bounds
from gateway.server.memory import memory_limit, parse_size
from tests.support.inbound import DATA, GOAWAY, HEADERS, PING, PREFACE, frame, settings

MiB = 1 << 20

BOUNDS = [
    pytest.param(
        InboundLimits(max_connections=100),
        1024,
        None,
        0,
        (100, 25),
        id="an explicit --max-inbound-connections wins",
    ),
    pytest.param(
        InboundLimits(),
        1024,
        None,
        0,
        (512, 128),
        id="no memory limit: the fd limit 1024 minus the 512 reserve",
    ),
    pytest.param(
        InboundLimits(), 128, None, 0, (64, 16), id="a small fd limit gives at most half to the reserve"
    ),
    pytest.param(
        InboundLimits(),
        1 << 20,
        256 * MiB,
        64 * MiB,
        (1126, 281),
        id="256 MiB limit, 64 MiB resident: half of what is left under 80 % at 64 KiB each; "
        "a quarter of them pending",
    ),
    pytest.param(InboundLimits(), 1024, 256 * MiB, 64 * MiB, (512, 128), id="the fd bound when it is lower"),
    pytest.param(
        InboundLimits(max_pending=50),
        1 << 20,
        256 * MiB,
        64 * MiB,
        (1126, 50),
        id="an explicit --max-pending-connections wins",
    ),
    pytest.param(
        InboundLimits(max_connections=100_000),
        1 << 20,
        256 * MiB,
        64 * MiB,
        (100_000, 375),
        id="an explicit connection bound: the pending bound still fits the handshakes' share of memory",
    ),
    pytest.param(
        InboundLimits(), 1 << 20, 256 * MiB, 230 * MiB, (1, 1), id="a process already over 80 % of its limit"
    ),
]


@pytest.mark.parametrize(("limits", "nofile", "memory", "resident", "expected"), BOUNDS)
def test_connection_bounds(
    limits: InboundLimits, nofile: int, memory: int | None, resident: int, expected: tuple[int, int]
) -> None:
    bounds = connection_bounds(limits, nofile=nofile, memory_limit=memory, resident=resident)
    assert (bounds.connections, bounds.pending) == expected


def test_workers_share_the_memory_limit() -> None:
    one = connection_bounds(
        InboundLimits(), nofile=1 << 20, memory_limit=512 * MiB, resident=64 * MiB, processes=2
    )
    alone = connection_bounds(InboundLimits(), nofile=1 << 20, memory_limit=256 * MiB, resident=64 * MiB)
    assert one == alone


CGROUPS = [
    pytest.param("0::/pod/gateway\n", {"pod/gateway/memory.max": "268435456\n"}, 268435456, id="cgroup v2"),
    pytest.param(
        "0::/pod/gateway\n",
        {"pod/gateway/memory.max": "max\n", "pod/memory.max": "536870912\n"},
        536870912,
        id="cgroup v2: the tightest limit on the way to the root",
    ),
    pytest.param("0::/\n", {"memory.max": "max\n"}, None, id="cgroup v2 without a limit"),
    pytest.param(
        "4:memory:/kubepods/pod1\n2:cpu,cpuacct:/kubepods/pod1\n",
        {"memory/kubepods/pod1/memory.limit_in_bytes": "268435456\n"},
        268435456,
        id="cgroup v1",
    ),
    pytest.param(
        "4:memory:/\n",
        {"memory/memory.limit_in_bytes": "9223372036854771712\n"},
        None,
        id="cgroup v1 without a limit",
    ),
    pytest.param(None, {}, None, id="no /proc/self/cgroup"),
]


@pytest.mark.parametrize(("proc", "files", "expected"), CGROUPS)
def test_memory_limit_from_the_cgroup(
    tmp_path: Path, proc: str | None, files: dict[str, str], expected: int | None
) -> None:
    root = tmp_path / "sys"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc_file = tmp_path / "cgroup"
    if proc is not None:
        proc_file.write_text(proc)
    assert memory_limit(proc_cgroup=proc_file, cgroup_root=root) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("268435456", 268435456), ("256Mi", 256 * MiB), ("1Gi", 1 << 30), ("512M", 512_000_000), ("2k", 2000)],
)
def test_memory_limit_option_takes_kubernetes_quantities(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_a_memory_limit_that_is_not_a_size_is_refused() -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def _feed_all(budget: FrameBudget, data: bytes, *, step: int | None = None, now: float = 0.0) -> bool:
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
        PREFACE
        + b"".join(
            frame(HEADERS, 0x4, sid, b"\x82")
            + frame(DATA, 0, sid, b"x" * 16384)
            + frame(DATA, 0x1, sid, b"x" * 900)
            for sid in range(1, 401, 2)
        ),
        True,
        id="200 requests, each in a full DATA frame and a shorter last one, cost nothing",
    ),
    pytest.param(PREFACE + frame(DATA, 0, 1) * 101, False, id="empty DATA without END_STREAM costs a token"),
    pytest.param(PREFACE + frame(DATA, 0x1, 1) * 101, True, id="empty DATA with END_STREAM is free"),
    pytest.param(PREFACE + frame(DATA, 0, 1, b"x") * 101, False, id="101 one-byte DATA frames exceed 100"),
    pytest.param(
        PREFACE + frame(DATA, 0, 1, b"x" * 2048) * 199, True, id="a 2 KiB DATA frame costs half a token (199)"
    ),
    pytest.param(PREFACE + frame(DATA, 0, 1, b"x" * 2048) * 202, False, id="... 202 of them exceed 100"),
    pytest.param(
        PREFACE + frame(DATA, 0, 1, b"x" * 4096) * 500, True, id="DATA frames of 4 KiB or more are free"
    ),
    pytest.param(
        PREFACE + frame(HEADERS, 0x4, 1, b"\x82") + frame(HEADERS, 0x4, 1, b"\x82") * 101,
        False,
        id="HEADERS on a stream already open (trailers) cost a token each",
    ),
    pytest.param(PREFACE + frame(GOAWAY, payload=bytes(8)) * 101, False, id="GOAWAY costs a token"),
    pytest.param(PREFACE + frame(0x42, 0, 0, b"??") * 101, False, id="frames of unknown types cost a token"),
]


@pytest.mark.parametrize(("data", "within"), BUDGET_CASES)
@pytest.mark.parametrize("step", [None, 1, 7], ids=["in one read", "byte by byte", "in 7-byte reads"])
def test_control_frame_budget(data: bytes, within: bool, step: int | None) -> None:
    """The frame scanner sees the same frames however the bytes are split into reads."""
    assert _feed_all(FrameBudget(100, 10.0, 32), data, step=step) is within


def test_server_resets_and_small_chunks_are_charged() -> None:
    """``charge``: a reset the server sends costs 10 tokens; ``small``: a chunk like a DATA frame."""
    budget = FrameBudget(100, 10.0, 32)
    for _ in range(10):
        assert budget.charge(FrameBudget.RESET_COST, 0.0)
    assert not budget.charge(FrameBudget.RESET_COST, 0.0)  # the 11th reset within the same instant
    chunks = FrameBudget(100, 10.0, 0, preface=0)
    assert all(chunks.small(8192, 0.0) for _ in range(1000))
    assert all(chunks.small(1, 0.0) for _ in range(100))
    assert not chunks.small(1, 0.0)


def test_control_frame_budget_refills_over_time() -> None:
    budget = FrameBudget(100, 10.0, 32)
    assert budget.feed(PREFACE + frame(PING, payload=bytes(8)) * 100, 0.0)
    assert not FrameBudget(100, 10.0, 32).feed(PREFACE + frame(PING, payload=bytes(8)) * 101, 0.0)
    assert budget.feed(frame(PING, payload=bytes(8)) * 10, 1.0)  # 10 tokens back after one second
    assert not budget.feed(frame(PING, payload=bytes(8)), 1.0)


def test_a_client_is_idle_for_as_long_as_its_longest_waiting_connection() -> None:
    """``InboundRuntime.idle_for``: what says whether a client's dial may have a review waiting for it
    (the handshake gate's ``--handshake-rate``): a connection counts from when it last went idle
    until its next request or its close; other clients do not count."""
    runtime = InboundRuntime()
    a, b, other = object(), object(), object()
    assert runtime.idle_for("10.0.0.1", 5.0) == 0
    runtime.connection_idle("10.0.0.1", a, 1.0)
    runtime.connection_idle("10.0.0.1", b, 3.0)
    runtime.connection_idle("10.0.0.2", other, 0.0)
    assert runtime.idle_for("10.0.0.1", 5.0) == 4.0  # a, since 1.0
    runtime.connection_busy("10.0.0.1", a)  # a request on it
    assert runtime.idle_for("10.0.0.1", 5.0) == 2.0  # b, since 3.0
    runtime.connection_busy("10.0.0.1", b)  # closed
    assert runtime.idle_for("10.0.0.1", 5.0) == 0
    assert runtime.idle == {"10.0.0.2": {other: 0.0}}  # nothing kept for a client without one idle
    runtime.connection_busy("10.0.0.1", a)  # twice: no harm
    runtime.connection_idle("10.0.0.1", b, 4.0)
    runtime.connection_idle("10.0.0.1", a, 4.5)
    runtime.connection_idle("10.0.0.1", b, 4.8)  # idle again: counts from its latest
    assert runtime.idle_for("10.0.0.1", 5.0) == 0.5  # a, since 4.5
