"""Broken credential files at start-up, through the real CLI: one clear line, never a secret.

Every case runs ``python -m gateway`` as a subprocess over a broken file holding secret markers and
greps everything the process prints for them. A start-up refusal is one line naming the file and
the field, a non-zero exit code, and no traceback.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.support.gateway import hook, write_config

TOKEN = "tok-S3CR3T-7f3a"
PASSWORD = "pw-S3CR3T-91c2"
KEY = "key-S3CR3T-55d0"
SECRETS = (TOKEN, PASSWORD, KEY, base64.b64encode(f"admin:{PASSWORD}".encode()).decode())


@dataclass(frozen=True)
class Broken:
    """A broken file: its text, the CLI option that reads it, and what the one error line names."""

    text: str
    option: tuple[str, ...]  # with "{path}" for the file
    names: tuple[str, ...] = ()  # besides the file name: the field (or line) the error points at
    extra_args: tuple[str, ...] = field(default=())


def _kubeconfig(user: dict[str, object], server: str = "https://127.0.0.1:1") -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "c",
            "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            "clusters": [{"name": "k", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": user}, {"name": "*", "user": user}],
        }
    )


BACKEND = ("--backend-kubeconfig", "{path}")
CLUSTER = ("--namespace-source", "cluster", "--kubeconfig", "{path}")

CASES = [
    pytest.param(
        Broken(
            f"users:\n- name: '*'\n  user:\n    token: {TOKEN}\n    password: [{PASSWORD}\n",
            BACKEND,
            ("line",),
        ),
        id="a backend kubeconfig with a YAML syntax error never prints the lines around it",
    ),
    pytest.param(
        Broken(f"users:\n- name: '*'\n  user:\n\ttoken: {TOKEN}\n", BACKEND, ("line",)),
        id="a backend kubeconfig with a tab in its indentation never prints the lines around it",
    ),
    pytest.param(
        Broken(_kubeconfig({"token": TOKEN, "username": "admin", "password": PASSWORD}), BACKEND, ("token",)),
        id="TRN-11: a backend entry with both a token and basic auth is one line, no traceback",
    ),
    pytest.param(
        Broken(_kubeconfig({"token": TOKEN, "client-key-data": KEY}), BACKEND, ("client-key-data",)),
        id="a backend entry whose client-key-data is not base64 does not echo it",
    ),
    pytest.param(
        Broken(_kubeconfig({"token": {"value": TOKEN}}), BACKEND, ("token",)),
        id="a backend entry whose token is not a string does not echo it",
    ),
    pytest.param(
        Broken(_kubeconfig({"tokenFile": "missing-token"}), BACKEND, ("tokenFile",)),
        id="a backend entry whose tokenFile is missing names the field",
    ),
    pytest.param(
        Broken(
            _kubeconfig({"auth-provider": {"name": "oidc", "config": {"id-token": TOKEN}}}),
            BACKEND,
            ("auth-provider",),
        ),
        id="TRN-11: an auth-provider entry is refused without echoing its configuration",
    ),
    pytest.param(
        Broken(f"users:\n- name: u\n  user:\n    token: {TOKEN}\n  - [\n", CLUSTER, ("line",)),
        id="GW-01: the cluster kubeconfig with a YAML syntax error never prints the lines around it",
    ),
    pytest.param(
        Broken(_kubeconfig({"token": TOKEN, "username": "admin", "password": PASSWORD}), CLUSTER, ("token",)),
        id="GW-01: the cluster kubeconfig with both a token and basic auth is one line",
    ),
    pytest.param(
        Broken(
            _kubeconfig({"token": TOKEN}, server=f"ftp://admin:{PASSWORD}@127.0.0.1:1"), CLUSTER, ("server",)
        ),
        id="GW-01: the cluster server URL's user information is never echoed",
    ),
    pytest.param(
        Broken(
            _kubeconfig({"exec": {"command": "get-token", "args": [TOKEN]}}),
            CLUSTER,
            ("exec",),
        ),
        id="GW-01: an exec plugin in the cluster kubeconfig is refused without echoing it",
    ),
]


def _run(tmp_path: Path, args: list[str]) -> tuple[int, list[str]]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "--config",
            str(tmp_path / "config"),
            "--bind",
            "127.0.0.1:0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.returncode, (result.stdout + result.stderr).splitlines()


def _config(tmp_path: Path, url: str = "http://127.0.0.1:1/validate") -> None:
    write_config(tmp_path / "config", validating={"a": [hook("b.example.com", url)]})


@pytest.mark.parametrize("broken", CASES)
def test_a_broken_credential_file_is_refused_in_one_line_without_secrets(
    tmp_path: Path, broken: Broken
) -> None:
    _config(tmp_path)
    path = tmp_path / "credentials.yaml"
    path.write_text(broken.text)
    args = [part.format(path=path) for part in broken.option]
    code, lines = _run(tmp_path, args)
    output = "\n".join(lines)
    assert code != 0, output
    assert "Traceback" not in output, output
    for secret in SECRETS:
        assert secret not in output, output
    naming = [line for line in lines if str(path) in line]
    assert len(naming) == 1, output
    for name in broken.names:
        assert name in naming[0], naming[0]


def test_a_url_with_user_information_never_echoes_the_password(tmp_path: Path) -> None:
    """CFG-14: the URL's user information is refused, and its password is not printed."""
    _config(tmp_path, url=f"https://admin:{PASSWORD}@backend.example.com/validate")
    code, lines = _run(tmp_path, [])
    output = "\n".join(lines)
    assert code != 0, output
    assert "user information is not permitted" in output, output
    assert "Traceback" not in output, output
    for secret in SECRETS:
        assert secret not in output, output
