"""``webhook-gateway check``: validate configuration without serving; exit 1 on errors.

Takes directories (their ``*.yaml``/``*.yml``/``*.json`` files), single files and ``-`` (stdin), and
validates them with ``gateway.config.load.load_config``, the function ``serve`` runs at start-up and
at every reload: what ``check`` accepts, ``serve`` accepts, with the same messages. Every warning
carries a code (shown in brackets) so a CI gate can accept a reviewed one with ``--ignore-warning
CODE`` and still fail on new ones with ``--warnings-as-errors``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from gateway.commands.options import NO_CONFIG, Parser, fail
from gateway.config.migration import WARNING_CODES as MIGRATION_WARNING_CODES
from gateway.config.trust import WARNING_CODES as CA_WARNING_CODES
from gateway.errors import ConfigProblem

SUMMARY = "validate configuration files, directories or stdin; exit 1 on errors"

# The warning codes `check` prints, and what each means (docs/configuration.md lists them too).
WARNING_CODES = {
    "unknown-field": "a field the gateway does not know (often a typo); it is ignored",
    "match-policy-equivalent": "Equivalent would reach this webhook through another group/version",
    "timeouts-add-up": "webhooks that can match the same request have more timeout than the gateway's budget",
    "ca-bundle": "caBundle holds no usable certificate",
    **CA_WARNING_CODES,
    **MIGRATION_WARNING_CODES,
    "registration": "the --registration file is broader or stricter than the configuration needs",
    "other": "any other warning",
}


def warning_code(problem: ConfigProblem) -> str:
    """The code of a warning: its own, else from where it points."""
    if problem.code:
        return problem.code
    if problem.message.startswith("unknown field"):
        return "unknown-field"
    if problem.path.endswith("matchPolicy"):
        return "match-policy-equivalent"
    if "add up to" in problem.message:
        return "timeouts-add-up"
    if "caBundle" in problem.path:
        return "ca-bundle"
    return "other"


@dataclass(frozen=True, slots=True)
class CheckSettings:
    paths: tuple[str, ...]
    strict_https: bool = False
    allow_empty_config: bool = False
    warnings_as_errors: bool = False
    ignore_warning: frozenset[str] = frozenset()
    registration: str | None = None


def build_parser(prog: str) -> Parser:
    p = Parser(
        prog=prog,
        description="Validate webhook configurations (directories, files, or - for stdin); print every "
        "problem; exit 1 on errors (and on warnings with --warnings-as-errors).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="warning codes:\n" + "\n".join(f"  {c:<24} {w}" for c, w in WARNING_CODES.items()),
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="directory, file, or - for stdin")
    p.add_option("--config", help="configuration directory or file, when no PATH is given")
    p.add_option("--strict-https", action="store_true", help="refuse http:// URLs even on loopback")
    p.add_option(
        "--allow-empty-config",
        action="store_true",
        help="accept a configuration with no webhooks, as serve --allow-empty-config does",
    )
    p.add_option("--warnings-as-errors", action="store_true", help="exit 1 on warnings too")
    p.add_option(
        "--ignore-warning",
        action="append",
        metavar="CODE",
        default=[],
        choices=sorted(WARNING_CODES),
        help="accept warnings with this code (repeatable; env: comma-separated)",
    )
    p.add_option(
        "--registration",
        help="also warn where this registration file is broader or stricter than the config needs",
    )
    return p


def settings(options: argparse.Namespace) -> CheckSettings:
    return CheckSettings(
        paths=tuple(options.paths) or ((options.config,) if options.config else ()),
        strict_https=options.strict_https,
        allow_empty_config=options.allow_empty_config,
        warnings_as_errors=options.warnings_as_errors,
        ignore_warning=frozenset(options.ignore_warning),
        registration=options.registration,
    )


def run(options: CheckSettings) -> int:
    from gateway.config.backend_policy import DEFAULT_POLICY
    from gateway.config.load import load_config
    from gateway.errors import ConfigError

    if not options.paths:
        return fail(NO_CONFIG, 2)
    where = ", ".join("<stdin>" if p == "-" else p for p in options.paths)
    stdin_text = sys.stdin.read() if "-" in options.paths else None
    try:
        snapshot = load_config(
            options.paths,
            stdin_text=stdin_text,
            strict_https=options.strict_https,
            allow_empty=options.allow_empty_config,
        )
    except ConfigError as exc:
        for problem in exc.problems:
            if problem.severity == "warning" and warning_code(problem) in options.ignore_warning:
                continue
            suffix = f" [{warning_code(problem)}]" if problem.severity == "warning" else ""
            print(f"{problem.severity}: {problem}{suffix}", file=sys.stderr)
        print(f"{where}: {len(exc.errors)} error(s); configuration refused", file=sys.stderr)
        return 1
    shown = [w for w in snapshot.warnings if warning_code(w) not in options.ignore_warning]
    for problem in shown:
        print(f"warning: {problem} [{warning_code(problem)}]", file=sys.stderr)
    findings: list[str] = []
    if options.registration and "registration" not in options.ignore_warning:
        from gateway.commands.registration import registration_findings

        findings = registration_findings(snapshot, options.registration)
        for finding in findings:
            print(f"warning: {finding} [registration]", file=sys.stderr)
        if findings:
            config = " ".join(options.paths)
            hint = f"webhook-gateway registration --config {config} > {options.registration}"
            print(f"hint: regenerate it: {hint}", file=sys.stderr)
    ignored = len(snapshot.warnings) - len(shown)
    counts = (
        f"{len(snapshot.validating)} validating and {len(snapshot.mutating)} mutating webhooks, "
        f"{len(snapshot.namespaces)} namespaces, {len(shown) + len(findings)} warning(s)"
        + (f" ({ignored} ignored)" if ignored else "")
    )
    refused = bool(shown or findings) and options.warnings_as_errors
    if refused:
        print(f"{where}: FAILED (--warnings-as-errors): {counts}", file=sys.stderr)
    else:
        print(f"{where}: OK: {counts}")
    for crd_name, entry in sorted(snapshot.conversions.items()):  # CRD conversion webhooks
        cc = entry.client_config
        target = cc.url or (f"service {cc.service.namespace}/{cc.service.name}" if cc.service else "")
        cache = ", cache on" if entry.cache else ""
        print(
            f"  conversion {crd_name} -> {target} (review versions "
            f"{', '.join(entry.conversion_review_versions)}; timeout {entry.timeout_seconds:g}s{cache})"
        )
    for hook in (*snapshot.validating, *snapshot.mutating):  # webhook-gateway.io/backend-policy in force
        if hook.backend_policy != DEFAULT_POLICY:
            policy = hook.backend_policy.describe()
            print(f"  {hook.kind} webhook {hook.name!r} ({hook.configuration}): {policy}")
    return 1 if refused else 0
