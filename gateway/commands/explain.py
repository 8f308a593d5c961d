"""``webhook-gateway explain``: whether the apiserver sends a review to the gateway at all, which
backends it then reaches and why, in which order, with which timeout — and with ``--call``, what they
answer (as a dry run).

The input is an AdmissionReview (JSON or YAML), or a plain object with ``--operation``,
``--namespace-labels`` and ``--user`` filling in what the apiserver would. Every decision comes from the
code ``serve`` runs (``gateway.commands.whatif``): the registration (``--registration FILE``, or the one
``registration`` computes) matched like the apiserver matches it, the budget it gives, the namespace
labels as serve finds them, and the Dispatcher itself. Exit 0 when the review is allowed (or never
sent), 1 when it is denied, 3 when a backend fails (``--fail-on`` chooses), 2 when explain cannot run.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.commands.options import NO_CONFIG, Parser, fail

SUMMARY = "show whether a review reaches the gateway, which backends it reaches and why; --call sends it"

DRY_RUN_REFUSING = ("Unknown", "Some")  # FPT-09
FAIL_ON = ("any", "denial", "error", "none")
EXIT_DENIED, EXIT_USAGE, EXIT_ERROR = 1, 2, 3


@dataclass(frozen=True, slots=True)
class ExplainSettings:
    input: str
    config: str = ""
    allow_empty_config: bool = False
    strict_https: bool = False
    unknown_namespace: str = "notFound"
    registration: str | None = None
    operation: str = "CREATE"
    namespace: str | None = None
    namespace_labels: dict[str, str] | None = None
    user: str = "admin"
    groups: tuple[str, ...] = ("system:authenticated",)
    resource: str | None = None
    subresource: str = ""
    dry_run: bool = False
    timeout: float | None = None  # None: the registration's timeoutSeconds, as the apiserver sends it
    deadline_margin: float = 0.2
    call: bool = False
    backend_kubeconfig: str | None = None
    output: str = "table"
    fail_on: str = "any"
    extra: dict[str, Any] = field(default_factory=dict)


def _labels(text: str) -> dict[str, str]:
    labels = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {part!r}")
        labels[key] = value
    return labels


def add_decision_options(p: Parser) -> None:
    """The options explain and audit share with serve: the same configuration, validated and decided
    the same way."""
    p.add_option("--config", help="configuration directory or file (required)")
    p.add_option(
        "--allow-empty-config",
        action="store_true",
        help="accept a configuration with no webhooks, as serve does",
    )
    p.add_option("--strict-https", action="store_true", help="refuse http:// backend URLs even on loopback")
    p.add_option(
        "--unknown-namespace",
        choices=("notFound", "emptyLabels"),
        default="notFound",
        help="a namespace without a Namespace object in --config is 404, or has no labels (as serve's)",
    )
    p.add_option(
        "--registration",
        help="the gateway's registration as applied (a file `registration` printed); default: the one "
        "`registration` computes from --config",
    )
    p.add_option(
        "--deadline-margin", type=float, default=0.2, help="the gateway's --deadline-margin (seconds)"
    )
    p.add_option(
        "--fail-on",
        choices=FAIL_ON,
        default="any",
        help="exit non-zero on: any (a denial: 1, else a backend error: 3), denial, error, none",
    )
    p.add_option("--backend-kubeconfig", help="with --call: per-host backend credentials")


def build_parser(prog: str) -> Parser:
    p = Parser(
        prog=prog,
        description="Explain what happens to a review: whether the apiserver sends it to the gateway "
        "(its registration), per backend matched or not and why, the order of calls, each effective "
        "timeout, and which backends a dry run refuses; with --call, the backends' answers.",
    )
    p.add_argument(
        "input", metavar="REVIEW", help="AdmissionReview or object file (JSON or YAML), or - for stdin"
    )
    add_decision_options(p)
    p.add_option(
        "--operation",
        help="for a plain object: the request's operation",
        choices=("CREATE", "UPDATE", "DELETE", "CONNECT"),
        default="CREATE",
    )
    p.add_option("--namespace", help="for a plain object: its namespace", shown_default="metadata.namespace")
    p.add_option(
        "--namespace-labels",
        type=_labels,
        help="labels of the request's namespace, KEY=VALUE,... (else from Namespace objects in --config)",
    )
    p.add_option("--user", help="for a plain object: userInfo.username", default="admin")
    p.add_option(
        "--groups",
        help="for a plain object: userInfo.groups, comma-separated",
        default="system:authenticated",
    )
    p.add_option(
        "--resource", help="for a plain object: its resource (plural)", shown_default="from its kind"
    )
    p.add_option("--subresource", help="for a plain object: the subresource", default="")
    p.add_option("--dry-run", action="store_true", help="treat the request as a dry run")
    p.add_option(
        "--timeout",
        type=float,
        help="the caller's budget in seconds (?timeout=)",
        shown_default="the registration's timeoutSeconds, as the apiserver sends it",
    )
    p.add_option(
        "--call", action="store_true", help="send the review (dryRun forced true) and show the answers"
    )
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    return p


def settings(options: argparse.Namespace) -> ExplainSettings:
    return ExplainSettings(
        input=options.input,
        config=options.config or "",
        allow_empty_config=options.allow_empty_config,
        strict_https=options.strict_https,
        unknown_namespace=options.unknown_namespace,
        registration=options.registration,
        operation=options.operation,
        namespace=options.namespace,
        namespace_labels=options.namespace_labels,
        user=options.user,
        groups=tuple(g for g in options.groups.split(",") if g),
        resource=options.resource,
        subresource=options.subresource,
        dry_run=options.dry_run,
        timeout=options.timeout,
        deadline_margin=options.deadline_margin,
        call=options.call,
        backend_kubeconfig=options.backend_kubeconfig,
        output=options.output,
        fail_on=options.fail_on,
    )


# --- building the review -------------------------------------------------------------------------

_IRREGULAR = {"endpoints": "endpoints", "ingress": "ingresses", "networkpolicy": "networkpolicies"}


def plural(kind: str) -> str:
    """The resource name the apiserver serves a kind under (the usual English rule, with exceptions)."""
    lower = kind.lower()
    if lower in _IRREGULAR:
        return _IRREGULAR[lower]
    if lower.endswith("y") and lower[-2:-1] not in "aeiou":
        return lower[:-1] + "ies"
    if lower.endswith(("s", "x", "ch", "sh")):
        return lower + "es"
    return lower + "s"


def review_for(
    obj: dict[str, Any],
    *,
    operation: str = "CREATE",
    namespace: str | None = None,
    resource: str | None = None,
    subresource: str = "",
    user: str = "admin",
    groups: tuple[str, ...] = ("system:authenticated",),
    dry_run: bool = False,
) -> dict[str, Any]:
    """An AdmissionReview as kube-apiserver would send it for ``obj``."""
    api_version = str(obj.get("apiVersion", ""))
    group, _, version = api_version.rpartition("/")
    kind = str(obj.get("kind", ""))
    meta = obj.get("metadata") or {}
    namespace = namespace if namespace is not None else str(meta.get("namespace", ""))
    deleting = operation == "DELETE"
    gvr = {"group": group, "version": version, "resource": resource or plural(kind)}
    gvk = {"group": group, "version": version, "kind": kind}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": gvk,
            "resource": gvr,
            "subResource": subresource,
            "requestKind": gvk,
            "requestResource": gvr,
            "requestSubResource": subresource,
            "name": str(meta.get("name", "")),
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": user, "groups": list(groups)},
            "object": None if deleting else obj,
            "oldObject": obj if deleting or operation == "UPDATE" else None,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.capitalize()}Options"},
        },
    }


def read_input(path: str) -> dict[str, Any]:
    import yaml

    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()  # noqa: SIM115
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not JSON or YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected an AdmissionReview or a Kubernetes object")  # noqa: TRY004
    return doc


# --- the inputs every decision uses ----------------------------------------------------------------


@dataclass(slots=True)
class Inputs:
    """The configuration, the registration and the namespace labels, as serve and the apiserver have
    them."""

    snapshot: Any
    registered: Any
    namespaces: Any


def load_inputs(
    config: str,
    *,
    allow_empty: bool,
    strict_https: bool,
    registration: str | None,
    unknown_namespace: str,
    fixed_namespaces: dict[str, dict[str, str]] | None = None,
    extra_namespaces: dict[str, dict[str, str]] | None = None,
) -> Inputs:
    """Load what ``serve`` loads (``load_config``: refused the same way) and the registration."""
    import msgspec

    from gateway.commands import whatif
    from gateway.commands.registration import read_registration, settings_of
    from gateway.config.load import load_config

    snapshot = load_config(config, allow_empty=allow_empty, strict_https=strict_https)
    if registration:
        docs = read_registration(registration)
        registered = whatif.Registered.load(docs, settings_of(docs), registration)
    else:
        registered = whatif.Registered.computed(snapshot)
    if fixed_namespaces is not None:
        namespaces = whatif.Namespaces(fixed=fixed_namespaces)
    else:
        known = {**snapshot.namespaces, **(extra_namespaces or {})}
        namespaces = whatif.Namespaces(
            snapshot=msgspec.structs.replace(snapshot, namespaces=known),
            unknown_namespace=unknown_namespace,  # type: ignore[arg-type]
        )
    return Inputs(snapshot, registered, namespaces)


# --- explaining ----------------------------------------------------------------------------------


def _requirement_text(r: Any) -> str:
    values = f" ({', '.join(sorted(r.values))})" if r.values else ""
    return f"{r.key} {r.operator}{values}"


def _first_failing(selector: Any, labels: dict[str, str] | None) -> str:
    for r in selector.requirements:
        if labels is None or not r.matches(labels):
            return _requirement_text(r)
    return "?"


def _gvr_text(attrs: Any) -> str:
    r = attrs.resource
    text = f"{r.group}/{r.version}/{r.resource}" if r.group else f"{r.version}/{r.resource}"
    return text + (f"/{attrs.sub_resource}" if attrs.sub_resource else "")


def _object_labels(attrs: Any) -> dict[str, str] | None:
    labels = attrs.object_labels()
    return None if labels is None else dict(labels)


def explain_one(hook: Any, decision: Any, attrs: Any, ns_labels: dict[str, str] | None) -> tuple[str, str]:
    """(decision, why) for one backend, from the gateway's own decision value."""
    from gateway.commands import whatif

    if isinstance(decision, whatif.Skip):
        if decision.reason == "rules":
            return "skip", f"no rule matches {attrs.operation} {_gvr_text(attrs)}"
        if decision.reason == "namespaceSelector":
            return "skip", f"namespaceSelector: {_first_failing(hook.namespace_selector, ns_labels)} is false"
        if decision.reason == "objectSelector":
            failing = _first_failing(hook.object_selector, _object_labels(attrs))
            return "skip", f"objectSelector: {failing} is false"
        false = decision.conditions.false_condition if decision.conditions else None
        return "skip", f"matchCondition {false!r} is false" if false else "matchConditions exclude it"
    if isinstance(decision, whatif.Refuse):
        return "refuse", f"answers the whole review: {decision.error.message}"
    if isinstance(decision, whatif.CallFailure):
        return "call fails", f"{decision.error.reason} (failurePolicy {hook.failure_policy} applies)"
    rule = whatif.matching_rule(hook, attrs)
    why = [
        f"rules[{rule}] matches {attrs.operation} {_gvr_text(attrs)}" if rule is not None else "rules match"
    ]
    if hook.namespace_selector.requirements:
        why.append("namespaceSelector matches" if ns_labels is not None else "namespace exempt from selector")
    if hook.object_selector.requirements:
        why.append("objectSelector matches")
    if hook.match_conditions:
        why.append(f"{len(hook.match_conditions)} matchCondition(s) true")
    return "call", "; ".join(why)


def _route_of(kind: str, hook: Any, routes: list[Any]) -> Any:
    """The registration webhook whose path runs ``hook`` (None: the apiserver never sends it there)."""
    for route in routes:
        if route.kind != kind:
            continue
        if route.half is None or route.half == hook.failure_policy.lower():
            return route
    return None


def _budget(route: Any, options: ExplainSettings) -> float:
    timeout = options.timeout if options.timeout is not None else route.timeout_seconds
    return float(timeout)


def namespace_of(namespace: str, options: ExplainSettings, inputs: Inputs) -> tuple[Any, str, Any]:
    """The namespace's labels as serve finds them (or ``NamespaceNotFound``), where they came from, and
    the label source the dispatcher uses."""
    from gateway.commands import whatif

    if options.namespace_labels is not None:
        labels = dict(options.namespace_labels)
        return labels, "--namespace-labels", whatif.Namespaces(fixed={namespace: labels})
    if not namespace:
        return {}, "cluster-scoped: no namespace", inputs.namespaces
    found = inputs.namespaces.lookup(namespace)
    if isinstance(found, whatif.NamespaceNotFound):
        source = (
            f"no Namespace {namespace!r} in {options.config}: serve answers namespaces "
            f'"{namespace}" not found (--unknown-namespace notFound)'
        )
    elif namespace in inputs.snapshot.namespaces:
        source = f"Namespace {namespace!r} in {options.config}"
    else:
        source = (
            f"no Namespace {namespace!r} in {options.config}: no labels (--unknown-namespace emptyLabels)"
        )
    return found, source, inputs.namespaces


def explain(review_doc: dict[str, Any], options: ExplainSettings, inputs: Inputs) -> dict[str, Any]:
    """The static part of the report: registration, namespace labels and one row per backend."""
    from gateway.commands import whatif

    snapshot = inputs.snapshot
    review = whatif.decode_review(json.dumps(review_doc).encode())
    attrs = review.attributes
    namespace = attrs.namespace
    found, source, _ = namespace_of(namespace, options, inputs)
    known = {} if isinstance(found, whatif.NamespaceNotFound) else dict(found)
    routes, skipped = inputs.registered.routes_for(review, known)
    dry_run = bool(review_doc["request"].get("dryRun"))
    rows: list[dict[str, Any]] = []
    budgets: dict[str, float] = {}
    for kind, hooks in (("mutating", snapshot.mutating), ("validating", snapshot.validating)):
        lookup = whatif.namespace_to_look_up(attrs, hooks)
        value = found if lookup is not None else None
        decisions = whatif.decide(hooks, review, value)
        spent: dict[Any, float] = {}
        order = 0
        for hook, decision in zip(hooks, decisions, strict=True):
            labels = None if value is None or isinstance(value, whatif.NamespaceNotFound) else value
            verdict, why = explain_one(hook, decision, attrs, labels)
            row: dict[str, Any] = {
                "kind": kind,
                "name": hook.name,
                "configuration": hook.configuration,
                "decision": verdict,
                "why": why,
                "failurePolicy": hook.failure_policy,
                "sideEffects": hook.side_effects,
                "timeoutSeconds": hook.timeout_seconds,
                "dryRun": "refused" if hook.side_effects in DRY_RUN_REFUSING else "allowed",
            }
            route = _route_of(kind, hook, routes)
            if route is None and verdict != "skip":
                row["decision"], row["why"] = (
                    "not sent",
                    f"{why}; but the apiserver never sends this review there",
                )
            elif route is not None:
                row["path"] = route.path
                budget = max(0.0, _budget(route, options) - options.deadline_margin)
                budgets[route.path] = round(budget, 3)
            if row["decision"] in ("call", "call fails") and route is not None:
                order += 1
                budget = budgets[route.path]
                if kind == "mutating":  # a serial chain: earlier calls may use up the budget (GW-05)
                    effective = min(float(hook.timeout_seconds), max(0.0, budget - spent.get(route, 0.0)))
                    spent[route] = spent.get(route, 0.0) + effective
                    row["order"] = str(order)
                else:  # a parallel fan-out: every call has the whole budget
                    effective = min(float(hook.timeout_seconds), budget)
                    row["order"] = "parallel"
                row["effectiveTimeoutSeconds"] = round(effective, 3)
                if dry_run and hook.side_effects in DRY_RUN_REFUSING:
                    row["decision"], row["why"] = (
                        "refuse",
                        f"{why}; sideEffects {hook.side_effects} refuses dry run",
                    )
            rows.append(row)
    return {
        "request": {
            "operation": attrs.operation,
            "resource": _gvr_text(attrs),
            "namespace": namespace,
            "name": attrs.name,
            "dryRun": dry_run,
        },
        "namespaceLabels": {"labels": known, "source": source},
        "registration": {
            "source": inputs.registered.source,
            "sentTo": [
                {
                    "name": r.name,
                    "path": r.path,
                    "timeoutSeconds": r.timeout_seconds,
                    "failurePolicy": r.failure_policy,
                }
                for r in routes
            ],
            "notSentBy": skipped,
            "notServed": inputs.registered.unknown_paths,  # webhooks whose path the gateway does not serve
        },
        "budgetSeconds": budgets,
        "backends": rows,
    }


async def decide(
    review_doc: dict[str, Any], options: ExplainSettings, inputs: Inputs, *, call: bool
) -> dict[str, Any]:
    """The gateway's answers on every path the apiserver sends the review to, through the Dispatcher
    ``serve`` runs: called for real (``call``: dryRun forced true, so backends whose sideEffects
    refuse dry runs are never called, FPT-09), or planned (backends assumed to allow)."""
    from gateway.commands import whatif

    doc = json.loads(json.dumps(review_doc))
    if call:
        doc["request"]["dryRun"] = True
    review = whatif.decode_review(json.dumps(doc).encode())
    found, _, namespaces = namespace_of(review.attributes.namespace, options, inputs)
    known = {} if isinstance(found, whatif.NamespaceNotFound) else dict(found)
    routes, skipped = inputs.registered.routes_for(review, known)
    result: dict[str, Any] = {"sent": bool(routes), "paths": {}}
    if not routes:
        result["verdict"] = {
            "outcome": "not sent",
            "allowed": True,
            "message": "the apiserver never sends this review to the gateway: " + "; ".join(skipped),
        }
        return result
    outcomes: list[str] = []
    denial: dict[str, Any] | None = None
    async with whatif.dispatcher(namespaces, call=call, backend_kubeconfig=options.backend_kubeconfig) as (
        engine,
        _,
    ):
        for kind in ("mutating", "validating"):
            for route in (r for r in routes if r.kind == kind):
                review = whatif.decode_review(json.dumps(doc).encode())
                verdict = await whatif.run_review(
                    engine,
                    review,
                    inputs.snapshot,
                    route=route,
                    budget=_budget(route, options),
                    margin=options.deadline_margin,
                )
                outcome = whatif.outcome_of(verdict)
                outcomes.append(outcome)
                patch = whatif.decode_patch(verdict.patch) if verdict.patch else None
                result["paths"][route.path] = {
                    "kind": kind,
                    "outcome": outcome,
                    "answers": [
                        {
                            "name": r.name,
                            "outcome": r.outcome,
                            "code": r.code,
                            "reason": r.reason,
                            "milliseconds": round(r.duration_seconds * 1000, 1),
                        }
                        for r in (verdict.report.invocations if verdict.report else [])
                    ],
                    "allowed": verdict.allowed,
                    "status": whatif.as_plain(verdict.status) if verdict.status else None,
                    "patch": patch,
                    "warnings": verdict.warnings,
                    "auditAnnotations": verdict.audit_annotations,
                }
                if not verdict.allowed and denial is None:
                    denial = result["paths"][route.path]["status"] or {}
                if patch and doc["request"].get("object") is not None:
                    doc["request"]["object"] = whatif.apply_patch(doc["request"]["object"], patch)
            if denial is not None:
                break  # the apiserver stops here: validating webhooks never see a refused request
    worst = "denied" if "denied" in outcomes else "error" if "error" in outcomes else "allowed"
    if denial is not None and worst == "allowed":
        worst = "denied"
    result["verdict"] = {
        "outcome": worst,
        "allowed": denial is None,
        "code": (denial or {}).get("code"),
        "message": (denial or {}).get("message", ""),
    }
    return result


def exit_code(outcome: str, fail_on: str) -> int:
    """1 for a denial, 3 for a backend error (when --fail-on counts them), else 0."""
    if outcome == "denied" and fail_on in ("any", "denial"):
        return EXIT_DENIED
    if outcome == "error" and fail_on in ("any", "error"):
        return EXIT_ERROR
    return 0


def render_table(report: dict[str, Any]) -> str:
    req = report["request"]
    ns = report["namespaceLabels"]
    where = f"{req['namespace']}/{req['name']}" if req["namespace"] else req["name"]
    lines = [
        f"{req['operation']} {req['resource']} {where}{'  (dry run)' if req['dryRun'] else ''}",
        f"namespace labels ({ns['source']}): {json.dumps(ns['labels'], sort_keys=True)}",
    ]
    reg = report["registration"]
    if reg["sentTo"]:
        sent = ", ".join(
            f"{r['path']} ({r['name']}, {r['failurePolicy']}, {r['timeoutSeconds']:g}s)"
            for r in reg["sentTo"]
        )
        lines.append(f"sent to: {sent}  (from {reg['source']})")
    else:
        lines.append(f"NOT SENT: the apiserver never sends this review to the gateway ({reg['source']}):")
        lines.extend(f"  {why}" for why in reg["notSentBy"])
    for unknown in reg["notServed"]:
        lines.append(
            f"warning: the registration sends reviews to a path the gateway does not serve: {unknown}"
        )
    budgets = ", ".join(f"{path} {b:g}s" for path, b in report["budgetSeconds"].items())
    if budgets:
        lines.append(f"budget: {budgets} (the apiserver's timeout minus the gateway's margin)")
    lines.append("")
    header = ("KIND", "ORDER", "BACKEND", "DECISION", "TIMEOUT", "DRY RUN", "WHY")
    table = [header]
    for b in report["backends"]:
        timeout = (
            f"{b['effectiveTimeoutSeconds']:g}/{b['timeoutSeconds']}s"
            if "effectiveTimeoutSeconds" in b
            else f"{b['timeoutSeconds']}s"
        )
        table.append(
            (b["kind"], b.get("order", "-"), b["name"], b["decision"], timeout, b["dryRun"], b["why"])
        )
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header) - 1)]
    for row in table:
        lines.append(
            "  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        )
    called = report.get("call")
    for path, outcome in (called or report.get("plan", {})).get("paths", {}).items():
        if called is None:
            continue
        lines.append("")
        lines.append(f"{outcome['kind']} call to {path} (dryRun: true):")
        for a in outcome["answers"]:
            reason = f"  {a['reason']}" if a["reason"] else ""
            lines.append(f"  {a['name']}: {a['outcome']} {a['code']} ({a['milliseconds']} ms){reason}")
        status = outcome["status"] or {}
        verdict = (
            "ALLOWED"
            if outcome["allowed"]
            else f"DENIED {status.get('code', '')}: {status.get('message', '')}"
        )
        lines.append(f"  combined reply: {verdict}")
        if outcome["patch"]:
            lines.append(f"  combined patch: {json.dumps(outcome['patch'])}")
        lines.extend(f"  warning: {w}" for w in outcome["warnings"])
        lines.extend(f"  audit annotation {k} = {v}" for k, v in sorted(outcome["auditAnnotations"].items()))
    verdict = report["verdict"]
    lines.append("")
    what = "with the backends' answers" if called is not None else "if every called backend allows"
    if verdict["outcome"] == "not sent":
        lines.append("verdict: not sent (the apiserver admits it without asking the gateway)")
    elif verdict["allowed"]:
        lines.append(f"verdict: {verdict['outcome'].upper()} ({what})")
    else:
        lines.append(f"verdict: DENIED {verdict.get('code') or ''} ({what}): {verdict['message']}")
    return "\n".join(lines)


def run(options: ExplainSettings) -> int:
    import trio

    from gateway.errors import BadReview, ConfigError, GatewayError

    if not options.config:
        return fail(NO_CONFIG, EXIT_USAGE)
    try:
        inputs = load_inputs(
            options.config,
            allow_empty=options.allow_empty_config,
            strict_https=options.strict_https,
            registration=options.registration,
            unknown_namespace=options.unknown_namespace,
        )
        doc = read_input(options.input)
        review_doc = (
            doc
            if doc.get("kind") == "AdmissionReview"
            else review_for(
                doc,
                operation=options.operation,
                namespace=options.namespace,
                resource=options.resource,
                subresource=options.subresource,
                user=options.user,
                groups=options.groups,
            )
        )
        if options.dry_run:
            review_doc["request"]["dryRun"] = True
        report = explain(review_doc, options, inputs)
        decided = trio.run(lambda: decide(review_doc, options, inputs, call=options.call))
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{problem.severity}: {problem}", file=sys.stderr)
        return fail(f"{options.config}: configuration refused", EXIT_USAGE)
    except BadReview as exc:
        return fail(f"{options.input}: {exc}", EXIT_USAGE)
    except (OSError, ValueError, GatewayError) as exc:
        return fail(str(exc), EXIT_USAGE)
    report["call" if options.call else "plan"] = decided
    report["verdict"] = decided["verdict"]
    if options.output == "json":
        print(json.dumps(report, indent=2))
    else:
        print(render_table(report))
    return exit_code(report["verdict"]["outcome"], options.fail_on)
