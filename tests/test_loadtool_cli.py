"""The load tool's rough edges (issue 16 §2): --target needs no scenario and the header states its real
transport; the mixed ratio compares like with like; --plot without matplotlib fails at once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from gateway.devtools.backends import serve_backend
from loadtests.report import describe
from loadtests.runner import Options, RunResult, direct_workload
from loadtests.scenarios import build
from tests.support.gateway import hook, start_gateway, write_config

REPO = Path(__file__).resolve().parent.parent


async def loadtool(*args: str, env: dict[str, str] | None = None, prelude: str = "") -> tuple[int, str]:
    code = f"import sys\n{prelude}\nfrom loadtests.__main__ import main\nsys.exit(main(sys.argv[1:]))"
    got = await trio.run_process(
        [sys.executable, "-c", code, *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    return got.returncode, got.stdout.decode() + got.stderr.decode()


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        pytest.param("http://gw.example.com:8080", "HTTP/1.1 keep-alive (plaintext)", id="an http:// target is plaintext"),
        pytest.param("https://gw.example.com", "HTTP/1.1 keep-alive over TLS", id="an https:// target is TLS"),
    ],
)  # fmt: skip
def test_header_states_the_targets_real_transport(target: str, expected: str) -> None:
    header = describe(RunResult(build("passthrough"), Options(target=target, tls=True)))
    assert expected in header
    assert header.startswith(f"target {target}: its own configuration")


def test_mixed_baseline_makes_as_many_calls_per_review_as_the_gateway() -> None:
    """mixed: the gateway phase sends /mutate and /validate per review, so the direct phase makes two calls."""
    from loadtests.fixtures import review_templates

    scenario = build("mixed")
    work = direct_workload(scenario, None, "/allow", {"fast": review_templates(2, "v1")})  # type: ignore[arg-type]
    assert {len(steps) for _, steps in work.mixes} == {2}
    passthrough = direct_workload(build("passthrough"), None, "/allow", {"fast": review_templates(2, "v1")})  # type: ignore[arg-type]
    assert {len(steps) for _, steps in passthrough.mixes} == {1}


async def test_plot_without_matplotlib_fails_before_any_work() -> None:
    """--plot says at once that it needs the loadtest extra, instead of crashing after a whole run."""
    code, out = await loadtool("passthrough", "--plot", "x.png", prelude="sys.modules['matplotlib'] = None")
    assert code == 2
    assert "--plot needs matplotlib: pip install 'webhook-gateway[loadtest]'" in out
    assert "starting" not in out


async def test_scenario_is_required_without_target() -> None:
    code, out = await loadtool()
    assert code == 2 and "a scenario is required (or --target URL" in out


@pytest.mark.slow
async def test_target_needs_no_scenario(nursery: trio.Nursery, tmp_path: Path) -> None:
    """--target URL alone drives an already-running gateway; the header says plaintext for http://."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    write_config(
        tmp_path, validating={"a": [hook("allow.example.com", f"http://127.0.0.1:{server.port}/allow")]}
    )
    running = await start_gateway(nursery, tmp_path)
    code, out = await loadtool(
        "--target", running.urls[0], "--quick", "--duration", "0.5", "--no-progress", "--no-direct"
    )
    assert code == 0, out
    assert f"target {running.urls[0]}: its own configuration" in out
    assert "(plaintext)" in out
