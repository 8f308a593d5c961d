"""``webhook-gateway explain``: which backends a review would reach, why, in which order, with which
timeout — and with ``--call``, what they answer (as a dry run).

The input is an AdmissionReview (JSON or YAML), or a plain object with ``--operation``,
``--namespace-labels`` and ``--user`` filling in what the apiserver would. The decisions come from the
gateway's own matching (``gateway.commands.whatif``), never from a re-implementation.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.commands.options import Parser, add_option, fail

SUMMARY = "show which backends a review would reach and why; --call sends it as a dry run"

DRY_RUN_REFUSING = ("Unknown", "Some")  # FPT-09


@dataclass(frozen=True, slots=True)
class ExplainSettings:
    input: str
    config: str = "config/webhooks"
    operation: str = "CREATE"
    namespace: str | None = None
    namespace_labels: dict[str, str] | None = None
    user: str = "admin"
    groups: tuple[str, ...] = ("system:authenticated",)
    resource: str | None = None
    subresource: str = ""
    dry_run: bool = False
    timeout: float = 10.0
    deadline_margin: float = 0.2
    call: bool = False
    backend_kubeconfig: str | None = None
    output: str = "table"
    extra: dict[str, Any] = field(default_factory=dict)


def _labels(text: str) -> dict[str, str]:
    labels = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {part!r}")
        labels[key] = value
    return labels


def build_parser(prog: str) -> Parser:
    p = Parser(
        prog=prog,
        description="Explain what the gateway would do with a review: per backend, matched or not and "
        "why, the order of calls, each effective timeout, and which backends a dry run refuses.",
    )
    p.add_argument(
        "input", metavar="REVIEW", help="AdmissionReview or object file (JSON or YAML), or - for stdin"
    )
    p.add_option("--config", help="configuration directory", default="config/webhooks")
    p.add_option(
        "--operation",
        help="for a plain object: the request's operation",
        choices=("CREATE", "UPDATE", "DELETE", "CONNECT"),
        default="CREATE",
    )
    p.add_option("--namespace", help="for a plain object: its namespace", shown_default="metadata.namespace")
    add_option(
        p,
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
    p.add_option("--timeout", type=float, default=10.0, help="the caller's budget in seconds (?timeout=)")
    p.add_option(
        "--call", action="store_true", help="send the review (dryRun forced true) and show the answers"
    )
    p.add_option("--backend-kubeconfig", help="with --call: per-host backend credentials")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    return p


def settings(options: argparse.Namespace) -> ExplainSettings:
    return ExplainSettings(
        input=options.input,
        config=options.config,
        operation=options.operation,
        namespace=options.namespace,
        namespace_labels=options.namespace_labels,
        user=options.user,
        groups=tuple(g for g in options.groups.split(",") if g),
        resource=options.resource,
        subresource=options.subresource,
        dry_run=options.dry_run,
        timeout=options.timeout,
        call=options.call,
        backend_kubeconfig=options.backend_kubeconfig,
        output=options.output,
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


def review_for(obj: dict[str, Any], options: ExplainSettings) -> dict[str, Any]:
    """An AdmissionReview as kube-apiserver would send it for ``obj``."""
    api_version = str(obj.get("apiVersion", ""))
    group, _, version = api_version.rpartition("/")
    kind = str(obj.get("kind", ""))
    meta = obj.get("metadata") or {}
    namespace = options.namespace if options.namespace is not None else str(meta.get("namespace", ""))
    deleting = options.operation == "DELETE"
    gvr = {"group": group, "version": version, "resource": options.resource or plural(kind)}
    gvk = {"group": group, "version": version, "kind": kind}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": gvk,
            "resource": gvr,
            "subResource": options.subresource,
            "requestKind": gvk,
            "requestResource": gvr,
            "requestSubResource": options.subresource,
            "name": str(meta.get("name", "")),
            "namespace": namespace,
            "operation": options.operation,
            "userInfo": {"username": options.user, "groups": list(options.groups)},
            "object": None if deleting else obj,
            "oldObject": obj if deleting or options.operation == "UPDATE" else None,
            "dryRun": options.dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{options.operation.capitalize()}Options"},
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


def explain(review_doc: dict[str, Any], options: ExplainSettings) -> dict[str, Any]:
    from gateway.commands import whatif
    from gateway.config.load import load_directory

    snapshot = load_directory(options.config)
    review = whatif.decode_review(json.dumps(review_doc).encode())
    attrs = review.attributes
    namespace = attrs.namespace
    if options.namespace_labels is not None:
        ns_labels, source = dict(options.namespace_labels), "--namespace-labels"
    elif namespace in snapshot.namespaces:
        ns_labels, source = (
            dict(snapshot.namespaces[namespace]),
            f"Namespace {namespace!r} in {options.config}",
        )
    else:
        ns_labels, source = {"kubernetes.io/metadata.name": namespace}, "assumed (only the name label)"
    budget = max(0.0, options.timeout - options.deadline_margin)
    dry_run = bool(review_doc["request"].get("dryRun"))
    rows: list[dict[str, Any]] = []
    for kind, hooks in (("mutating", snapshot.mutating), ("validating", snapshot.validating)):
        lookup = whatif.namespace_to_look_up(attrs, hooks)
        decisions = whatif.decide(hooks, review, ns_labels if lookup is not None else None)
        spent, order = 0.0, 0
        for hook, decision in zip(hooks, decisions, strict=True):
            verdict, why = explain_one(hook, decision, attrs, ns_labels if lookup is not None else None)
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
            if verdict in ("call", "call fails"):
                order += 1
                if kind == "mutating":  # a serial chain: earlier calls may use up the budget (GW-05)
                    effective = min(float(hook.timeout_seconds), max(0.0, budget - spent))
                    spent += effective
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
        "namespaceLabels": {"labels": ns_labels, "source": source},
        "budgetSeconds": round(budget, 3),
        "backends": rows,
    }


async def call(
    review_doc: dict[str, Any], options: ExplainSettings, ns_labels: dict[str, str]
) -> dict[str, Any]:
    """Send the review through the gateway's own dispatcher, dryRun forced true (FPT-09 keeps
    backends whose sideEffects are Unknown or Some from being called)."""
    import trio

    from gateway.commands import whatif
    from gateway.config.load import load_directory

    snapshot = load_directory(options.config)
    doc = json.loads(json.dumps(review_doc))
    doc["request"]["dryRun"] = True
    result: dict[str, Any] = {}
    namespace = doc["request"].get("namespace", "")
    async with whatif.dispatcher(
        {namespace: ns_labels}, backend_kubeconfig=options.backend_kubeconfig
    ) as engine:
        for kind in ("mutating", "validating"):
            review = whatif.decode_review(json.dumps(doc).encode())
            deadline = trio.current_time() + max(0.0, options.timeout - options.deadline_margin)
            verdict = await whatif.run_review(engine, review, snapshot, kind=kind, deadline=deadline)
            answers = [
                {
                    "name": r.name,
                    "outcome": r.outcome,
                    "code": r.code,
                    "reason": r.reason,
                    "milliseconds": round(r.duration_seconds * 1000, 1),
                }
                for r in (verdict.report.invocations if verdict.report else [])
            ]
            patch = whatif.decode_patch(verdict.patch) if verdict.patch else None
            result[kind] = {
                "answers": answers,
                "allowed": verdict.allowed,
                "status": whatif.as_plain(verdict.status) if verdict.status else None,
                "patch": patch,
                "warnings": verdict.warnings,
                "auditAnnotations": verdict.audit_annotations,
            }
            if not verdict.allowed:
                break  # the apiserver stops here: validating webhooks never see a refused request
            if patch and doc["request"].get("object") is not None:
                doc["request"]["object"] = whatif.apply_patch(doc["request"]["object"], patch)
    return result


def render_table(report: dict[str, Any]) -> str:
    req = report["request"]
    ns = report["namespaceLabels"]
    where = f"{req['namespace']}/{req['name']}" if req["namespace"] else req["name"]
    lines = [
        f"{req['operation']} {req['resource']} {where}{'  (dry run)' if req['dryRun'] else ''}",
        f"namespace labels ({ns['source']}): {json.dumps(ns['labels'], sort_keys=True)}",
        f"budget: {report['budgetSeconds']}s (the caller's timeout minus the gateway's margin)",
        "",
    ]
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
    for kind, outcome in report.get("call", {}).items():
        lines.append("")
        lines.append(f"{kind} call (dryRun: true):")
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
    return "\n".join(lines)


def run(options: ExplainSettings) -> int:
    import trio

    from gateway.errors import BadReview, ConfigError, GatewayError

    try:
        doc = read_input(options.input)
        review_doc = doc if doc.get("kind") == "AdmissionReview" else review_for(doc, options)
        if options.dry_run:
            review_doc["request"]["dryRun"] = True
        report = explain(review_doc, options)
        if options.call:
            report["call"] = trio.run(call, review_doc, options, report["namespaceLabels"]["labels"])
    except ConfigError as exc:
        return fail(f"{options.config}: configuration refused: {exc}".splitlines()[0])
    except BadReview as exc:
        return fail(f"{options.input}: {exc}")
    except (OSError, ValueError, GatewayError) as exc:
        return fail(str(exc))
    if options.output == "json":
        print(json.dumps(report, indent=2))
    else:
        print(render_table(report))
    return 0
