"""Every command the docs show works (issue 33 §8): each `webhook-gateway …` line of a fenced block in
README.md and docs/*.md runs, as a user types it, in an empty directory — the installed package and
nothing of this repository but what the command names: the samples `webhook-gateway demo
--write-samples samples` writes, and (for the deploy commands, run from a clone) a copy of deploy/
with those samples as its backends (deploy.md's step 1).

The only things changed are what belongs to this machine: the samples' backend port (the sample
backends run on a free port instead of 18081, which other tests may hold), the serving port, and
`~/.kube/config` (the real control plane's kubeconfig). A command passes when it does not fail to
run (exit 2, a traceback, an `error:` line) and exits as the table below says (0 unless the command
exists to report a finding).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadtests.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SAMPLE_BACKENDS = "127.0.0.1:18081"

# Commands that exist to report a finding: their documented exit code (docs/configuration.md#exit-codes).
FINDINGS = {
    # the sample review is a Pod from an untrusted registry: denied
    "webhook-gateway explain --config samples/config samples/review.json --call": 1,
    # samples/objects.yaml: one Pod denied, one whose quota backend is down (denial wins)
    "webhook-gateway audit --config samples/config samples/objects.yaml": 1,
    "webhook-gateway audit --config samples/config samples/objects.yaml -o policyreport > report.yaml": 1,
}


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for every line of a fenced block that runs `webhook-gateway` (continuations joined)."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```[a-z]*\n(.*?)```", doc.read_text(), re.S):
            lines = block.split("\n")
            i = 0
            while i < len(lines):
                line = lines[i]
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                command = line.split(" #", 1)[0].strip()  # a trailing comment is not part of it
                if re.match(r"webhook-gateway(\s|$)", command):
                    found.append((str(doc.relative_to(ROOT)), command))
                i += 1
    return found


def _bin() -> str:
    """The directory of the installed `webhook-gateway` script (the venv the tests run in)."""
    found = shutil.which("webhook-gateway") or str(Path(sys.executable).parent / "webhook-gateway")
    assert Path(found).exists(), "webhook-gateway is not installed (pip install -e '.[test,loadtest]')"
    return str(Path(found).parent)


@dataclass
class Workspace:
    directory: Path
    env: dict[str, str]
    port: int  # the sample backends'

    def localize(self) -> None:
        """Point the samples at the sample backends' port (again: a documented command rewrites them)."""
        for file in (self.directory / "samples" / "config").iterdir():
            file.write_text(file.read_text().replace(SAMPLE_BACKENDS, f"127.0.0.1:{self.port}"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    directory = tmp_path_factory.mktemp("empty")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOK_GATEWAY_")}
    env["PATH"] = _bin() + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ""  # nothing of the repository's tree but the installed package
    written = subprocess.run(
        ["webhook-gateway", "demo", "--write-samples", "samples"],
        cwd=directory, env=env, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    port = free_port()
    Workspace(directory, env, port).localize()
    # deploy.md's commands run in a clone whose deploy/base/backends holds the user's backends
    shutil.copytree(
        ROOT / "deploy", directory / "deploy", ignore=shutil.ignore_patterns("tls-secret.yaml", "certs")
    )
    shutil.copy(
        directory / "samples" / "config" / "webhooks.yaml", directory / "deploy" / "base" / "backends"
    )
    backends = subprocess.Popen(
        [sys.executable, "-m", "gateway.devtools.backends", "--port", str(port)],
        cwd=directory, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the sample backends did not start"
                time.sleep(0.1)
        yield Workspace(directory, env, port)
    finally:
        os.kill(backends.pid, signal.SIGTERM)
        backends.wait(10)


def _serves(command: str) -> bool:
    words = command.split()
    return len(words) > 1 and (words[1] == "serve" or words[1].startswith("--")) and "--config" in words


def hint_commands() -> list[tuple[str, str]]:
    """The commands `webhook-gateway demo` prints as its closing hint."""
    from gateway.demo import hint

    return [("the demo's hint", line.strip()) for line in hint("samples").splitlines()
            if line.strip().startswith("webhook-gateway ")]  # fmt: skip


COMMANDS = doc_commands() + hint_commands()


def test_the_docs_show_commands() -> None:
    """The extraction finds the getting-started walk-through (a test that finds nothing cannot fail)."""
    files = {f for f, _ in COMMANDS}
    assert {"docs/getting-started.md", "docs/deploy.md"} <= files
    assert len(COMMANDS) >= 12


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{f}: {c}" for f, c in COMMANDS])
def test_every_documented_command_runs(
    doc: str, command: str, workspace: Workspace, request: pytest.FixtureRequest
) -> None:
    workspace.localize()
    line = command
    if "~/.kube/config" in line:
        plane = request.getfixturevalue("control_plane")
        line = line.replace("~/.kube/config", str(plane.kubeconfig))
    if _serves(line):
        port = free_port()
        line = re.sub(r"--bind \S+", f"--bind 127.0.0.1:{port}", line)
        served = subprocess.Popen(
            "exec " + line, shell=True, cwd=workspace.directory, env=workspace.env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            ready = False
            while not ready and time.monotonic() < deadline and served.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as got:
                        ready = got.status == 200
                except OSError:
                    time.sleep(0.2)
            assert ready, f"{doc}: `{command}` never became ready (exit {served.poll()})"
        finally:
            os.killpg(served.pid, signal.SIGTERM)
            out, _ = served.communicate(timeout=60)
        assert served.returncode == 0, out.decode(errors="replace")[-2000:]
        return
    got = subprocess.run(
        line, shell=True, cwd=workspace.directory, env=workspace.env,
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    output = got.stdout + got.stderr
    assert "Traceback" not in output and "error:" not in got.stderr, f"{doc}: `{command}`:\n{output[-3000:]}"
    assert got.returncode == FINDINGS.get(command, 0), (
        f"{doc}: `{command}` exited {got.returncode}:\n{output[-3000:]}"
    )
