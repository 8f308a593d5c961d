"""``webhook-gateway registration``: print the gateway's own registration pair for a configuration.

The computation lives in ``gateway.registration``; this module turns options into its settings,
prints YAML (or JSON) an operator applies after the gateway's pods are ready, prints a note on stderr
wherever the registration changes what a backend sees or what a gateway outage does to it, and backs
``check --registration FILE``.
"""

from __future__ import annotations

import json
import sys
import textwrap
from argparse import Namespace
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.commands.options import NO_CONFIG, Parser, fail
from gateway.config.model import Snapshot
from gateway.registration import (
    DEFAULT_EXCLUDED_RESOURCES,
    DEFAULT_SYSTEM_NAMESPACES,
    NAMESPACE_REASONS,
    OWN_NAMESPACE_REASON,
    Registration,
    Settings,
    base_path,
    compare,
    compute,
    excluded_namespaces,
    resource_exclusion,
    webhook_path,
)

SUMMARY = "print the gateway's own narrowest Validating/MutatingWebhookConfiguration pair"


def build_parser(prog: str) -> Parser:
    p = Parser(
        prog=prog,
        description="Print the narrowest Validating/MutatingWebhookConfiguration pair that delivers every "
        "review some backend in --config could match, minus cluster infrastructure.",
    )
    p.add_option("--config", help="configuration directory or file (required)")
    p.add_option("--name", help="name of both registration objects", default="webhook-gateway")
    p.add_option(
        "--namespace", help="the gateway's own namespace (always excluded)", default="webhook-gateway"
    )
    p.add_option("--service", help="the gateway's Service", default="webhook-gateway")
    p.add_option("--port", help="the Service port", type=int, default=443)
    p.add_option(
        "--url",
        help="https://HOST:PORT of a gateway outside the cluster network (e.g. beside the apiserver on a "
        "control-plane host): registers clientConfig.url instead of the --service reference",
    )
    p.add_option(
        "--validate-path",
        help="path of the validating endpoint (the two halves are served on PATH/fail and PATH/ignore)",
        default="/validate",
    )
    p.add_option("--mutate-path", help="path of the mutating endpoint", default="/mutate")
    p.add_option("--ca-bundle", help="PEM file of the CA that signed the serving certificate (caBundle)")
    p.add_option(
        "--failure-policy",
        choices=("auto", "Fail", "Ignore"),
        default="auto",
        help="what the apiserver does when no gateway replica answers: auto keeps each backend's own "
        "(validating backends split into a -fail and an -ignore registration; the mutating chain fails "
        "closed when one of its backends does); Fail or Ignore forces one policy, with a note per "
        "backend it changes",
    )
    p.add_option(
        "--deadline-margin",
        help="the gateway's --deadline-margin (added to the backends' budget)",
        type=float,
        default=0.2,
    )
    p.add_option("--exclude-namespaces", help="comma-separated namespaces to exclude as well")
    p.add_option(
        "--include-namespaces", help="comma-separated namespaces to deliver despite the default exclusions"
    )
    p.add_option(
        "--exclude-resources", help="comma-separated RESOURCE[.GROUP] to exclude as well (all subresources)"
    )
    p.add_option(
        "--include-resources",
        help="comma-separated RESOURCE[.GROUP] to deliver despite the default exclusions, e.g. events",
    )
    p.add_option(
        "--no-default-exclusions",
        action="store_true",
        help="exclude nothing by default (not even the gateway's own namespace): unsafe",
    )
    p.add_option("--output", choices=("yaml", "json"), default="yaml", help="output format")
    return p


@dataclass(frozen=True, slots=True)
class RegistrationRequest:
    """What ``registration`` was asked for: the configuration, the output format and the settings.

    ``error`` holds the one-line reason when an option was unusable (then ``settings`` is None).
    """

    config: str
    output: str
    settings: Settings | None
    error: str = ""


def settings(options: Namespace) -> RegistrationRequest:
    try:
        return RegistrationRequest(options.config, options.output, settings_from(options))
    except ValueError as exc:
        return RegistrationRequest(options.config, options.output, None, str(exc))


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
    if options.url:
        from gateway.config.validation import validate_url

        problems = validate_url(options.url, "--url", strict_https=True)
        if problems:
            raise ValueError(str(problems[0]))
    unique = {(e.group, e.resource): e for e in resources if (e.group, e.resource) not in kept}
    return Settings(
        name=options.name,
        namespace=options.namespace,
        service=options.service,
        port=options.port,
        url=options.url or "",
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
        "Validating backends with failurePolicy Fail and Ignore are served through two webhooks",
        f"(...-fail on {settings.validate_path}/fail, ...-ignore on {settings.validate_path}/ignore), so "
        "that a gateway outage fails open exactly where the backends would.",
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


def run(request: RegistrationRequest) -> int:
    """Print the registration for ``--config``; exit 2 when the configuration or an option is bad.

    A configuration without webhooks is accepted here (unlike serve without --allow-empty-config):
    its registration is empty, so the apiserver sends the gateway nothing and nothing is allowed
    that was not before.
    """
    from gateway.config.load import load_config
    from gateway.errors import ConfigError

    if request.settings is None:
        return fail(request.error, 2)
    if not request.config:
        return fail(NO_CONFIG, 2)
    try:
        snapshot = load_config(request.config, allow_empty=True)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{problem.severity}: {problem}", file=sys.stderr)
        print(f"{request.config}: configuration refused; no registration printed", file=sys.stderr)
        return 2
    registration = compute(snapshot, request.settings)
    for note in registration.notes:
        print(f"note: {note}", file=sys.stderr)
    sys.stdout.write(render(registration, request.settings, request.output))
    return 0


def read_registration(path: str) -> list[dict[str, Any]]:
    """The objects of a registration file (YAML documents, or a List as ``-o json`` prints)."""
    docs: Sequence[Any] = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    if len(docs) == 1 and isinstance(docs[0], dict) and isinstance(docs[0].get("items"), list):
        docs = docs[0]["items"]
    return [d for d in docs if isinstance(d, dict)]


def settings_of(docs: Sequence[dict[str, Any]], *, deadline_margin: float = 0.2) -> Settings:
    """The settings a registration file was computed with, as far as they show in it: the gateway's
    namespace (its service reference) and the endpoints' paths."""
    namespace, paths = "webhook-gateway", {"ValidatingWebhookConfiguration": "/validate"}
    paths["MutatingWebhookConfiguration"] = "/mutate"
    seen: set[str] = set()
    for doc in docs:
        for hook in doc.get("webhooks") or []:
            service = (hook.get("clientConfig") or {}).get("service") or {}
            namespace = service.get("namespace", namespace)
            if doc.get("kind") in paths and str(doc["kind"]) not in seen:
                paths[str(doc["kind"])] = base_path(webhook_path(hook))  # the first webhook's
                seen.add(str(doc["kind"]))
    return Settings(
        namespace=namespace,
        validate_path=paths["ValidatingWebhookConfiguration"],
        mutate_path=paths["MutatingWebhookConfiguration"],
        deadline_margin=deadline_margin,
    )


def registration_findings(snapshot: Snapshot, path: str, *, deadline_margin: float = 0.2) -> list[str]:
    """``check --registration FILE``: where FILE is broader or stricter than the configuration needs."""
    try:
        docs = read_registration(path)
    except (OSError, yaml.YAMLError) as exc:
        return [f"{path}: cannot read the registration: {getattr(exc, 'strerror', None) or exc}"]
    settings = settings_of(docs, deadline_margin=deadline_margin)
    return [f"{path}: {finding}" for finding in compare(docs, snapshot, settings)]
