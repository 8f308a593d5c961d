"""``webhook-gateway registration``: print the gateway's own registration pair for a configuration.

The computation lives in ``gateway.registration``; this module turns options into its settings,
prints YAML (or JSON) an operator applies after the gateway's pods are ready, and backs
``check --registration FILE``.
"""

from __future__ import annotations

import json
import sys
import textwrap
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gateway.config.model import Snapshot
from gateway.registration import (
    DEFAULT_EXCLUDED_RESOURCES,
    DEFAULT_SYSTEM_NAMESPACES,
    NAMESPACE_REASONS,
    OWN_NAMESPACE_REASON,
    Registration,
    Settings,
    compare,
    compute,
    excluded_namespaces,
    resource_exclusion,
)


def _names(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def settings_from(options: Namespace) -> Settings:
    """Settings from the ``registration`` options; ValueError names the offending option."""
    namespaces = [] if options.no_default_exclusions else [options.namespace, *DEFAULT_SYSTEM_NAMESPACES]
    namespaces += [n for n in _names(options.exclude_namespaces) if n not in namespaces]
    dropped = set(_names(options.include_namespaces))
    resources = [] if options.no_default_exclusions else list(DEFAULT_EXCLUDED_RESOURCES)
    try:
        resources += [resource_exclusion(spec) for spec in _names(options.exclude_resources)]
        kept = {(e.group, e.resource) for e in map(resource_exclusion, _names(options.include_resources))}
    except ValueError as exc:
        raise ValueError(f"--exclude-resources/--include-resources: {exc}") from None
    ca_bundle = b""
    if options.ca_bundle:
        try:
            ca_bundle = Path(options.ca_bundle).read_bytes()
        except OSError as exc:
            raise ValueError(f"--ca-bundle {options.ca_bundle}: {exc.strerror or exc}") from None
        if b"-----BEGIN CERTIFICATE-----" not in ca_bundle:
            raise ValueError(f"--ca-bundle {options.ca_bundle}: no PEM certificate in the file")
    unique = {(e.group, e.resource): e for e in resources if (e.group, e.resource) not in kept}
    return Settings(
        name=options.name,
        namespace=options.namespace,
        service=options.service,
        port=options.port,
        validate_path=options.validate_path,
        mutate_path=options.mutate_path,
        ca_bundle=ca_bundle,
        failure_policy=options.failure_policy,
        deadline_margin=options.deadline_margin,
        excluded_namespaces=tuple(n for n in namespaces if n not in dropped),
        excluded_resources=tuple(unique.values()),
    )


def header(settings: Settings) -> str:
    """YAML comments: how to apply, and what is excluded and why."""
    lines = [
        "The webhook-gateway's own registrations, computed from its backend configuration by",
        "`webhook-gateway registration`. Apply them only once a gateway pod is ready:",
        "  kubectl -n NAMESPACE rollout status deploy/webhook-gateway && kubectl apply -f FILE",
        "Never registered, whatever the backends ask for (each would let a gateway outage stop the",
        "cluster from repairing itself):",
    ]
    for ns in excluded_namespaces(settings):
        reason = (
            OWN_NAMESPACE_REASON
            if ns == settings.namespace
            else NAMESPACE_REASONS.get(ns, "operator's choice")
        )
        lines.append(f"- namespace {ns}: {reason}")
    for exclusion in settings.excluded_resources:
        lines.append(f"- {exclusion.label}: {exclusion.prevents}")
    wrapped = [w for line in lines for w in textwrap.wrap(line, 98, subsequent_indent="    ")]
    return "".join(f"# {line}\n" for line in wrapped)


def render(registration: Registration, settings: Settings, output: str) -> str:
    if output == "json":
        return json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": list(registration.documents())}, indent=2
        )
    body = "---\n".join(yaml.safe_dump(doc, sort_keys=False) for doc in registration.documents())
    return header(settings) + "---\n" + body


def run(options: Namespace) -> int:
    """Print the registration for ``--config``; exit 1 when the configuration or an option is bad."""
    from gateway.config.load import load_directory
    from gateway.errors import ConfigError

    try:
        settings = settings_from(options)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        snapshot = load_directory(options.config)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{problem.severity}: {problem}", file=sys.stderr)
        print(f"{options.config}: configuration refused; no registration printed", file=sys.stderr)
        return 1
    registration = compute(snapshot, settings)
    for note in registration.notes:
        print(f"note: {note}", file=sys.stderr)
    sys.stdout.write(render(registration, settings, options.output))
    return 0


def registration_findings(snapshot: Snapshot, path: str, *, deadline_margin: float = 0.2) -> list[str]:
    """``check --registration FILE``: where FILE is broader or stricter than the configuration needs."""
    try:
        docs: Sequence[Any] = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        return [f"{path}: cannot read the registration: {getattr(exc, 'strerror', None) or exc}"]
    if len(docs) == 1 and isinstance(docs[0], dict) and isinstance(docs[0].get("items"), list):
        docs = docs[0]["items"]
    namespace = "webhook-gateway"
    for doc in docs:
        for hook in (doc.get("webhooks") or []) if isinstance(doc, dict) else []:
            service = (hook.get("clientConfig") or {}).get("service") or {}
            namespace = service.get("namespace", namespace)
    settings = Settings(
        namespace=namespace,
        deadline_margin=deadline_margin,
    )
    return [f"{path}: {finding}" for finding in compare(docs, compute(snapshot, settings))]
