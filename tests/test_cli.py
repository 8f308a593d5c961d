"""The real command line: `webhook-gateway` as a separate process, `check`, options from the environment."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trustme

from gateway.devtools.backends import serve_backend
from loadtests.processes import free_port
from tests.support.client import connect
from tests.support.gateway import backend, review, write_config

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_help_documents_every_option_and_its_variable() -> None:
    """`--help` lists each option with the environment variable that can set it."""
    out = run_cli("--help").stdout
    for option in (
        "--config",
        "--bind",
        "--certfile",
        "--keyfile",
        "--client-ca",
        "--log-level",
        "--log-format",
        "--metrics-bind",
        "--backend-kubeconfig",
        "--namespace-source",
        "--drain-seconds",
    ):
        assert option in out
        assert "WEBHOOK_GATEWAY_" + option[2:].replace("-", "_").upper() in out


BAD_VALUES = [
    pytest.param(
        ["--memory-limit", "lots"], {}, "argument --memory-limit: 'lots' is not a size",
        id="an option given a value its type refuses: a usage error (exit 2) naming the option",
    ),
    pytest.param(
        [], {"WEBHOOK_GATEWAY_MEMORY_LIMIT": "lots"}, "WEBHOOK_GATEWAY_MEMORY_LIMIT: 'lots' is not a size",
        id="the same value from its environment variable: a usage error (exit 2) naming the variable, no traceback",
    ),
    pytest.param(
        [], {"WEBHOOK_GATEWAY_SHED_MAX_CPU": "1.5"}, "WEBHOOK_GATEWAY_SHED_MAX_CPU: a share of the CPU is > 0 and <= 1",
        id="--shed-max-cpu beyond the whole CPU, from its variable: a usage error naming it",
    ),
    pytest.param(
        ["--shed-max-cpu", "0"], {}, "argument --shed-max-cpu: a share of the CPU is > 0 and <= 1, not 0",
        id="--shed-max-cpu 0: a usage error",
    ),
    pytest.param(
        ["--handshake-rate", "-1"], {}, "argument --handshake-rate: a rate is a number >= 0, not -1",
        id="--handshake-rate below zero: a usage error",
    ),
    pytest.param(
        [], {"WEBHOOK_GATEWAY_HANDSHAKE_RATE": "nan"}, "WEBHOOK_GATEWAY_HANDSHAKE_RATE: a rate is a number >= 0, not nan",
        id="--handshake-rate not a number, from its variable: a usage error naming it",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("args", "env", "message"), BAD_VALUES)
def test_a_value_its_option_refuses_is_a_usage_error(
    args: list[str], env: dict[str, str], message: str
) -> None:
    result = run_cli(*args, env=env)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


CHECKS = [
    pytest.param(
        {
            "validating": {
                "ok": [
                    {
                        "name": "a.b.c",
                        "clientConfig": {"url": "https://x.example.com/v"},
                        "sideEffects": "None",
                        "admissionReviewVersions": ["v1"],
                    }
                ]
            }
        },
        0,
        ["OK: 1 validating and 0 mutating webhooks"],
        id="check: a valid directory exits 0 and summarises it",
    ),
    pytest.param(
        {
            "mutating": {
                "team-a": [
                    {
                        "name": "a.b.c",
                        "clientConfig": {"url": "https://x.example.com/v"},
                        "sideEffects": "None",
                        "admissionReviewVersions": ["v1"],
                        "timeoutSeconds": 45,
                    },
                    {
                        "name": "bad",
                        "clientConfig": {"url": "https://x.example.com/v"},
                        "sideEffects": "Maybe",
                        "admissionReviewVersions": ["v1"],
                    },
                ]
            }
        },
        1,
        [
            'MutatingWebhookConfiguration "team-a" webhooks[0].timeoutSeconds: Invalid value: 45: the timeout value '
            "must be between 1 and 30 seconds",
            'MutatingWebhookConfiguration "team-a" webhooks[1].name: Invalid value: "bad": should be a domain with at '
            "least three segments separated by dots",
            'MutatingWebhookConfiguration "team-a" webhooks[1].sideEffects: Unsupported value: "Maybe"',
            "3 error(s); configuration refused",
        ],
        id="CFG-23: check lists every problem with file, object and field, and exits 1",
    ),
]


@pytest.mark.parametrize(("configs", "code", "lines"), CHECKS)
def test_check(
    tmp_path: Path, configs: dict[str, dict[str, list[dict[str, object]]]], code: int, lines: list[str]
) -> None:
    """`webhook-gateway check --config DIR` validates without serving."""
    write_config(tmp_path, validating=configs.get("validating"), mutating=configs.get("mutating"))
    result = run_cli("check", "--config", str(tmp_path))
    assert result.returncode == code, result.stderr
    output = result.stdout + result.stderr
    for line in lines:
        assert line in output


def test_check_typo_is_a_warning(tmp_path: Path) -> None:
    """A misspelt field never passes silently: `check` warns, and --warnings-as-errors fails."""
    write_config(
        tmp_path,
        validating={
            "ok": [
                {
                    "name": "a.b.c",
                    "clientConfig": {"url": "https://x.example.com/v"},
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSecond": 5,
                }
            ]
        },
    )
    result = run_cli("check", "--config", str(tmp_path))
    assert result.returncode == 0
    assert "webhooks[0].timeoutSecond: unknown field" in result.stderr
    assert run_cli("check", "--config", str(tmp_path), "--warnings-as-errors").returncode == 1


def test_refuses_to_start_on_invalid_config(tmp_path: Path) -> None:
    """An invalid configuration at start-up is refused with its messages and a non-zero exit."""
    write_config(tmp_path, validating={"x": [{"name": "nope", "clientConfig": {"url": "https://x/v"}}]})
    result = run_cli("--config", str(tmp_path), "--bind", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert (
        'ValidatingWebhookConfiguration \\"x\\" webhooks[0].name' in result.stdout + result.stderr
        or 'ValidatingWebhookConfiguration "x" webhooks[0].name' in result.stdout + result.stderr
    )


@pytest.mark.parametrize("protocol", ["http1", "h2"], ids=["HTTP/1.1 over TLS", "h2 over TLS"])
async def test_end_to_end_process_with_tls_and_graceful_shutdown(
    nursery: trio.Nursery, tmp_path: Path, protocol: str
) -> None:
    """The real CLI serves TLS; on SIGTERM /readyz turns 503, an in-flight review finishes, exit code 0."""
    ca = trustme.CA()
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "tls.pem")
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    hooks = [backend("slow.example.com", "/allow")]
    hooks[0]["clientConfig"]["url"] = f"http://127.0.0.1:{server.port}/sleep/700/allow"
    write_config(tmp_path / "config", validating={"a": hooks})
    port = free_port()
    env = {**os.environ, "WEBHOOK_GATEWAY_BIND": f"127.0.0.1:{port}", "WEBHOOK_GATEWAY_DRAIN_SECONDS": "0.5"}
    proc = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "gateway",
            "--config",
            str(tmp_path / "config"),
            "--certfile",
            str(tmp_path / "tls.pem"),
            "--keyfile",
            str(tmp_path / "tls.pem"),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
    )
    try:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        with trio.fail_after(20):
            while True:
                try:
                    probe = await connect("127.0.0.1", port, protocol="http1", ssl_context=ctx)
                    got = await probe.post("/readyz", b"", method="GET")
                    if got is not None and got.status == 200:
                        break
                except OSError:
                    pass
                await trio.sleep(0.1)
        client = await connect("127.0.0.1", port, protocol=protocol, ssl_context=ctx)
        got = await client.post("/validate?timeout=10s", json.dumps(review()).encode())
        assert got is not None and got.json["response"]["allowed"] is True

        answers: list[int] = []

        async def in_flight() -> None:
            resp = await client.post("/validate?timeout=10s", json.dumps(review()).encode())
            answers.append(resp.status if resp else 0)

        async with trio.open_nursery() as inner:
            inner.start_soon(in_flight)
            await trio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            await trio.sleep(0.1)
            probe = await connect("127.0.0.1", port, protocol="http1", ssl_context=ctx)
            ready = await probe.post("/readyz", b"", method="GET")
            assert ready is not None and ready.status == 503  # draining: readyz fails, still serving
        assert answers == [200]
        with trio.fail_after(20):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
