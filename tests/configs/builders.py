"""Builders of configuration documents (plain dicts, as YAML would parse them) for the config tests."""

from __future__ import annotations

import copy
from typing import Any

from gateway.config.load import load_documents
from gateway.config.model import Snapshot
from gateway.errors import ConfigError, ConfigProblem

V1 = "admissionregistration.k8s.io/v1"
V1BETA1 = "admissionregistration.k8s.io/v1beta1"
MUTATING = "MutatingWebhookConfiguration"
VALIDATING = "ValidatingWebhookConfiguration"


def rule(**overrides: Any) -> dict[str, Any]:
    """A valid rule: CREATE of core v1 pods."""
    return {
        "operations": ["CREATE"],
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "resources": ["pods"],
    } | overrides


def hook(name: str = "a.b.c", **overrides: Any) -> dict[str, Any]:
    """A valid v1 webhook; ``overrides`` replace fields (a value of ``...`` removes the field)."""
    base: dict[str, Any] = {
        "name": name,
        "clientConfig": {"url": "https://backend.example.com/hook"},
        "rules": [rule()],
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "matchPolicy": "Exact",
    }
    base.update(copy.deepcopy(overrides))
    return {k: v for k, v in base.items() if v is not ...}


def config(
    *hooks: dict[str, Any],
    name: str = "team-a",
    kind: str = MUTATING,
    api_version: str = V1,
    **extra: Any,
) -> dict[str, Any]:
    """A configuration object holding ``hooks``."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name},
        "webhooks": list(hooks),
    } | extra


def load(*docs: object, lax: bool = False, strict_https: bool = False) -> Snapshot:
    """Load documents as ``t.yaml`` (first), ``u.yaml`` …"""
    labels = [f"{chr(ord('t') + i)}.yaml" for i in range(len(docs))]
    return load_documents(zip(labels, docs, strict=True), lax=lax, strict_https=strict_https)


def problems_of(*docs: object, lax: bool = False, strict_https: bool = False) -> list[ConfigProblem]:
    """Every problem loading ``docs`` reports (errors and warnings), in report order."""
    try:
        snapshot = load(*docs, lax=lax, strict_https=strict_https)
    except ConfigError as exc:
        return exc.problems
    return list(snapshot.warnings)


def errors_of(*docs: object, lax: bool = False, strict_https: bool = False) -> list[str]:
    """``path: message`` of every error loading ``docs`` reports."""
    return [
        f"{p.path}: {p.message}"
        for p in problems_of(*docs, lax=lax, strict_https=strict_https)
        if p.severity == "error"
    ]


def warnings_of(*docs: object, lax: bool = False) -> list[str]:
    """``path: message`` of every warning (the documents must load)."""
    return [f"{p.path}: {p.message}" for p in load(*docs, lax=lax).warnings]
