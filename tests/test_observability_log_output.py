"""The real command line with its stdout on a real pipe: log output must never stop reviews.

In a cluster, stdout is a pipe to the container runtime. These tests start ``python -m gateway`` with
stdout connected to a pipe the test reads only when it chooses (or never, or closes), send real
reviews through real sockets (the backend is the sample backend server), and read what came out.
Review bodies are logged (``--log-bodies``) so that lines are large and the pipe fills quickly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from loadtests.processes import free_port
from tests.support.client import connect
from tests.support.gateway import backend, pod, review, write_config

REPO = Path(__file__).resolve().parent.parent
DROPPED = "webhook_gateway_log_lines_dropped_total"


@dataclass
class Gateway:
    process: trio.Process
    port: int
    stdout: int  # the read end of the pipe the gateway's stdout writes to
    out: bytearray = field(default_factory=bytearray)

    async def get(self, path: str) -> tuple[int, str]:
        client = await connect("127.0.0.1", self.port)
        try:
            resp = await client.post(path, b"", method="GET")
            assert resp is not None
            return resp.status, resp.body.decode()
        finally:
            await client.aclose()

    async def review(self, uid: str, padding: int) -> None:
        """One review, answered (allowed) within its ?timeout= deadline, on a new connection."""
        obj = pod()
        obj["metadata"]["annotations"] = {"padding": "x" * padding}
        with trio.fail_after(10):  # the review's own deadline: ?timeout=10s
            client = await connect("127.0.0.1", self.port)
            try:
                resp = await client.post("/validate?timeout=10s", json.dumps(review(obj, uid=uid)).encode())
                assert resp is not None and resp.status == 200
                assert resp.json["response"]["allowed"] is True
            finally:
                await client.aclose()

    async def dropped(self) -> float:
        status, text = await self.get("/metrics")
        assert status == 200
        return sum(
            s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == DROPPED
        )

    async def read_to_eof(self) -> None:
        stream = trio.lowlevel.FdStream(os.dup(self.stdout))
        async with stream:
            while chunk := await stream.receive_some(1 << 20):
                self.out += chunk

    def lines(self) -> list[dict[str, Any]]:
        """Every line written, parsed: each must be a whole JSON object."""
        assert self.out.endswith(b"\n")
        return [json.loads(line) for line in bytes(self.out).split(b"\n")[:-1]]

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
async def allow_backend(nursery: trio.Nursery) -> str:
    from gateway.devtools.backends import serve_backend

    server = await nursery.start(
        lambda task_status: serve_backend(record_calls=False, task_status=task_status)
    )
    return f"http://127.0.0.1:{server.port}"


@asynccontextmanager
async def gateway(tmp_path: Path, base: str, *args: str, workers: int = 1) -> AsyncIterator[Gateway]:
    hooks = [backend("check.example.com", "/allow")]
    hooks[0]["clientConfig"]["url"] = base + "/allow"
    write_config(tmp_path / "config", validating={"policy": hooks})
    read_end, write_end = os.pipe()
    port = free_port()
    try:
        process = await trio.lowlevel.open_process(
            [
                sys.executable, "-m", "gateway", "--config", str(tmp_path / "config"),
                "--bind", f"127.0.0.1:{port}", "--workers", str(workers), "--log-bodies",
                "--drain-seconds", "0", "--shutdown-timeout", "5", *args,
            ],
            cwd=REPO,
            stdout=write_end,
            stderr=subprocess.PIPE,
        )  # fmt: skip
    finally:
        os.close(write_end)  # the gateway's processes hold the only write ends: EOF when they exit
    gw = Gateway(process, port, read_end)
    try:
        with trio.fail_after(40):
            while (await _status(gw)) != 200:
                assert process.returncode is None, "the gateway exited before it was ready"
                await trio.sleep(0.1)
        yield gw
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        for pid in _workers_left(process.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(read_end)


async def _status(gw: Gateway) -> int | None:
    try:
        return (await gw.get("/readyz"))[0]
    except OSError:
        return None


def _workers_left(supervisor: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if b"worker_main" in (entry / "cmdline").read_bytes():
                    stat = (entry / "stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == supervisor:
                        found.append(int(entry.name))
    return found


async def _stderr(gw: Gateway) -> str:
    assert gw.process.stderr is not None
    data = bytearray()
    while chunk := await gw.process.stderr.receive_some(1 << 16):
        data += chunk
    return data.decode()


def _reviews(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line["event"] == "review"]


async def test_reviews_are_answered_while_nobody_reads_stdout_and_dropped_lines_are_counted_and_announced(
    tmp_path: Path, allow_backend: str
) -> None:
    """Lines of ~100 KB, 20 MB of them against a 64 KiB pipe nobody reads: every review is answered in
    time; the lines beyond the memory bound are counted in /metrics; once the pipe is read again, every
    line is whole JSON, and a "log lines dropped" line accounts for every review line missing."""
    async with gateway(tmp_path, allow_backend) as gw:
        sent = 200
        for i in range(sent):
            await gw.review(f"{i:08d}", padding=100_000)
        dropped = await gw.dropped()
        assert dropped > 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gw.read_to_eof)  # the reader is back
            await gw.review(f"{sent:08d}", padding=10)  # the first line after the gap
            gw.process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await gw.process.wait() == 0
    lines = gw.lines()
    notices = [line for line in lines if line["event"] == "log lines dropped"]
    assert [(line["level"], line["dropped"]) for line in notices] == [("warning", dropped)]
    reviews = _reviews(lines)
    assert len(reviews) + dropped == sent + 1
    after = next(i for i, line in enumerate(lines) if line.get("uid") == f"{sent:08d}")
    assert lines[after - 1] == notices[0]  # right before the first line accepted after the gap
    kept = [line["uid"] for line in reviews]
    assert kept == [f"{i:08d}" for i in range(len(kept) - 1)] + [f"{sent:08d}"]  # the newest were lost


async def test_two_workers_answer_reviews_while_nobody_reads_stdout_and_count_dropped_lines(
    tmp_path: Path, allow_backend: str
) -> None:
    """--workers 2 sharing a pipe nobody reads: reviews are answered in time, the workers' dropped
    lines add up in /metrics, and they exit cleanly once the pipe is read. (Lines of 100 KB are longer
    than PIPE_BUF: two processes writing them into a full pipe may interleave them, so their content is
    not checked here; lines up to PIPE_BUF are, in the next test.)"""
    async with gateway(tmp_path, allow_backend, workers=2) as gw:
        for i in range(250):
            await gw.review(f"{i:08d}", padding=100_000)
        await trio.sleep(0.6)  # the other worker's counters reach /metrics
        assert await gw.dropped() > 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gw.read_to_eof)
            gw.process.send_signal(signal.SIGTERM)
            with trio.fail_after(40):
                assert await gw.process.wait() == 0
    assert bytes(gw.out).count(b'"event":"log lines dropped"') >= 1


@pytest.mark.parametrize(
    "workers",
    [
        pytest.param(1, id="one process"),
        pytest.param(2, id="two workers sharing the pipe: no line torn by the other process's lines"),
    ],
)
async def test_lines_are_whole_in_order_and_sigterm_writes_out_what_is_buffered(
    tmp_path: Path, allow_backend: str, workers: int
) -> None:
    """~3 KB lines, 1 MB of them while nobody reads (the pipe holds 64 KiB: the rest waits in memory);
    then SIGTERM while the pipe is read: every review line comes out, whole, each process's in order."""
    async with gateway(tmp_path, allow_backend, workers=workers) as gw:
        sent = 300
        for i in range(sent):
            await gw.review(f"{i:08d}", padding=3000)
        async with trio.open_nursery() as nursery:
            gw.process.send_signal(signal.SIGTERM)
            nursery.start_soon(gw.read_to_eof)
            with trio.fail_after(30):
                assert await gw.process.wait() == 0
    reviews = _reviews(gw.lines())
    assert sorted(line["uid"] for line in reviews) == [f"{i:08d}" for i in range(sent)]
    by_process: dict[object, list[str]] = {}
    for line in reviews:
        by_process.setdefault(line.get("worker"), []).append(line["uid"])
    for uids in by_process.values():
        assert uids == sorted(uids)
    assert not any(line["event"] == "log lines dropped" for line in gw.lines())


async def test_a_stdout_nobody_reads_does_not_keep_the_gateway_from_exiting(
    tmp_path: Path, allow_backend: str
) -> None:
    """SIGTERM with lines still waiting for a pipe nobody reads: the gateway exits after the bounded
    wait (2 s) and says on stderr that it could not write them."""
    async with gateway(tmp_path, allow_backend) as gw:
        for i in range(100):
            await gw.review(f"{i:08d}", padding=3000)
        gw.process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await gw.process.wait() == 0
            stderr = await _stderr(gw)
    assert "log output (fd 1) is not being read" in stderr
    assert "exiting without them" in stderr


async def test_a_closed_stdout_neither_crashes_nor_spins_the_gateway(
    tmp_path: Path, allow_backend: str
) -> None:
    """The reader is gone (EPIPE): reviews are answered, the lines are counted as dropped, stderr says
    so once, the writer does not spin, and the gateway still stops cleanly."""
    async with gateway(tmp_path, allow_backend) as gw:
        os.close(gw.stdout)
        for i in range(50):
            await gw.review(f"{i:08d}", padding=10)
        await trio.sleep(0.2)  # a few linger periods: the writer meets EPIPE
        assert await gw.dropped() >= 50
        before = gw.cpu_seconds()
        await trio.sleep(1.0)
        assert gw.cpu_seconds() - before < 0.5  # idle, not retrying a dead pipe in a loop
        await gw.review("after", padding=10)
        gw.process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await gw.process.wait() == 0
            stderr = await _stderr(gw)
    assert stderr.count("Broken pipe") == 1
    assert "webhook_gateway_log_lines_dropped_total" in stderr
