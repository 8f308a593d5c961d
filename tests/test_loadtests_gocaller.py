"""``--generator go``: the kube-apiserver's own HTTP client (Go's net/http as client-go configures it
for webhooks) as the load generator, against a real TLS backend — what it records for each review,
how it holds its connections, and a real overload run through it."""

from __future__ import annotations

import json
import math
import socket
import ssl
import struct
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import trio
import trustme

from gateway.devtools.backends import BackendServer, serve_backend
from loadtests.fixtures import review_templates
from loadtests.gocaller import ABANDONED, ANSWERED, LOST, PLACEHOLDER, GoCaller, GoResult
from loadtests.overload import answers_of

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def backend(tmp_path: Path, nursery: trio.Nursery) -> tuple[BackendServer, Path]:
    """A real backend over TLS offering h2 and HTTP/1.1, and the file of its CA."""
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    server: BackendServer = await nursery.start(partial(serve_backend, ssl_context=context))
    return server, ca_file


def caller(backend: tuple[BackendServer, Path], path: str, timeout: float = 5.0) -> GoCaller:
    server, ca_file = backend
    body = review_templates(8, "v1")[0].body(PLACEHOLDER)
    return GoCaller(f"https://127.0.0.1:{server.port}{path}", ca_file, body, timeout, warmup=0.0)


async def test_every_review_is_recorded_at_its_scheduled_time_and_checked_against_its_uid(
    backend: tuple[BackendServer, Path],
) -> None:
    offsets = [0.01 * i for i in range(20)]
    result = await caller(backend, "/allow").open_loop(offsets)
    assert result.due == pytest.approx(offsets, abs=1e-6)
    assert result.code == [ANSWERED] * 20
    assert all(0 < lat < 5 for lat in result.latency)
    assert result.errors == {}
    assert len(backend[0].calls) == 20, "each review reached the backend once"


async def test_an_answer_for_another_uid_is_a_wrong_answer_never_an_answer_in_time(
    backend: tuple[BackendServer, Path],
) -> None:
    result = await caller(backend, "/wrong-uid").open_loop([0.0, 0.01, 0.02])
    assert result.errors == {"wrong-answer": 3}
    assert all(math.isnan(lat) for lat in answers_of(result).latency)


async def test_it_speaks_http11_to_a_backend_that_offers_h2_as_the_apiserver_calls_a_service(
    backend: tuple[BackendServer, Path],
) -> None:
    result = await caller(backend, "/allow").open_loop([0.0])
    assert result.protocol == "HTTP/1.1"


async def test_sequential_reviews_reuse_one_idle_connection_instead_of_dialling(
    backend: tuple[BackendServer, Path],
) -> None:
    result = await caller(backend, "/allow").open_loop([0.05 * i for i in range(10)])
    assert (result.stats["opened"], result.stats["reused"]) == (1, 9)


async def test_a_review_past_its_deadline_is_abandoned_and_its_connection_closed(
    backend: tuple[BackendServer, Path],
) -> None:
    """Go closes the connection of a request it cancelled: the next review dials a new one."""
    result = await caller(backend, "/sleep/400/allow", timeout=0.1).open_loop([0.0, 0.3, 0.6])
    assert result.code == [ABANDONED] * 3
    assert (result.stats["closed_abandoned"], result.stats["opened"], result.stats["reused"]) == (3, 3, 0)


async def test_reviews_that_find_no_idle_connection_each_dial_one_without_limit(
    backend: tuple[BackendServer, Path],
) -> None:
    """40 reviews at once against a 200 ms backend: 40 connections, no queueing behind a bound."""
    result = await caller(backend, "/sleep/200/allow").open_loop([0.0] * 40)
    assert result.code == [ANSWERED] * 40
    assert result.stats["opened"] == 40
    assert len(result.dials) == 40


@pytest.mark.parametrize(
    ("path", "offsets", "timeout", "peak"),
    [
        pytest.param("/allow", [0.05 * i for i in range(10)], 5.0, 1, id="sequential reviews on one kept connection: 1 open at the peak"),
        pytest.param("/sleep/200/allow", [0.0] * 40, 5.0, 40, id="40 reviews at once that each dial: 40 open at the peak"),
        pytest.param("/sleep/400/allow", [0.0, 0.3, 0.6], 0.1, 1, id="a connection closed with its abandoned review counts out before the next dial: 1 at the peak"),
    ],
)  # fmt: skip
async def test_the_peak_of_open_connections_and_the_dial_time_are_reported(
    backend: tuple[BackendServer, Path], path: str, offsets: list[float], timeout: float, peak: int
) -> None:
    result = await caller(backend, path, timeout=timeout).open_loop(offsets)
    assert result.stats["peak_open"] == peak
    assert 0 < result.stats["dial_us_total"] < 5_000_000 * result.stats["opened"], result.stats


async def test_a_closed_loop_keeps_its_callers_busy_for_its_seconds(
    backend: tuple[BackendServer, Path],
) -> None:
    result: GoResult = await caller(backend, "/allow").closed_loop(4, 0.5)
    assert result.reviews > 4
    assert set(result.code) == {ANSWERED}
    # no churn: about one connection per caller (Go's late binding may finish a dial or two that a
    # released connection made unnecessary; those join the idle pool)
    assert result.stats["opened"] <= 8 < result.reviews


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="overload through the Go caller: every answer correct, shed ones fail open"),
        pytest.param(["--shed-cost"], id="the shed cost through the Go caller: a full and a shed review"),
    ],
)
def test_overload_runs_with_the_go_caller(tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "overload.json"
    argv = [sys.executable, "-m", "loadtests", "overload", "--quick", "--generator", "go", "--run", "both"]
    proc = subprocess.run(
        [*argv, *extra, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    if extra:
        full, shed = doc
        assert (full["failed_open_pct"], shed["failed_open_pct"]) == (0.0, 100.0)
        return
    (mode,) = doc["modes"]
    assert [s["name"] for s in mode["segments"]] == ["before", "overload", "after"]
    assert all(kind == "connection-lost" for kind in mode["errors"]), mode["errors"]
    assert mode["connections"]["opened"] >= 1
    assert mode["rss_mb"], "RSS was sampled during the run"
    assert sum(s["offered_rps"] for s in mode["segments"]) > 0


async def test_a_failed_dial_is_counted_by_its_reason_without_the_ports(
    backend: tuple[BackendServer, Path], nursery: trio.Nursery
) -> None:
    """A server that resets every connection: each review's dial fails, and the reasons are grouped
    (client ports would make every message distinct)."""

    async def reset(stream: trio.SocketStream) -> None:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, reset, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    dead = GoCaller(
        f"https://127.0.0.1:{port}/allow",
        backend[1],
        review_templates(8, "v1")[0].body(PLACEHOLDER),
        2.0,
        warmup=0.0,
    )
    result = await dead.open_loop([0.02 * i for i in range(12)])
    assert result.code == [LOST] * 12
    assert result.errors == {"connection-lost": 12}
    assert sum(result.dial_errors.values()) == result.stats["dial_errors"] >= 12
    assert all("127.0.0.1:PORT" in msg for msg in result.dial_errors), result.dial_errors
    # connect, write or read reset: a reason each, not one message per client port
    assert len(result.dial_errors) <= 3, result.dial_errors
