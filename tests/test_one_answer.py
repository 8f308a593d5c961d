"""One answer everywhere (issue 33 §1): `check`, start-up, reload, `explain`, `explain --call`, `audit` and
`serve` reach the same verdict on the same configuration and review, because they call the same code.

Each row is a configuration and a review, the paths (and ``?timeout=``) the apiserver posts the review to
as this test knows them from the registration, and the one verdict every command must reach. `serve` is
driven over real sockets the way the apiserver drives it; the commands run as processes, as operators
and CI run them. `explain` without `--call` assumes every called backend allows, so it takes part only
where the gateway decides without the backends (namespaces, registration, configuration).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

from gateway.cli import parse
from gateway.devtools.backends import serve_backend
from gateway.observability import Observability
from gateway.server.serve import Running, serve
from tests.support.gateway import gateway_client, hook, pod, review, write_config

REPO = Path(__file__).resolve().parent.parent
PODS = [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}]
EVERYTHING = [{"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*"]}]


def lease_review(namespace: str) -> dict[str, Any]:
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "node-1", "namespace": namespace},
        "spec": {"holderIdentity": "node-1", "leaseDurationSeconds": 40},
    }
    return review(
        lease,
        operation="UPDATE",
        old=lease,
        namespace=namespace,
        resource=("coordination.k8s.io", "v1", "leases"),
        kind=("coordination.k8s.io", "v1", "Lease"),
    )


@dataclass
class Case:
    validating: list[dict[str, Any]]
    review: dict[str, Any]
    routes: list[tuple[str, int]]  # (path, ?timeout= seconds) the apiserver posts to; [] = never sent
    verdict: tuple[str, str]  # ("allowed" | "denied" | "not sent" | "refused", part of the message)
    namespaces: dict[str, dict[str, str]] = field(default_factory=lambda: {"shop": {"env": "prod"}})
    flags: list[str] = field(default_factory=list)  # given to every command alike
    registration: list[dict[str, Any]] | None = None  # a registration file (else the computed one)
    backends_decide: bool = False  # explain without --call cannot know the answer


def _one_registration(timeout: int) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "webhook-gateway"},
            "webhooks": [
                {
                    "name": "validate.webhook-gateway.io-fail",
                    "clientConfig": {"url": "https://gateway.example.com/validate/fail"},
                    "rules": PODS,
                    "failurePolicy": "Fail",
                    "sideEffects": "NoneOnDryRun",
                    "timeoutSeconds": timeout,
                    "admissionReviewVersions": ["v1"],
                }
            ],
        }
    ]


def backend(name: str, path: str, **fields: Any) -> dict[str, Any]:
    return hook(name, "__backend__" + path, **fields)


CASES = [
    pytest.param(
        Case(
            [
                backend(
                    "prod.example.com",
                    "/allow",
                    rules=PODS,
                    namespaceSelector={"matchLabels": {"env": "prod"}},
                )
            ],
            review(pod(namespace="other"), namespace="other"),
            [("/validate/fail", 6)],
            ("denied", 'namespaces "other" not found'),
        ),
        id="MAT-16/GW-01: a namespace without a Namespace object is 404 everywhere (--unknown-namespace notFound)",
    ),
    pytest.param(
        Case(
            [
                backend(
                    "prod.example.com",
                    "/deny",
                    rules=PODS,
                    namespaceSelector={"matchLabels": {"env": "prod"}},
                )
            ],
            review(pod(namespace="other"), namespace="other"),
            [("/validate/fail", 6)],
            ("allowed", ""),
            flags=["--unknown-namespace", "emptyLabels"],
        ),
        id="GW-01: with --unknown-namespace emptyLabels it has no labels everywhere: the selector skips it",
    ),
    pytest.param(
        Case(
            [backend("everything.example.com", "/deny", rules=EVERYTHING, failurePolicy="Ignore")],
            lease_review("kube-node-lease"),
            [],
            ("not sent", "namespace kube-node-lease is excluded"),
            namespaces={},
        ),
        id="GW-08: a Lease UPDATE in kube-node-lease is never sent: the registration excludes the namespace",
    ),
    pytest.param(
        Case(
            [backend("everything.example.com", "/deny", rules=EVERYTHING, failurePolicy="Ignore")],
            lease_review("shop"),
            [],
            (
                "not sent",
                "matchCondition exclude-leases.coordination.k8s.io excludes UPDATE leases.coordination.k8s.io",
            ),
        ),
        id="GW-08: a Lease UPDATE elsewhere is never sent either: the registration excludes leases",
    ),
    pytest.param(
        Case([], review(pod()), [], ("refused", "no webhook configurations")),
        id="B8: an empty configuration is refused by check, start-up, reload, explain and audit alike",
    ),
    pytest.param(
        Case([], review(pod()), [], ("not sent", ""), flags=["--allow-empty-config"]),
        id="B8: with --allow-empty-config it is accepted everywhere, and nothing is registered",
    ),
    pytest.param(
        Case(
            [backend("slow.example.com", "/sleep/1500/allow", rules=PODS, timeoutSeconds=3)],
            review(pod()),
            [("/validate/fail", 1)],
            ("denied", "context deadline exceeded"),
            registration=_one_registration(1),
            backends_decide=True,
        ),
        id="FPT-05/07: the registration's timeoutSeconds is the budget everywhere: 1 s, a 1.5 s backend fails closed",
    ),
    pytest.param(
        Case(
            [backend("slow.example.com", "/sleep/1500/allow", rules=PODS, timeoutSeconds=3)],
            review(pod()),
            [("/validate/fail", 4)],
            ("allowed", ""),
            backends_decide=True,
        ),
        id="FPT-07/GW-05: the computed registration gives the backend's timeout plus the margin: allowed",
    ),
    pytest.param(
        Case(
            [
                backend("closed.example.com", "/deny/403/closed", rules=PODS),
                backend("open.example.com", "/status/500", rules=PODS, failurePolicy="Ignore"),
            ],
            review(pod()),
            [("/validate/fail", 6), ("/validate/ignore", 6)],
            ("denied", 'admission webhook "closed.example.com" denied the request: closed'),
            backends_decide=True,
        ),
        id="VAL/FPT-03: each half on its own path; a denial, and an Ignore backend's error",
    ),
]


async def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command as a process (in a thread: the backends in this test's event loop keep answering)."""
    return await trio.to_thread.run_sync(lambda: _run_now(*args, cwd=cwd))


def _run_now(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if not k.startswith("WEBHOOK_GATEWAY_")},
    )


def _fill(hooks: list[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    filled = json.loads(json.dumps(hooks))
    for h in filled:
        h["clientConfig"]["url"] = h["clientConfig"]["url"].replace("__backend__", base)
    return filled


def _write_case(case: Case, directory: Path, base: str) -> None:
    write_config(directory, validating={"policies": _fill(case.validating, base)} if case.validating else None,
                 namespaces=case.namespaces)  # fmt: skip


class _Reloads(Observability):
    """Records each configuration load: (ok, generation)."""

    def __init__(self) -> None:
        super().__init__(metrics=False, review_log=False)
        self.loads: list[bool] = []

    def config_reloaded(self, ok: bool, snapshot: Any, problems: Any = ()) -> None:
        self.loads.append(ok)
        super().config_reloaded(ok, snapshot, problems)


async def _serve_verdict(running: Running, case: Case) -> tuple[str, str]:
    client = await gateway_client(running)
    denial: tuple[str, str] | None = None
    for path, timeout in case.routes:
        got = await client.post(f"{path}?timeout={timeout}s", json.dumps(case.review).encode())
        assert got is not None and got.status == 200, got
        response = got.json["response"]
        if not response["allowed"] and denial is None:
            denial = ("denied", response["status"]["message"])
    if not case.routes:  # what the apiserver never sends, the gateway never sees (tests/test_controlplane_*)
        return ("not sent", case.verdict[1])
    return denial or ("allowed", "")


def _matches(got: tuple[str, str], want: tuple[str, str], where: str) -> None:
    assert got[0] == want[0] and want[1] in got[1], f"{where}: {got} is not {want}"


@pytest.mark.parametrize("case", CASES)
async def test_every_command_reaches_the_same_verdict(
    nursery: trio.Nursery, tmp_path: Path, case: Case
) -> None:
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    base = f"http://127.0.0.1:{server.port}"
    config = tmp_path / "config"
    _write_case(case, config, base)
    common = ["--config", str(config), *case.flags]
    registration: list[str] = []
    if case.registration is not None:
        (tmp_path / "registration.yaml").write_text(yaml.safe_dump_all(case.registration))
        registration = ["--registration", str(tmp_path / "registration.yaml")]
    (tmp_path / "review.json").write_text(json.dumps(case.review))
    (tmp_path / "objects.yaml").write_text(yaml.safe_dump(case.review["request"]["object"]))
    operation = ["--operation", case.review["request"]["operation"]]
    serve_flags = [f for f in case.flags if f != "--unknown-namespace" and f != "emptyLabels"]
    if "emptyLabels" in case.flags:
        serve_flags += ["--unknown-namespace", "emptyLabels"]
    check_flags = [f for f in serve_flags if f == "--allow-empty-config"]

    # check, and start-up through the command line (a refused configuration: exit 2, one reason)
    checked = await _run("check", str(config), *check_flags, cwd=tmp_path)
    if case.verdict[0] == "refused":
        assert checked.returncode == 1 and case.verdict[1] in checked.stderr, checked.stderr
        started = await _run(*common, "--bind", "127.0.0.1:0", "--workers", "1", cwd=tmp_path)
        assert started.returncode == 2 and case.verdict[1] in started.stdout + started.stderr
    else:
        assert checked.returncode == 0, checked.stderr

    # reload: a running gateway is given this configuration
    good = tmp_path / "good"
    write_config(good, validating={"good": [hook("good.example.com", f"{base}/allow", rules=PODS)]})
    observer = _Reloads()
    options = parse(["--config", str(good), "--bind", "127.0.0.1:0", "--drain-seconds", "0",
                     "--config-poll-seconds", "0.05", *serve_flags]).options  # fmt: skip
    running: Running = await nursery.start(
        lambda task_status: serve(options, observer=observer, handle_signals=False, task_status=task_status)
    )
    (good / "webhooks.yaml").write_text((config / "webhooks.yaml").read_text())
    with trio.fail_after(10):
        while len(observer.loads) < 2:
            await trio.sleep(0.05)
    assert observer.loads[1] is (case.verdict[0] != "refused"), "reload agrees with check"

    # explain, explain --call, audit
    explained = await _run("explain", *common, *registration, str(tmp_path / "review.json"), "-o", "json",
                     "--fail-on", "none", cwd=tmp_path)  # fmt: skip
    called = await _run("explain", *common, *registration, str(tmp_path / "review.json"), "-o", "json", "--call",
                  "--fail-on", "none", cwd=tmp_path)  # fmt: skip
    audited = await _run("audit", *common, *registration, *operation, str(tmp_path / "objects.yaml"), "-o", "json",
                   "--fail-on", "none", cwd=tmp_path)  # fmt: skip
    if case.verdict[0] == "refused":
        for got in (explained, called, audited):
            assert got.returncode == 2 and case.verdict[1] in got.stderr, got.stderr
        return
    for name, got in (("explain", explained), ("explain --call", called), ("audit", audited)):
        assert got.returncode == 0, f"{name}: {got.stderr}"
    static, call = json.loads(explained.stdout), json.loads(called.stdout)
    sent_to = [(r["path"], r["timeoutSeconds"]) for r in static["registration"]["sentTo"]]
    assert sent_to == [(p, float(t)) for p, t in case.routes], "explain routes it as the apiserver does"

    def verdict_of(report: dict[str, Any]) -> tuple[str, str]:
        v = report["verdict"]
        outcome = "not sent" if v["outcome"] == "not sent" else "allowed" if v["allowed"] else "denied"
        return (outcome, v["message"])

    (entry,) = json.loads(audited.stdout)["objects"]
    failing = [r["message"] for r in entry["results"] if r["result"] in ("fail", "error")]
    skipped = [r["message"] for r in entry["results"] if r["result"] == "skip"]
    audit_verdict = (
        ("not sent", " ".join(skipped) or case.verdict[1])
        if entry["outcome"] == "not sent"
        else ("allowed" if entry["allowed"] else "denied", " ".join(failing))
    )
    served = await _serve_verdict(
        running if not case.routes else await _gateway(nursery, config, serve_flags), case
    )
    for where, got in (("serve", served), ("explain --call", verdict_of(call)), ("audit", audit_verdict)):
        _matches(got, case.verdict, where)
    if not case.backends_decide:
        _matches(verdict_of(static), case.verdict, "explain")


async def _gateway(nursery: trio.Nursery, config: Path, flags: list[str]) -> Running:
    options = parse(
        ["--config", str(config), "--bind", "127.0.0.1:0", "--drain-seconds", "0", *flags]
    ).options
    running: Running = await nursery.start(
        lambda task_status: serve(options, handle_signals=False, task_status=task_status)
    )
    return running
