"""The documentation lives in the repository (issue 16 §1): every statement ID a user can see resolves to
an anchor in docs/behaviour.md, nothing user-facing points outside the repository, every option is in
the configuration reference, and the README installs what CI installs."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from gateway.cli import COMMANDS, _command

REPO = Path(__file__).resolve().parent.parent
ID = re.compile(r"\b(?:CFG|ORD|MAT|REV|MUT|VAL|FPT|ERR|AUD|TRN|MET|CNV|GW)-\d{2}\b")
USER_FACING = ["gateway", "deploy", "docs", "loadtests", "README.md", "Dockerfile"]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".txt", ""}


def _files() -> list[Path]:
    found = []
    for name in USER_FACING:
        path = REPO / name
        candidates = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        found += [p for p in candidates if p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return found


def test_every_statement_id_shown_resolves_to_an_anchor() -> None:
    """CLI messages, metric help, manifest comments and docs cite IDs; each has an anchor in behaviour.md."""
    behaviour = (REPO / "docs" / "behaviour.md").read_text()
    anchors = set(re.findall(r'<a id="([a-z]+-\d{2})"></a>', behaviour))
    missing = {}
    for path in _files():
        for found in ID.findall(path.read_text(errors="replace")):
            if found.lower() not in anchors:
                missing.setdefault(found, str(path.relative_to(REPO)))
    assert not missing, f"IDs without an anchor in docs/behaviour.md: {missing}"


def test_behaviour_links_resolve() -> None:
    """Links to behaviour.md#anchor from the docs and README land on an anchor that exists."""
    behaviour = (REPO / "docs" / "behaviour.md").read_text()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', behaviour))
    anchors |= {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.*)$", behaviour, re.M)
    }
    broken = []
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\((?:behaviour\.md|docs/behaviour\.md)?#([a-z0-9-]+)\)", path.read_text()):
            if path.name != "behaviour.md" and "behaviour.md#" + target not in path.read_text():
                continue  # an anchor of the document itself
            if target not in anchors:
                broken.append(f"{path.name}: #{target}")
    assert not broken


@pytest.mark.parametrize(
    "needle", ["shared/spec", "admission-semantics", "../shared", "spec §", "spec's §", "Seed 0"]
)
def test_nothing_user_facing_points_outside_the_repository(needle: str) -> None:
    offenders = [str(p.relative_to(REPO)) for p in _files() if needle in p.read_text(errors="replace")]
    assert not offenders


def options_table(command: str) -> str:
    """The options table of ``command`` as docs/configuration.md shows it, rendered from its parser
    (print them all with ``python -c "from tests.test_docs import print_tables; print_tables()"``)."""
    prog = "webhook-gateway" if command == "serve" else f"webhook-gateway {command}"
    parser = _command(command).build_parser(prog)
    rows = ["| option | default | environment variable | meaning |", "| --- | --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        text = " ".join((action.help or "").split())
        env = re.search(r" \[env: ([A-Z0-9_]+)\]$", text)
        text = text[: env.start()] if env else text
        shown = re.search(r" \(default: (.*)\)$", text)
        text = text[: shown.start()] if shown else text
        if action.option_strings:
            name = ", ".join(f"`{f}`" for f in action.option_strings)
        else:
            name = f"`{action.metavar}` (positional)"
        if shown:
            default = shown.group(1)
        elif isinstance(action, argparse._StoreTrueAction):
            default = "off"
        elif action.default not in (None, [], (), "") and action.option_strings:
            default = str(action.default)
        else:
            default = "—"
        meaning = text.replace("|", "\\|")
        if action.choices:
            meaning += " (" + " \\| ".join(f"`{c}`" for c in action.choices) + ")"
        variable = f"`{env.group(1)}`" if env else "—"
        rows.append(f"| {name} | {default} | {variable} | {meaning} |")
    return "\n".join(rows)


def print_tables() -> None:
    for command in COMMANDS:
        print(f"### `{command}`\n\n{options_table(command)}\n")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_in_the_configuration_reference(command: str) -> None:
    """docs/configuration.md shows each command's options exactly as its parser has them: flags,
    defaults, variables (one meaning each) and choices."""
    reference = (REPO / "docs" / "configuration.md").read_text()
    assert options_table(command) in reference, (
        f"`{command}`'s options table differs from its parser:\n" + options_table(command)
    )


def test_readme_installs_what_ci_installs() -> None:
    """The README's test command installs the same extras as .ci/run (else --plot fails after a whole run)."""
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    (ci_extras,) = re.findall(r"pip install [^\n]*\.\[([a-z,]+)\]", ci)
    readme_extras = re.findall(r"pip install -e '\.\[([a-z,]+)\]' && python -m pytest", readme)
    assert readme_extras == [ci_extras]
    assert ci.rstrip().endswith("python -m pytest")


def _anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file: explicit ``<a id>`` and GitHub's slugs of its headings."""
    text = path.read_text()
    found = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        title = re.sub(r'<a id="[^"]*"></a>', "", heading)
        found.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return found


def _relative_links() -> list[tuple[Path, str]]:
    links = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked here
                links.append((doc, target))
    return links


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    """README.md and docs/*.md link only to files that exist, and to anchors those files have."""
    links = _relative_links()
    assert len(links) > 50
    broken = []
    for doc, target in links:
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{doc.relative_to(REPO)}: {target} (no such anchor)")
    assert broken == []


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one process", "worker processes"])
def test_metrics_reference_covers_every_family_a_gateway_serves(tmp_path: Path, workers: str) -> None:
    """Scrape a running gateway (one process, and with the --workers supervisor): every family it
    serves is in docs/metrics.md with the same type and help text (process_* are named in the header)."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.gateway import hook, write_config

    write_config(tmp_path, validating={"v": [hook("a.example.com", "https://backend.example.com/v")]})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--config", str(tmp_path), "--bind", "127.0.0.1:0",
         "--metrics-bind", f"127.0.0.1:{port}", "--workers", workers, "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        text = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "webhook_gateway_build_info" not in text:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as got:
                    text = got.read().decode()
            except OSError:
                time.sleep(0.2)
        assert "webhook_gateway_build_info" in text, process.stderr
    finally:
        process.terminate()
        process.wait(timeout=30)
    reference = (REPO / "docs" / "metrics.md").read_text()
    documented = {}
    for row in re.findall(r"^\| `(\w+)` \| (\w+) \| .*? \| (.*) \|$", reference, re.M):
        documented[row[0]] = (row[1], row[2])
    served = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("process_", "python_")):
            continue
        name = family.name + (
            "_total" if family.type == "counter" and family.name + "_total" in documented else ""
        )
        if family.type == "info":
            name = family.name + "_info"
        served[name] = family.type if family.type != "info" else "gauge"
    missing = sorted(set(served) - set(documented))
    assert missing == [], f"families served but not in docs/metrics.md: {missing}"
    assert {n: t for n, t in served.items() if documented[n][0] != t} == {}
    if workers == "2":
        assert {"webhook_gateway_workers", "webhook_gateway_worker_restarts_total"} <= set(served)
