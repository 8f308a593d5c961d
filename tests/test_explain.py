"""`webhook-gateway explain`: per backend, matched or not and why, order, effective timeout, dry run;
`--call` sends the review as a dry run to real backends (issue 16 §3)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

from gateway.devtools.backends import serve_backend
from tests.support.gateway import hook, pod, review, write_config

REPO = Path(__file__).resolve().parent.parent
RULES_PODS = [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}]


async def explain(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    got = await trio.run_process(
        [sys.executable, "-m", "gateway", "explain", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=REPO,
        stdin=stdin.encode() if stdin is not None else b"",
        env=dict(os.environ),
    )
    return got.returncode, got.stdout.decode(), got.stderr.decode()


def _config(directory: Path, base: str = "http://127.0.0.1:9") -> Path:
    write_config(
        directory,
        mutating={
            "chain": [
                hook("first.example.com", f"{base}/patch/first", rules=RULES_PODS, timeoutSeconds=3),
                hook("second.example.com", f"{base}/allow", rules=RULES_PODS, timeoutSeconds=3),
            ]
        },
        validating={
            "policy": [
                hook("deny.example.com", f"{base}/deny/403/no%20miners", rules=RULES_PODS,
                     objectSelector={"matchLabels": {"app": "web"}}),
                hook("prod-only.example.com", f"{base}/allow", rules=RULES_PODS,
                     namespaceSelector={"matchLabels": {"env": "prod"}}),
                hook("deployments.example.com", f"{base}/allow",
                     rules=[{**RULES_PODS[0], "apiGroups": ["apps"], "resources": ["deployments"]}]),
                hook("conditions.example.com", f"{base}/allow", rules=RULES_PODS,
                     matchConditions=[{"name": "not-alice", "expression": "request.userInfo.username != 'alice'"}]),
            ]
        },
        namespaces={"shop": {"env": "dev"}},
    )  # fmt: skip
    write_config(  # v1beta1 still accepts sideEffects Some, which a dry run must never reach
        directory,
        validating={
            "zz-legacy": [
                hook("side-effects.example.com", f"{base}/allow", rules=RULES_PODS, sideEffects="Some")
            ]
        },
        api_version="admissionregistration.k8s.io/v1beta1",
        filename="legacy.yaml",
    )
    return directory


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in report["backends"]}


async def test_explain_names_what_decided_each_backend(tmp_path: Path) -> None:
    """MAT-03/21/22/25: every backend is matched or not, with the rule, selector or condition that decided."""
    config = _config(tmp_path / "c")
    obj = tmp_path / "pod.yaml"
    obj.write_text(yaml.safe_dump(pod()))
    code, out, err = await explain("--config", str(config), str(obj), "--user", "alice", "-o", "json")
    assert code == 0, err
    rows = _rows(json.loads(out))
    assert {n: (r["decision"], r["why"]) for n, r in rows.items()} == {
        "first.example.com": ("call", "rules[0] matches CREATE v1/pods"),
        "second.example.com": ("call", "rules[0] matches CREATE v1/pods"),
        "deny.example.com": ("call", "rules[0] matches CREATE v1/pods; objectSelector matches"),
        "prod-only.example.com": ("skip", "namespaceSelector: env In (prod) is false"),
        "deployments.example.com": ("skip", "no rule matches CREATE v1/pods"),
        "conditions.example.com": ("skip", "matchCondition 'not-alice' is false"),
        "side-effects.example.com": ("call", "rules[0] matches CREATE v1/pods"),
    }
    assert json.loads(out)["namespaceLabels"]["source"].startswith("Namespace 'shop'")


async def test_explain_orders_calls_and_shares_the_budget(tmp_path: Path) -> None:
    """GW-05/ORD-01: mutating calls run in order and share the caller's budget; validating ones run in
    parallel, each with the whole budget; dry-run refusals are shown (FPT-09)."""
    config = _config(tmp_path / "c")
    code, out, err = await explain(
        "--config", str(config), "-", "--timeout", "5.2", "--namespace-labels", "env=prod", "--dry-run", "-o", "json",
        stdin=json.dumps(review(pod())),
    )  # fmt: skip
    assert code == 1, err  # the dry run is refused (FPT-09): a denial
    report = json.loads(out)
    rows = _rows(report)
    assert set(report["budgetSeconds"].values()) == {5.0}
    assert (
        report["verdict"]["outcome"] == "denied"
        and "side-effects.example.com" in report["verdict"]["message"]
    )
    assert [(rows[n]["order"], rows[n]["effectiveTimeoutSeconds"]) for n in ("first.example.com", "second.example.com")] == [
        ("1", 3.0), ("2", 2.0)
    ]  # fmt: skip
    assert rows["prod-only.example.com"]["order"] == "parallel"
    assert rows["prod-only.example.com"]["effectiveTimeoutSeconds"] == 5.0  # min(10, 5)
    assert rows["side-effects.example.com"]["decision"] == "refuse"
    assert "sideEffects Some refuses dry run" in rows["side-effects.example.com"]["why"]


async def test_explain_table_is_readable(tmp_path: Path) -> None:
    """The default output is a table with one line per backend."""
    config = _config(tmp_path / "c")
    code, out, err = await explain("--config", str(config), "-", stdin=json.dumps(review(pod())))
    assert code == 0, err
    assert "KIND" in out and "WHY" in out
    assert any(
        line.startswith("validating") and "prod-only.example.com" in line and "skip" in line
        for line in out.splitlines()
    )


async def test_explain_call_sends_a_dry_run_to_real_backends(nursery: trio.Nursery, tmp_path: Path) -> None:
    """--call: dryRun is forced true, backends whose sideEffects refuse dry run are never called, each
    answer and the combined reply (patch, then the denial) are shown."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    config = _config(tmp_path / "c", base=f"http://127.0.0.1:{server.port}")
    code, out, err = await explain(
        "--config",
        str(config),
        "-",
        "--call",
        "-o",
        "json",
        stdin=json.dumps(review(pod(labels={"app": "web"}))),
    )
    assert code == 1, err  # denied
    called = await explain(
        "--config", str(config), "-", "--call", stdin=json.dumps(review(pod(labels={"app": "web"})))
    )
    report = json.loads(out)["call"]["paths"]
    assert report["/mutate"]["allowed"] is True
    assert report["/mutate"]["patch"][0]["path"] == "/metadata/labels/first"
    validating = report["/validate/fail"]
    assert validating["allowed"] is False
    assert (
        'admission webhook "deny.example.com" denied the request: no miners'
        in validating["status"]["message"]
    )
    answers = {a["name"]: a["outcome"] for a in validating["answers"]}
    assert answers["deny.example.com"] == "rejected"
    assert all(c.review["request"]["dryRun"] is True for c in server.calls)
    assert not any("side-effects" in c.path for c in server.calls)
    assert {c.path.split("?")[0] for c in server.calls} == {"/patch/first", "/allow", "/deny/403/no%20miners"}
    assert "combined reply: DENIED 403" in called[1]


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        pytest.param(["-"], "[1, 2", "not JSON or YAML", id="unreadable input is one line"),
        pytest.param(["-"], json.dumps({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}), "AdmissionReview has no request", id="REV-01: a malformed review is named"),
        pytest.param(["/nonexistent.yaml"], None, "No such file", id="a missing file is one line"),
    ],
)  # fmt: skip
async def test_explain_bad_input_is_one_line(
    tmp_path: Path, args: list[str], stdin: str | None, message: str
) -> None:
    config = _config(tmp_path / "c")
    code, _out, err = await explain("--config", str(config), *args, stdin=stdin)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
