"""The command line's rough edges (issue 16 §2): version, usage, help defaults, one-line start-up
failures, `check` inputs and warning codes, and refusing a configuration without webhooks."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import trio

from gateway import __version__
from gateway.cli import COMMANDS, parse
from gateway.devtools.backends import serve_backend
from gateway.observability import Observability, configure_logging
from gateway.server.serve import Running, serve
from gateway.settings import ServeSettings
from tests.support.gateway import gateway_client, hook, review, write_config

REPO = Path(__file__).resolve().parent.parent
VALID = {"ok": [hook("a.example.com", "https://x.example.com/v")]}


def run_cli(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        cwd=REPO,
        input=stdin,
        env={**os.environ, **(env or {})},
    )


def test_version() -> None:
    """--version prints the package version, for every command."""
    assert run_cli("--version").stdout.strip() == f"webhook-gateway {__version__}"
    assert run_cli("check", "--version").stdout.strip() == f"webhook-gateway {__version__}"


def test_usage_lists_the_subcommands() -> None:
    """The usage line and --help name every subcommand with a one-line summary."""
    out = run_cli("--help").stdout
    usage = out.splitlines()[0]
    for command in COMMANDS:
        assert command in usage
        assert f"\n  {command} " in out


def test_demo_help_shows_real_defaults() -> None:
    """`demo --help` says what the defaults really are, not an empty string."""
    out = " ".join(run_cli("demo", "--help").stdout.split())
    assert "(default: the bundled gateway/data/demo)" in out
    assert "(default: console)" in out


def test_every_serve_option_is_a_settings_field() -> None:
    """All serve options land in one typed, frozen ServeSettings (no option read elsewhere)."""
    settings = parse(["--bind", "127.0.0.1:1", "--patch-mode", "diff", "--allow-empty-config"]).options
    assert isinstance(settings, ServeSettings)
    assert (settings.bind, settings.patch_mode, settings.allow_empty_config) == ("127.0.0.1:1", "diff", True)
    with pytest.raises(AttributeError):
        settings.bind = "x"  # type: ignore[misc]
    assert parse([], "x").options == ServeSettings()  # the parser's defaults are the settings' defaults


def test_environment_variables_still_set_options(tmp_path: Path) -> None:
    """WEBHOOK_GATEWAY_<OPTION> sets an option; the command line wins."""
    write_config(
        tmp_path, validating={"ok": [hook("a.example.com", "https://x.example.com/v", timeoutSecond=5)]}
    )
    env = {"WEBHOOK_GATEWAY_CHECK_IGNORE_WARNING": "unknown-field", "WEBHOOK_GATEWAY_CONFIG": str(tmp_path)}
    got = run_cli("check", "--warnings-as-errors", env=env)
    assert got.returncode == 0, got.stderr
    assert run_cli("check", "--warnings-as-errors", "--ignore-warning", "other", env=env).returncode == 1


def _variables() -> dict[str, set[tuple[str, str]]]:
    """Every variable any command reads: its (command, option) pairs."""
    import argparse

    from gateway.cli import _command
    from gateway.commands.options import env_name

    found: dict[str, set[tuple[str, str]]] = {}
    for command in COMMANDS:
        prog = "webhook-gateway" if command == "serve" else f"webhook-gateway {command}"
        for action in _command(command).build_parser(prog)._actions:
            flags = [f for f in action.option_strings if f.startswith("--")]
            if isinstance(action, argparse._HelpAction) or not flags:
                continue
            flag = flags[0]
            if "[env: " not in (action.help or ""):
                continue
            name = env_name(flag, command)
            assert f"[env: {name}]" in (action.help or ""), (command, flag)
            found.setdefault(name, set()).add((command, flag))
    return found


# A variable more than one command reads means the same thing in each (issue 33 §7).
SAME_MEANING = {
    "WEBHOOK_GATEWAY_CONFIG": "the gateway's configuration (directory or file)",
    "WEBHOOK_GATEWAY_ALLOW_EMPTY_CONFIG": "accept a configuration without webhooks",
    "WEBHOOK_GATEWAY_STRICT_HTTPS": "refuse http:// backend URLs",
    "WEBHOOK_GATEWAY_UNKNOWN_NAMESPACE": "a namespace without a Namespace object: 404 or no labels",
    "WEBHOOK_GATEWAY_BACKEND_KUBECONFIG": "per-host backend credentials",
    "WEBHOOK_GATEWAY_KUBECONFIG": "the cluster's kubeconfig",
    "WEBHOOK_GATEWAY_DEADLINE_MARGIN": "the gateway's answer margin",
    "WEBHOOK_GATEWAY_VALIDATE_PATH": "the gateway's validating path",
    "WEBHOOK_GATEWAY_MUTATE_PATH": "the gateway's mutating path",
    "WEBHOOK_GATEWAY_REGISTRATION_NAMESPACE": "the gateway's own namespace (serve --registration-namespace, "
    "registration --namespace)",
    "WEBHOOK_GATEWAY_REGISTRATION_SERVICE": "the gateway's Service",
    "WEBHOOK_GATEWAY_REGISTRATION_CA_BUNDLE": "the CA bundle of the gateway's registrations",
}


def test_a_variable_means_one_thing() -> None:
    """Variables read by several commands are exactly the shared ones; every other option of a subcommand
    reads WEBHOOK_GATEWAY_<COMMAND>_<OPTION>, so `WEBHOOK_GATEWAY_NAMESPACE` cannot mean explain's object
    namespace, audit's filter and registration's own namespace at once."""
    shared = {name for name, users in _variables().items() if len(users) > 1}
    assert shared <= set(SAME_MEANING), shared - set(SAME_MEANING)
    assert "WEBHOOK_GATEWAY_NAMESPACE" not in _variables()
    assert _variables()["WEBHOOK_GATEWAY_AUDIT_NAMESPACE"] == {("audit", "--namespace")}


def test_an_exported_config_does_not_hijack_the_demo() -> None:
    """demo's --config is a demo configuration: WEBHOOK_GATEWAY_CONFIG (the gateway's) leaves it alone."""
    got = run_cli("demo", env={"WEBHOOK_GATEWAY_CONFIG": "/nonexistent/webhooks"})
    assert got.returncode == 0, got.stderr
    assert got.stdout.count("ALLOWED") == 3 and "CONVERTED" in got.stdout


def _listening_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize(
    "option", ["--bind", "--metrics-bind"], ids=["serving port busy", "metrics port busy"]
)
def test_busy_port_is_one_line(tmp_path: Path, option: str) -> None:
    """A busy port ends start-up with one line naming the address and what to do, exit code 1."""
    write_config(tmp_path, validating=VALID)
    with _listening_socket() as busy:
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        args = ["--config", str(tmp_path), "--log-level", "error"]
        args += ["--bind", address] if option == "--bind" else ["--bind", "127.0.0.1:0", option, address]
        got = run_cli(*args)
    assert got.returncode == 1
    line = _one_line(got.stderr)
    assert f"cannot listen on {address}: address already in use" in line
    assert "choose another address" in line
    assert "Traceback" not in got.stdout + got.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(["--certfile", "/nonexistent/tls.crt"], "--certfile /nonexistent/tls.crt: no such file or directory", id="missing certificate"),
        pytest.param(["--backend-kubeconfig", "/nonexistent/kubeconfig"], "/nonexistent/kubeconfig", id="missing backend kubeconfig"),
        pytest.param(["--patch-mode", "merge"], "invalid choice: 'merge'", id="bad option value"),
    ],
)  # fmt: skip
def test_startup_failure_is_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    """Every start-up failure is one line on stderr and a non-zero exit code, never a traceback."""
    write_config(tmp_path, validating=VALID)
    got = run_cli("--config", str(tmp_path), "--bind", "127.0.0.1:0", "--log-level", "error", *args)
    assert got.returncode != 0
    assert expected in _one_line(got.stderr)


# --- check ---------------------------------------------------------------------------------------


def test_check_takes_files_directories_and_stdin(tmp_path: Path) -> None:
    """`check` reads a single file of any name, a directory and `-` (stdin) together."""
    one = write_config(tmp_path / "a", validating=VALID, filename="first.yaml")
    write_config(tmp_path / "b", mutating={"m": [hook("m.example.com", "https://x.example.com/m")]})
    piped = write_config(tmp_path / "c", validating={"p": [hook("p.example.com", "https://x.example.com/p")]})
    got = run_cli("check", str(one), str(tmp_path / "b"), "-", stdin=piped.read_text())
    assert got.returncode == 0, got.stderr
    assert "OK: 2 validating and 1 mutating webhooks" in got.stdout
    bad = run_cli("check", "-", stdin="apiVersion: v1\nkind: ConfigMap\n")
    assert bad.returncode == 1
    assert "<stdin>" in bad.stderr


def test_ignore_warning_accepts_a_reviewed_warning(tmp_path: Path) -> None:
    """Warnings show a code; --ignore-warning CODE accepts it while --warnings-as-errors still gates others."""
    write_config(
        tmp_path, validating={"ok": [hook("a.example.com", "https://x.example.com/v", timeoutSecond=5)]}
    )
    strict = run_cli("check", str(tmp_path), "--warnings-as-errors")
    assert strict.returncode == 1
    assert "timeoutSecond: unknown field; did you mean timeoutSeconds? [unknown-field]" in strict.stderr
    accepted = run_cli("check", str(tmp_path), "--warnings-as-errors", "--ignore-warning", "unknown-field")
    assert accepted.returncode == 0, accepted.stderr
    assert "0 warning(s) (1 ignored)" in accepted.stdout


# --- issue 10 B8: no configuration turns every policy off ------------------------------------------------


def test_start_with_no_webhooks_is_refused(tmp_path: Path) -> None:
    """B8: starting on a directory without webhooks is refused (exit 2) unless --allow-empty-config."""
    write_config(tmp_path)
    got = run_cli("--config", str(tmp_path), "--bind", "127.0.0.1:0", "--log-format", "console")
    assert got.returncode == 2
    assert "no webhook configurations" in got.stdout + got.stderr
    assert "--allow-empty-config" in got.stdout + got.stderr
    assert "configuration refused at start-up; not serving" in got.stdout  # there is no "last good" one yet
    assert "last good" not in got.stdout + got.stderr


async def test_start_with_no_webhooks_is_allowed_when_asked(nursery: trio.Nursery, tmp_path: Path) -> None:
    """B8: --allow-empty-config starts on an empty directory (every review allowed, as configured)."""
    write_config(tmp_path)
    options = parse(
        ["--config", str(tmp_path), "--bind", "127.0.0.1:0", "--drain-seconds", "0", "--allow-empty-config"]
    ).options
    running: Running = await nursery.start(
        lambda task_status: serve(options, handle_signals=False, task_status=task_status)
    )
    client = await gateway_client(running)
    got = await client.post("/validate?timeout=5s", json.dumps(review()).encode())
    assert got is not None and got.json["response"]["allowed"] is True


async def test_emptied_directory_is_refused_on_reload(nursery: trio.Nursery, tmp_path: Path) -> None:
    """B8: removing every file is a refused reload: the last good configuration keeps denying, one error
    line is logged and the reload-failure metric counts it."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    config = write_config(
        tmp_path / "c", validating={"a": [hook("deny.example.com", f"http://127.0.0.1:{server.port}/deny")]}
    )
    options = parse(["--config", str(config.parent), "--bind", "127.0.0.1:0", "--drain-seconds", "0",
                     "--config-poll-seconds", "0.05"]).options  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        observer = Observability(metrics=True)
        running: Running = await nursery.start(
            lambda task_status: serve(
                options, observer=observer, handle_signals=False, task_status=task_status
            )
        )
        config.unlink()
        with trio.fail_after(5):
            while not any(e["event"].startswith("configuration refused") for e in logs):
                await trio.sleep(0.05)
        await trio.sleep(0.3)  # more polls: the refusal is logged once, not on every poll
    refused = [e for e in logs if e["log_level"] == "error"]
    assert len(refused) == 1
    assert "no webhook configurations" in str(refused[0]["problems"])
    client = await gateway_client(running)
    got = await client.post("/validate?timeout=5s", json.dumps(review()).encode())
    assert got is not None and got.json["response"]["allowed"] is False  # the last good one still serves
    metrics = observer.metrics()
    assert metrics is not None
    assert b'webhook_gateway_config_reloads_total{result="failure"} 1.0' in metrics[0]


# --- logs ------------------------------------------------------------------------------------------------


def test_hypercorn_start_up_line_goes_through_the_gateway_logger() -> None:
    """hypercorn's "Running on ... (CTRL + C to quit)" becomes the gateway's own `listening` line."""
    import logging

    saved = structlog.get_config()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
        configure_logging("info", "json", stream=out)
        logging.getLogger("hypercorn.error").info(
            "Running on %s (CTRL + C to quit)", "https://127.0.0.1:8443"
        )
        out.flush()
        (line,) = [json.loads(x) for x in out.buffer.getvalue().decode().splitlines()]  # type: ignore[attr-defined]
    finally:
        structlog.configure(**saved)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    assert (line["event"], line["url"]) == ("listening", "https://127.0.0.1:8443")
    assert "logger" not in line


def test_console_lines_show_no_python_reprs() -> None:
    """Console lines render lists as JSON (`["a"]`), never as a Python repr (`['a']`)."""
    import logging

    saved = structlog.get_config()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
        configure_logging("info", "console", stream=out)
        structlog.get_logger("t").info("serving", urls=["http://127.0.0.1:1"], problems=("a b",))
        out.flush()
        text = out.buffer.getvalue().decode()  # type: ignore[attr-defined]
    finally:
        structlog.configure(**saved)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    assert 'urls=["http://127.0.0.1:1"]' in text
    assert "['" not in text


THIRD_PARTY = REPO / "tests" / "configs" / "thirdparty"


@pytest.mark.parametrize(
    "project", ["istio", "linkerd", "cert-manager", "kyverno", "kubewarden", "gatekeeper"],
    ids=lambda p: f"MAT-10/GW-05: {p}'s published webhook configuration passes check --warnings-as-errors",
)  # fmt: skip
def test_third_party_configurations_pass_the_strict_gate(project: str) -> None:
    """No false alarm on real-world configurations: Equivalent on resources without equivalents, and
    mutually exclusive webhooks (istio's four sidecar injectors), do not warn. (Copied without their CA,
    their service backends rightly earn `ca-missing`: tests/test_config_trust.py.)"""
    got = run_cli(
        "check",
        "--warnings-as-errors",
        "--ignore-warning",
        "ca-missing",
        str(THIRD_PARTY / f"{project}.yaml"),
    )
    assert got.returncode == 0, got.stderr
    assert "0 warning(s)" in got.stdout


def test_third_party_configurations_together_earn_a_true_warning() -> None:
    """GW-05, true: installed together, a Pod CREATE meets cert-manager's, gatekeeper's and kyverno's mutating
    webhooks — 51 s of timeouts for the gateway's 30 s — and the warning names them."""
    got = run_cli("check", "--warnings-as-errors", str(THIRD_PARTY))
    assert got.returncode == 1
    assert "add up to 51s" in got.stderr
    assert "mutate.kyverno.svc-fail" in got.stderr and "[timeouts-add-up]" in got.stderr


@pytest.mark.parametrize(
    ("versions", "warns"),
    [
        pytest.param(["v1", "v2"], True, id="MAT-10: check warns when Equivalent names one version of a multi-version CRD"),
        pytest.param(["v1"], False, id="MAT-10: check does not warn for a single-version CRD"),
    ],
)  # fmt: skip
def test_check_knows_the_configurations_multi_version_crds(
    tmp_path: Path, versions: list[str], warns: bool
) -> None:
    """The Equivalent warning counts the CRDs of the directory among resources served under several versions."""
    import yaml

    write_config(
        tmp_path,
        validating={"widgets": [hook("w.example.com", "https://w.example.com/v", matchPolicy="Equivalent",
                                     rules=[{"operations": ["CREATE"], "apiGroups": ["example.com"],
                                             "apiVersions": ["v1"], "resources": ["widgets"]}])]},
    )  # fmt: skip
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "names": {"plural": "widgets", "kind": "Widget"},
            "scope": "Namespaced",
            "versions": [{"name": v, "served": True, "storage": v == "v1"} for v in versions],
        },
    }
    (tmp_path / "zz-crd.yaml").write_text(yaml.safe_dump(crd))
    got = run_cli("check", "--warnings-as-errors", str(tmp_path))
    assert (got.returncode == 1) is warns, got.stdout + got.stderr
    assert ("requests for widgets in example.com/v2 will not reach this webhook" in got.stderr) is warns


# --- metrics listener -------------------------------------------------------------------------------------


async def test_metrics_only_on_the_metrics_listener(nursery: trio.Nursery, tmp_path: Path) -> None:
    """With --metrics-bind, /metrics is served there (with process_* and build info) and 404 on the
    review port; without it, the review port serves /metrics."""
    from tests.support.client import connect
    from tests.support.gateway import port_of

    write_config(tmp_path, validating=VALID)
    base = ["--config", str(tmp_path), "--bind", "127.0.0.1:0", "--drain-seconds", "0"]
    split: Running = await nursery.start(
        lambda task_status: serve(parse([*base, "--metrics-bind", "127.0.0.1:0"]).options, observer=Observability(),
                                  handle_signals=False, task_status=task_status)
    )  # fmt: skip
    together: Running = await nursery.start(
        lambda task_status: serve(parse(base).options, observer=Observability(), handle_signals=False,
                                  task_status=task_status)
    )  # fmt: skip
    main = await gateway_client(split)
    got = await main.post("/metrics", b"", method="GET")
    assert got is not None and got.status == 404
    metrics = await connect("127.0.0.1", port_of(split.metrics_urls[0]))
    got = await metrics.post("/metrics", b"", method="GET")
    assert got is not None and got.status == 200
    assert b"process_resident_memory_bytes" in got.body
    assert (
        f'webhook_gateway_build_info{{python="{sys.version.split()[0]}",version="{__version__}"}} 1.0'.encode()
        in got.body
    )
    one = await gateway_client(together)
    got = await one.post("/metrics", b"", method="GET")
    assert got is not None and got.status == 200 and b"webhook_gateway_build_info" in got.body


# --- logs: an unknown namespace ----------------------------------------------------------------------------


async def test_unknown_namespace_denial_names_no_backend(nursery: trio.Nursery, tmp_path: Path) -> None:
    """MAT-16 (file mode): a review in a namespace without a Namespace object is answered 404; the review log
    line says the namespace is unknown and names no backend, because none was called."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    selective = hook("prod.example.com", f"http://127.0.0.1:{server.port}/allow",
                     namespaceSelector={"matchLabels": {"env": "prod"}})  # fmt: skip
    write_config(tmp_path, validating={"a": [selective]}, namespaces={"shop": {"env": "prod"}})
    options = parse(["--config", str(tmp_path), "--bind", "127.0.0.1:0", "--drain-seconds", "0"]).options
    with structlog.testing.capture_logs() as logs:
        running: Running = await nursery.start(
            lambda task_status: serve(
                options, observer=Observability(), handle_signals=False, task_status=task_status
            )
        )
        client = await gateway_client(running)
        got = await client.post("/validate?timeout=5s", json.dumps(review(namespace="ghost")).encode())
        with trio.fail_after(5):  # the review line is written just after the answer is sent
            while not any(e["event"] == "review" for e in logs):
                await trio.sleep(0.01)
    assert got is not None
    assert (
        got.json["response"]["status"]["message"] == 'namespaces "ghost" not found'
    )  # as the apiserver says
    (line,) = [e for e in logs if e["event"] == "review"]
    assert "denied_by" not in line
    assert "unknown" in line["reason"] and "no backend was called" in line["reason"]
    assert not server.calls


# --- issue 33 §10: what check and the command line say --------------------------------------------


def test_warnings_as_errors_never_says_ok(tmp_path: Path) -> None:
    """Under --warnings-as-errors a warning fails the check, and the summary says FAILED, never OK."""
    write_config(
        tmp_path, validating={"ok": [hook("a.example.com", "https://x.example.com/v", timeoutSecond=5)]}
    )
    got = run_cli("check", str(tmp_path), "--warnings-as-errors")
    assert got.returncode == 1
    assert "OK" not in got.stdout + got.stderr
    assert "FAILED (--warnings-as-errors): 1 validating and 0 mutating webhooks" in got.stderr
    assert run_cli("check", str(tmp_path)).stdout.count(": OK: ") == 1  # without the flag: OK, 1 warning


def test_a_misspelt_selector_fails_check(tmp_path: Path) -> None:
    """`namespaceSelectr` would silently widen the webhook to every namespace: check exits 1 naming the field."""
    write_config(
        tmp_path,
        validating={
            "ok": [
                hook("a.example.com", "https://x.example.com/v", namespaceSelectr={"matchLabels": {"a": "b"}})
            ]
        },
    )
    got = run_cli("check", str(tmp_path))
    assert got.returncode == 1
    assert "webhooks[0].namespaceSelectr: unknown field; did you mean namespaceSelector?" in got.stderr
    assert "1 error(s); configuration refused" in got.stderr


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["bogus"], id="an unknown command"),
        pytest.param(["bogus", "--help"], id="with more arguments"),
    ],
)
def test_an_unknown_command_names_the_commands(args: list[str]) -> None:
    got = run_cli(*args)
    assert got.returncode == 2
    line = _one_line(got.stderr)
    assert "unknown command 'bogus'" in line and all(c in line for c in COMMANDS)


# --- issue 33 §6: every broken TLS input names the file, the flag and the fix -----------------------


def _tls_files(tmp_path: Path) -> dict[str, Path]:
    import trustme
    from cryptography.hazmat.primitives import serialization

    ca = trustme.CA()
    leaf = ca.issue_cert("webhook-gateway.webhook-gateway.svc")
    other = ca.issue_cert("other.example.com")
    files = {
        "crt": leaf.cert_chain_pems[0].bytes(),
        "key": leaf.private_key_pem.bytes(),
        "other.key": other.private_key_pem.bytes(),
        "both.pem": leaf.cert_chain_pems[0].bytes() + leaf.private_key_pem.bytes(),
        "ca.crt": ca.cert_pem.bytes(),
        "garbage": b"not a certificate\n",
    }
    key = serialization.load_pem_private_key(files["key"], password=None)
    files["encrypted.key"] = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / name
        paths[name].write_bytes(data)
    (tmp_path / "adir").mkdir()
    paths["adir"] = tmp_path / "adir"
    return paths


BROKEN_TLS = [
    pytest.param(["--certfile", "crt"], "--certfile {crt} holds no private key: pass the key file with --keyfile",
                 id="forgot --keyfile (was: [SSL] PEM lib)"),
    pytest.param(["--certfile", "crt", "--keyfile", "other.key"],
                 "--keyfile {other.key} does not match --certfile {crt}: pass the private key of this certificate",
                 id="the key of another certificate (was: KEY_VALUES_MISMATCH)"),
    pytest.param(["--certfile", "/nonexistent/tls.crt", "--keyfile", "key"],
                 "--certfile /nonexistent/tls.crt: no such file or directory; pass the serving certificate's PEM file",
                 id="a missing certificate file names its flag (was: No such file or directory)"),
    pytest.param(["--certfile", "crt", "--keyfile", "/nonexistent/tls.key"],
                 "--keyfile /nonexistent/tls.key: no such file or directory; pass the serving private key's PEM file",
                 id="a missing key file names its flag"),
    pytest.param(["--certfile", "garbage", "--keyfile", "key"],
                 "--certfile {garbage}: no PEM certificate in the file", id="a certificate file that is not PEM"),
    pytest.param(["--certfile", "crt", "--keyfile", "garbage"],
                 "--keyfile {garbage}: no PEM private key in the file", id="a key file that is not PEM"),
    pytest.param(["--certfile", "crt", "--keyfile", "crt"],
                 "--keyfile {crt}: no PEM private key in the file", id="the certificate given as the key"),
    pytest.param(["--certfile", "crt", "--keyfile", "encrypted.key"],
                 "--keyfile {encrypted.key}: the private key is encrypted; pass it unencrypted",
                 id="an encrypted key fails at once instead of prompting for a password"),
    pytest.param(["--keyfile", "key"], "--keyfile {key} given without --certfile", id="--keyfile alone"),
    pytest.param(["--certfile", "adir", "--keyfile", "key"], "--certfile {adir}: is a directory",
                 id="a directory instead of a file"),
    pytest.param(["--certfile", "crt", "--keyfile", "key", "--client-ca", "/nonexistent/ca.crt"],
                 "--client-ca /nonexistent/ca.crt: no such file or directory", id="a missing client CA"),
    pytest.param(["--certfile", "crt", "--keyfile", "key", "--client-ca", "garbage"],
                 "--client-ca {garbage}: no PEM certificate in the file", id="a client CA that is not PEM"),
    pytest.param(["--client-ca", "ca.crt"], "--client-ca {ca.crt} needs TLS: pass --certfile and --keyfile",
                 id="--client-ca without TLS"),
]  # fmt: skip

OTHER_STARTUP_FAILURES = [
    pytest.param(["--backend-kubeconfig", "/nonexistent/kc"],
                 "--backend-kubeconfig /nonexistent/kc: no such file or directory; pass the", id="backend credentials"),
    pytest.param(["--namespace-source", "cluster", "--kubeconfig", "/nonexistent/kc"],
                 "--kubeconfig /nonexistent/kc: no such file or directory; pass the", id="a missing kubeconfig"),
    pytest.param(["--namespace-source", "cluster"],
                 "--namespace-source cluster: not running in a cluster (no KUBERNETES_SERVICE_HOST): pass --kubeconfig",
                 id="cluster mode outside a cluster"),
    pytest.param(["--metrics-bind", "nonsense"], "--metrics-bind nonsense: expected HOST:PORT",
                 id="an address without a port (was: a traceback)"),
    pytest.param(["--config", "/nonexistent/config"],
                 "/nonexistent/config: no such file or directory (expected a directory or file of webhook configurations)",
                 id="a missing configuration"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "expected"), OTHER_STARTUP_FAILURES)
def test_other_startup_failures_name_the_flag(tmp_path: Path, args: list[str], expected: str) -> None:
    write_config(tmp_path / "cfg", validating=VALID)
    env = {"KUBERNETES_SERVICE_HOST": ""} if "cluster" in args else None
    got = run_cli(
        "--config", str(tmp_path / "cfg"), "--bind", "127.0.0.1:0", "--workers", "1", *args, env=env
    )
    assert got.returncode in (1, 2) and "Traceback" not in got.stdout + got.stderr
    assert expected in got.stdout + got.stderr


@pytest.mark.parametrize(("args", "expected"), BROKEN_TLS)
@pytest.mark.parametrize("workers", ["1", "2"], ids=["one process", "worker processes"])
def test_broken_tls_inputs_name_the_file_the_flag_and_the_fix(
    tmp_path: Path, args: list[str], expected: str, workers: str
) -> None:
    """Each broken TLS input ends start-up with one line naming the flag, the file and what to pass, exit 1."""
    files = _tls_files(tmp_path)
    write_config(tmp_path / "cfg", validating=VALID)
    given = [str(files[a]) if a in files else a for a in args]
    got = run_cli("--config", str(tmp_path / "cfg"), "--bind", "127.0.0.1:0", "--workers", workers, *given)
    assert got.returncode == 1, got.stdout + got.stderr
    line = _one_line(got.stderr)
    assert line.startswith("webhook-gateway: error: ")
    for name, path in files.items():
        expected = expected.replace("{" + name + "}", str(path))
    assert expected in line
    assert "Traceback" not in got.stdout + got.stderr


def test_a_good_tls_pair_in_one_file_starts(tmp_path: Path) -> None:
    """The checks refuse nothing that serves: a PEM holding certificate and key, without --keyfile."""
    from gateway.commands.serve import tls_problem

    files = _tls_files(tmp_path)
    assert tls_problem(ServeSettings(config="x", certfile=str(files["both.pem"]))) is None
    assert tls_problem(ServeSettings(config="x", certfile=str(files["crt"]), keyfile=str(files["key"]),
                                     client_ca=str(files["ca.crt"]))) is None  # fmt: skip


# --- issue 33 §8: --config takes a directory or a file everywhere ------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(["check"], id="check"),
        pytest.param(["registration"], id="registration (was: cannot read directory: Not a directory)"),
        pytest.param(["explain", "{review}"], id="explain"),
        pytest.param(["audit", "{objects}"], id="audit"),
    ],
)
@pytest.mark.parametrize("given", ["directory", "file"])
def test_config_is_a_directory_or_a_file_everywhere(tmp_path: Path, command: list[str], given: str) -> None:
    path = write_config(tmp_path / "cfg", validating=VALID, namespaces={"shop": {}})
    (tmp_path / "review.json").write_text(json.dumps(review()))
    (tmp_path / "objects.yaml").write_text(json.dumps(review()["request"]["object"]))
    args = [a.format(review=tmp_path / "review.json", objects=tmp_path / "objects.yaml") for a in command]
    config = str(path if given == "file" else path.parent)
    got = (
        run_cli(*args, "--config", config, "--fail-on", "none")
        if args[0] in ("explain", "audit")
        else (run_cli(*args, "--config", config))
    )
    assert got.returncode == 0, got.stderr
    assert "Not a directory" not in got.stderr


async def test_serve_takes_a_configuration_file_and_reloads_it(nursery: trio.Nursery, tmp_path: Path) -> None:
    """serve --config FILE starts, and a change of that file is reloaded like a directory's."""
    path = write_config(tmp_path, validating=VALID)
    observer = Observability(metrics=True)
    options = parse(["--config", str(path), "--bind", "127.0.0.1:0", "--drain-seconds", "0",
                     "--config-poll-seconds", "0.05"]).options  # fmt: skip
    running: Running = await nursery.start(
        lambda task_status: serve(options, observer=observer, handle_signals=False, task_status=task_status)
    )
    first = running.app.snapshot()
    assert first is not None and len(first.validating) == 1
    write_config(
        tmp_path, validating={"ok": [*VALID["ok"], hook("b.example.com", "https://y.example.com/v")]}
    )
    with trio.fail_after(10):
        while (current := running.app.snapshot()) is None or len(current.validating) != 2:
            await trio.sleep(0.05)
