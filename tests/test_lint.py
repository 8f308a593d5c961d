"""The code passes the project's own linters: ruff (lint and format), mypy strict, import-linter layers.

These run the tools the test extras install, so CI fails on a lint or type error like on a test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    found = BIN / name
    if found.exists():
        return str(found)
    located = shutil.which(name)
    assert located, f"{name} is not installed (pip install -e '.[test]')"
    return located


CHECKS = [
    pytest.param(["ruff", "check", "gateway", "tests", "loadtests", "benchmarks"], id="ruff lint"),
    pytest.param(
        ["ruff", "format", "--check", "gateway", "tests", "loadtests", "benchmarks"], id="ruff format"
    ),
    pytest.param(["mypy"], id="mypy strict on gateway/"),
    pytest.param(["lint-imports"], id="import-linter: the sans-IO core and the layer order"),
]


@pytest.mark.parametrize("command", CHECKS)
def test_linter_passes(command: list[str]) -> None:
    """Each linter exits 0 on the whole tree."""
    result = subprocess.run(
        [tool(command[0]), *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
