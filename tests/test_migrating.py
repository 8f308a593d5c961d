"""docs/migrating.md's files (issue 34 §3): each project's copy in config/examples/<project>/ passes the
strict `check`, names its CA where the owner keeps it, ships the RBAC for exactly those references,
and its parking patches name exactly the webhooks the copy moves behind the gateway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config.load import load_directory
from gateway.config.migration import PARKED_CONDITION
from gateway.config.trust import rbac_documents, watch_plan

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "config" / "examples"
GUIDE = REPO / "docs" / "migrating.md"
PROJECTS = ["cert-manager", "gatekeeper", "kyverno", "istio", "kubewarden"]

# Each project's CA reference, as the guide names it (the owner's place, checked against its source).
REFERENCES = {
    "cert-manager": "secret cert-manager/cert-manager-webhook-ca[ca.crt]",
    "gatekeeper": "secret gatekeeper-system/gatekeeper-webhook-server-cert[ca.crt]",
    "kyverno": "secret kyverno/kyverno-svc.kyverno.svc.kyverno-tls-ca[tls.crt]",
    "istio": "configMap istio-system/istio-ca-root-cert[root-cert.pem]",
    "kubewarden": "validatingWebhookConfiguration clusterwide-no-privileged-pod[clusterwide-no-privileged-pod.kubewarden.admission]",
}
# The project's own flags and Helm values the guide must name for stopping or excluding it.
NAMED = {
    "cert-manager": ["--dynamic-serving-ca-secret-name", "cert-manager.io/inject-ca-from-secret"],
    "gatekeeper": ["--disable-cert-rotation", "--validating-webhook-configuration-name", "validatingWebhookName",
                   "disableValidatingWebhook", "mutatingWebhookMatchConditions"],
    "kyverno": ["--autoUpdateWebhooks", "features.autoUpdateWebhooks.enabled", "--caSecretName"],
    "istio": ["global.operatorManageWebhooks", "global.configValidation", "VALIDATION_WEBHOOK_CONFIG_NAME"],
    "kubewarden": ["spec.matchConditions", "kubewarden/kubewarden-ca"],
}  # fmt: skip


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "project",
    PROJECTS,
    ids=lambda p: f"issue 34 §3: {p}'s copy passes check --warnings-as-errors, CA from its owner",
)
def test_each_guides_configuration_passes_the_strict_check(project: str) -> None:
    run = run_cli("check", "--warnings-as-errors", str(EXAMPLES / project))
    assert run.returncode == 0, run.stderr
    assert "0 warning(s)" in run.stdout
    lines = [line for line in run.stdout.splitlines() if "webhook '" in line]
    assert lines, run.stdout
    for line in lines:  # step 1: every webhook in Shadow mode, with its owner's CA
        assert line.endswith(f"mode=Shadow caFrom={REFERENCES[project]}"), line


@pytest.mark.parametrize(
    "project", PROJECTS, ids=lambda p: f"{p}: cluster/rbac.yaml allows exactly the references"
)
def test_each_guides_rbac_is_what_its_references_need(project: str) -> None:
    shipped = [d for d in yaml.safe_load_all((EXAMPLES / project / "cluster" / "rbac.yaml").read_text()) if d]
    assert shipped == rbac_documents(watch_plan(load_directory(EXAMPLES / project)))
    for doc in shipped:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def _parking_patches(project: str) -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, yaml.safe_load(path.read_text()))
        for path in sorted((EXAMPLES / project / "cluster").glob("*.yaml"))
        if path.name.startswith(("park", "unpark"))
    ]


@pytest.mark.parametrize("project", ["cert-manager", "kyverno", "istio"])
def test_parking_patches_name_exactly_the_moved_webhooks(project: str) -> None:
    """Every webhook the copy moves is parked by some patch, and every patch parks a moved webhook,
    with the condition `check` recognises (and its rollback removes that condition only)."""
    snapshot = load_directory(EXAMPLES / project)
    moved = {h.name for h in (*snapshot.validating, *snapshot.mutating)}
    parked: set[str] = set()
    for path, patch in _parking_patches(project):
        for webhook in patch["webhooks"]:
            assert webhook["name"] in moved, f"{path.name}: {webhook['name']}"
            (condition,) = webhook["matchConditions"]
            assert condition["name"] == PARKED_CONDITION
            if path.name.startswith("park"):
                assert condition["expression"] == "false"
                parked.add(webhook["name"])
            else:
                assert condition == {"name": PARKED_CONDITION, "$patch": "delete"}
    assert parked == moved


def test_kubewarden_parks_through_the_policy() -> None:
    patch = yaml.safe_load((EXAMPLES / "kubewarden" / "cluster" / "park-policy.yaml").read_text())
    assert patch == {"spec": {"matchConditions": [{"name": PARKED_CONDITION, "expression": "false"}]}}
    assert yaml.safe_load((EXAMPLES / "kubewarden" / "cluster" / "unpark-policy.yaml").read_text()) == {
        "spec": {"matchConditions": None}
    }


@pytest.mark.parametrize("project", PROJECTS)
def test_the_guide_names_each_projects_flags_reference_and_files(project: str) -> None:
    guide = GUIDE.read_text()
    for name in NAMED[project]:
        assert f"`{name}" in guide, f"{project}: {name}"
    assert f"](../config/examples/{project})" in guide
    source = REFERENCES[project].partition(" ")[0]
    assert f"caFrom: {{{source}: " in guide


def test_the_readme_links_the_guide() -> None:
    assert "](docs/migrating.md)" in (REPO / "README.md").read_text()
