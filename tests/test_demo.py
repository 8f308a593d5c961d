"""`webhook-gateway demo` shows every kind of decision end to end on the bundled configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_shows_each_decision() -> None:
    """The demo allows, denies naming the backend, mutates with a combined patch, fails open and closed."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("ALLOWED") == 3
    assert 'DENIED 403 Forbidden\n   admission webhook "images.policy.example.com" denied the request' in out
    assert '{"op": "add", "path": "/metadata/labels/team-payments", "value": "true"}' in out
    assert "failed-open.validating.round_0_index_1 = slow-audit.example.com" in out
    assert (
        'DENIED 500 InternalError\n   Internal error occurred: failed calling webhook "quota.example.com"'
        in out
    )
    assert 'CONVERTED\n   {"schedule": {"cron": "0 1 * * *"}} as stable.example.com/v2' in out


def test_bundled_configuration_is_valid() -> None:
    """The bundled configuration (shipped in the package) passes `webhook-gateway check` with no warnings."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--config", "gateway/data/demo", "--warnings-as-errors"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_demo_runs_while_the_readme_backends_hold_their_port() -> None:
    """The demo picks free ports: it works while `python -m gateway.devtools.backends --port 18081` (the
    README's step) holds the port its bundled configuration names."""
    import socket

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind(("127.0.0.1", 18081))
            held.listen()
        except OSError:
            pass  # something already holds it: just as good
        result = subprocess.run(
            [sys.executable, "-m", "gateway", "demo"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=REPO,
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ALLOWED") == 3
    assert "127.0.0.1:18081" not in result.stdout
