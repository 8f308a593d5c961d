"""``webhook-gateway audit``: what would the validating backends say about what already runs?

Lists objects from a cluster (read-only: GET requests only, page by page, through
``gateway.sources.kube``) or reads them from YAML files, and decides each as ``serve`` would if the
apiserver sent it as a dry-run review (``dryRun: true``): the gateway's registration says whether the
apiserver sends it at all and on which path, then the Dispatcher ``serve`` runs calls the validating
backends that match it and allow dry runs (sideEffects None or NoneOnDryRun), within the budget the
registration gives (``gateway.commands.whatif``). It reports every backend's result per object —
``pass``, ``fail`` (a denial), ``error`` (a backend that could not be called or answered wrongly),
``skip`` (the registration never sends the object's review) — as a table, JSON, or PolicyReports
(``wgpolicyk8s.io/v1alpha2``: one per namespace, a ClusterPolicyReport for cluster-scoped objects).

Exit 1 when an object would be denied, 3 when a backend failed (``--fail-on`` chooses), 2 when the
audit cannot run. Bounded concurrency; a progress line on stderr; with ``--state FILE`` every
finished object is appended to FILE at once, and a second run with the same FILE skips them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.commands.explain import EXIT_USAGE, add_decision_options, exit_code
from gateway.commands.options import NO_CONFIG, Parser, fail

SUMMARY = "dry-run existing objects (cluster or files) against the validating backends; report the results"

# resource → (group, version, kind, namespaced); any other resource as GROUP/VERSION/RESOURCE
BUILTIN_RESOURCES: dict[str, tuple[str, str, str, bool]] = {
    "pods": ("", "v1", "Pod", True),
    "services": ("", "v1", "Service", True),
    "configmaps": ("", "v1", "ConfigMap", True),
    "serviceaccounts": ("", "v1", "ServiceAccount", True),
    "persistentvolumeclaims": ("", "v1", "PersistentVolumeClaim", True),
    "namespaces": ("", "v1", "Namespace", False),
    "deployments": ("apps", "v1", "Deployment", True),
    "statefulsets": ("apps", "v1", "StatefulSet", True),
    "daemonsets": ("apps", "v1", "DaemonSet", True),
    "replicasets": ("apps", "v1", "ReplicaSet", True),
    "jobs": ("batch", "v1", "Job", True),
    "cronjobs": ("batch", "v1", "CronJob", True),
    "ingresses": ("networking.k8s.io", "v1", "Ingress", True),
    "networkpolicies": ("networking.k8s.io", "v1", "NetworkPolicy", True),
}
ALLOWS_DRY_RUN = ("None", "NoneOnDryRun")
SOURCE = "webhook-gateway"


@dataclass(frozen=True, slots=True)
class AuditSettings:
    config: str = ""
    allow_empty_config: bool = False
    strict_https: bool = False
    unknown_namespace: str = "notFound"
    registration: str | None = None
    deadline_margin: float = 0.2
    fail_on: str = "any"
    kubeconfig: str | None = None
    files: tuple[str, ...] = ()
    namespace: str | None = None
    resources: tuple[str, ...] = ("pods",)
    operation: str = "CREATE"
    concurrency: int = 8
    timeout: float | None = None  # None: the registration's timeoutSeconds
    chunk_size: int = 500
    output: str = "table"
    state: str | None = None
    progress: str = "auto"
    backend_kubeconfig: str | None = None


def build_parser(prog: str) -> Parser:
    p = Parser(
        prog=prog,
        description="Decide existing objects as the gateway would if the apiserver sent them as dry-run "
        "reviews: the validating backends that match them and allow dry runs are called; every result "
        "is reported (pass, fail, error, skip). Never writes to the cluster.",
    )
    p.add_argument(
        "files", nargs="*", metavar="FILE", help="read objects from YAML/JSON files instead of a cluster"
    )
    add_decision_options(p)
    p.add_option("--kubeconfig", help="list objects (and namespaces) from this cluster (read-only)")
    p.add_option("--namespace", help="only this namespace", shown_default="all namespaces")
    p.add_option(
        "--resource",
        help="comma-separated resources: " + ", ".join(BUILTIN_RESOURCES) + ", or GROUP/VERSION/RESOURCE",
        default="pods",
    )
    p.add_option(
        "--operation", choices=("CREATE", "UPDATE"), default="CREATE", help="review operation to send"
    )
    p.add_option("--concurrency", type=int, default=8, help="reviews in flight at once")
    p.add_option(
        "--timeout",
        type=float,
        help="budget per review (seconds)",
        shown_default="the registration's timeoutSeconds, as the apiserver sends it",
    )
    p.add_option("--chunk-size", type=int, default=500, help="objects per list request (pages)")
    p.add_option("--state", help="resume file: finished objects are appended; a rerun skips them")
    p.add_option(
        "--progress", choices=("auto", "always", "never"), default="auto", help="progress line on stderr"
    )
    p.add_argument(
        "-o", "--output", choices=("table", "json", "policyreport"), default="table", help="report format"
    )
    return p


def settings(options: argparse.Namespace) -> AuditSettings:
    return AuditSettings(
        config=options.config or "",
        allow_empty_config=options.allow_empty_config,
        strict_https=options.strict_https,
        unknown_namespace=options.unknown_namespace,
        registration=options.registration,
        deadline_margin=options.deadline_margin,
        fail_on=options.fail_on,
        kubeconfig=options.kubeconfig,
        files=tuple(options.files),
        namespace=options.namespace,
        resources=tuple(r.strip() for r in options.resource.split(",") if r.strip()),
        operation=options.operation,
        concurrency=max(1, options.concurrency),
        timeout=options.timeout,
        chunk_size=max(1, options.chunk_size),
        output=options.output,
        state=options.state,
        progress=options.progress,
        backend_kubeconfig=options.backend_kubeconfig,
    )


# --- objects -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Inventory:
    objects: list[dict[str, Any]] = field(default_factory=list)  # each with apiVersion and kind
    resources: list[str] = field(default_factory=list)  # the resource (plural) of each object
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)
    listed_namespaces: bool = False  # from a cluster: every namespace that exists is known


def _resource(spec: str) -> tuple[str, str, str, str, bool]:
    """(group, version, resource, kind or "", namespaced)."""
    if spec in BUILTIN_RESOURCES:
        group, version, kind, namespaced = BUILTIN_RESOURCES[spec]
        return group, version, spec, kind, namespaced
    parts = spec.split("/")
    if len(parts) == 3 and all(parts[1:]):
        return parts[0], parts[1], parts[2], "", True
    if len(parts) == 2 and all(parts):  # core: v1/resource
        return "", parts[0], parts[1], "", True
    raise ValueError(
        f"--resource {spec!r}: not one of {', '.join(BUILTIN_RESOURCES)} nor GROUP/VERSION/RESOURCE"
    )


async def list_all(client: Any, path: str, *, chunk_size: int) -> tuple[str, str, list[dict[str, Any]]]:
    """Every item of a list, page by page (``limit`` and ``continue``): (apiVersion, item kind, items)."""
    items: list[dict[str, Any]] = []
    query: dict[str, str] = {"limit": str(chunk_size)}
    api_version, kind = "v1", ""
    while True:
        body = json.loads(await client.get(path, query))
        api_version = body.get("apiVersion", api_version)
        kind = str(body.get("kind", "")).removesuffix("List")
        items.extend(body.get("items") or [])
        token = (body.get("metadata") or {}).get("continue")
        if not token:
            return api_version, kind, items
        query = {"limit": str(chunk_size), "continue": token}


async def from_cluster(options: AuditSettings) -> Inventory:
    from gateway.sources.kube import KubeClient, load_kubeconfig

    assert options.kubeconfig is not None
    client = KubeClient(load_kubeconfig(Path(options.kubeconfig)))
    inventory = Inventory(listed_namespaces=True)
    _, _, namespaces = await list_all(client, "/api/v1/namespaces", chunk_size=options.chunk_size)
    for ns in namespaces:
        meta = ns.get("metadata") or {}
        inventory.namespaces[str(meta.get("name", ""))] = dict(meta.get("labels") or {})
    for spec in options.resources:
        group, version, resource, kind, namespaced = _resource(spec)
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        scoped = f"/namespaces/{options.namespace}" if options.namespace and namespaced else ""
        api_version, list_kind, items = await list_all(
            client, f"{prefix}{scoped}/{resource}", chunk_size=options.chunk_size
        )
        for item in items:
            inventory.objects.append({"apiVersion": api_version, "kind": kind or list_kind, **item})
            inventory.resources.append(resource)
    return inventory


def from_files(options: AuditSettings) -> Inventory:
    """Objects from files (Lists unwrapped); their Namespace objects label namespaces, as the
    configuration's do."""
    import yaml

    from gateway.commands.explain import plural

    inventory = Inventory()
    for name in options.files:
        with open(name, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if isinstance(d, dict)]
        for doc in _unwrap(docs):
            if doc.get("kind") == "Namespace" and doc.get("apiVersion") == "v1":
                meta = doc.get("metadata") or {}
                inventory.namespaces[str(meta.get("name", ""))] = dict(meta.get("labels") or {})
            ns = (doc.get("metadata") or {}).get("namespace")
            if options.namespace and ns not in (None, options.namespace):
                continue
            inventory.objects.append(doc)
            inventory.resources.append(plural(str(doc.get("kind", ""))))
    return inventory


def _unwrap(docs: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    for doc in docs:
        if str(doc.get("kind", "")).endswith("List") and isinstance(doc.get("items"), list):
            yield from _unwrap(i for i in doc["items"] if isinstance(i, dict))
        else:
            yield doc


# --- auditing ------------------------------------------------------------------------------------


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    version = meta.get("resourceVersion") or meta.get("uid") or ""
    return f"{obj.get('apiVersion')}/{obj.get('kind')}/{where}{meta.get('name', '')}@{version}"


def _object_ref(obj: Mapping[str, Any]) -> dict[str, str]:
    meta = obj.get("metadata") or {}
    ref = {"apiVersion": str(obj.get("apiVersion", "")), "kind": str(obj.get("kind", ""))}
    ref["name"] = str(meta.get("name", ""))
    if meta.get("namespace"):
        ref["namespace"] = str(meta["namespace"])
    if meta.get("uid"):
        ref["uid"] = str(meta["uid"])
    return ref


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.denied, self.enabled = total, 0, 0, enabled

    def step(self, denied: bool) -> None:
        self.done += 1
        self.denied += denied
        if self.enabled:
            width = 30
            filled = width * self.done // max(1, self.total)
            bar = "#" * filled + "." * (width - filled)
            print(
                f"\raudit [{bar}] {self.done}/{self.total} objects, {self.denied} denied",
                end="",
                file=sys.stderr,
            )

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


_RESULT_OF = {"allowed": "pass", "rejected": "fail", "failed_closed": "error", "failed_open": "error"}


def _result(record: Any) -> str:
    if record.outcome == "internal_error" and not record.backend_uid:
        return "fail"  # refused before any call (the gateway's own denial)
    return _RESULT_OF.get(record.outcome, "error")


def results_of(verdict: Any) -> list[dict[str, str]]:
    """One result per backend invocation (pass, fail, error); a review the gateway refused before
    any backend answered (e.g. a namespace that does not exist) is a ``fail`` of the backend that
    needed it."""
    results = [
        {"policy": r.name, "result": _result(r), "message": r.reason}
        for r in (verdict.report.invocations if verdict.report else [])
        if r.outcome != "cancelled"
    ]
    if not verdict.allowed and not any(r["result"] in ("fail", "error") for r in results):
        denied_by = (verdict.report.denied_by if verdict.report else "") or SOURCE
        results.append({"policy": denied_by, "result": "fail", "message": verdict.status.message})
    return results


async def audit(options: AuditSettings) -> dict[str, Any]:
    import msgspec
    import trio

    from gateway.commands import whatif
    from gateway.commands.explain import load_inputs, review_for

    inventory = await from_cluster(options) if options.kubeconfig else from_files(options)
    inputs = load_inputs(
        options.config,
        allow_empty=options.allow_empty_config,
        strict_https=options.strict_https,
        registration=options.registration,
        unknown_namespace=options.unknown_namespace,
        fixed_namespaces=inventory.namespaces if inventory.listed_namespaces else None,
        extra_namespaces=inventory.namespaces,
    )
    snapshot = inputs.snapshot
    eligible = tuple(h for h in snapshot.validating if h.side_effects in ALLOWS_DRY_RUN)
    audited_snapshot = msgspec.structs.replace(snapshot, validating=eligible, mutating=())

    done: dict[str, dict[str, Any]] = {}
    state_path = Path(options.state) if options.state else None
    if state_path is not None and state_path.exists():
        for line in state_path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                if "results" in entry:  # older state files are audited again
                    done[entry["key"]] = entry
    resumed = sum(1 for obj in inventory.objects if object_key(obj) in done)
    todo = [
        (o, r)
        for o, r in zip(inventory.objects, inventory.resources, strict=True)
        if object_key(o) not in done
    ]
    show = options.progress == "always" or (options.progress == "auto" and sys.stderr.isatty())
    progress = Progress(len(todo), show)
    limiter = trio.CapacityLimiter(options.concurrency)
    state = state_path.open("a", encoding="utf-8") if state_path is not None else None

    async def one(engine: Any, obj: dict[str, Any], resource: str) -> None:
        async with limiter:
            meta = obj.get("metadata") or {}
            doc = review_for(
                obj,
                operation=options.operation,
                resource=resource,
                dry_run=True,
                namespace=str(meta.get("namespace", "")),
            )
            review = whatif.decode_review(json.dumps(doc).encode())
            namespace = review.attributes.namespace
            found = inputs.namespaces.lookup(namespace) if namespace else {}
            known = {} if isinstance(found, whatif.NamespaceNotFound) else dict(found)
            routes, skipped = inputs.registered.routes_for(review, known)
            routes = [r for r in routes if r.kind == "validating"]
            results: list[dict[str, str]] = []
            outcomes: list[str] = []
            allowed = True
            for route in routes:
                budget = options.timeout if options.timeout is not None else route.timeout_seconds
                verdict = await whatif.run_review(
                    engine,
                    review,
                    audited_snapshot,
                    route=route,
                    budget=budget,
                    margin=options.deadline_margin,
                )
                outcomes.append(whatif.outcome_of(verdict))
                allowed = allowed and verdict.allowed
                results += results_of(verdict)
            if not routes:  # the apiserver never sends it: a skip for each backend whose rules match
                why = "the apiserver never sends this review to the gateway: " + "; ".join(skipped)
                for hook in eligible:
                    if whatif.matching_rule(hook, review.attributes) is not None:
                        results.append({"policy": hook.name, "result": "skip", "message": why})
            outcome = "denied" if "denied" in outcomes else "error" if "error" in outcomes else "allowed"
            entry: dict[str, Any] = {
                "key": object_key(obj),
                "object": _object_ref(obj),
                "sent": bool(routes),
                "outcome": outcome if routes else "not sent",
                "allowed": allowed,  # what the apiserver would do with the request
                "results": results,
                "timestamp": int(time.time()),
            }
            done[entry["key"]] = entry
            if state is not None:
                state.write(json.dumps(entry) + "\n")
                state.flush()
            progress.step(outcome == "denied")

    try:
        async with (
            whatif.dispatcher(
                inputs.namespaces, call=True, backend_kubeconfig=options.backend_kubeconfig
            ) as (
                engine,
                _,
            ),
            trio.open_nursery() as nursery,
        ):
            for obj, resource in todo:
                nursery.start_soon(one, engine, obj, resource)
    finally:
        progress.close()
        if state is not None:
            state.close()

    entries = [done[object_key(o)] for o in inventory.objects if object_key(o) in done]
    by_backend: dict[str, list[dict[str, Any]]] = {h.name: [] for h in eligible}
    errors: list[dict[str, Any]] = []
    summary = dict.fromkeys(("pass", "fail", "warn", "error", "skip"), 0)
    for entry in entries:
        for r in entry["results"]:
            summary[r["result"]] += 1
            if r["result"] == "fail":
                by_backend.setdefault(r["policy"], []).append(
                    {"object": entry["object"], "message": r["message"]}
                )
            elif r["result"] == "error":
                errors.append({"object": entry["object"], "backend": r["policy"], "message": r["message"]})
    outcomes = [e["outcome"] for e in entries]
    return {
        "audited": len(inventory.objects),
        "resumed": resumed,
        "outcome": "denied" if "denied" in outcomes else "error" if "error" in outcomes else "allowed",
        "summary": summary,
        "backends": {
            "audited": [h.name for h in eligible],
            "skipped (sideEffects refuse dry run)": [
                h.name for h in snapshot.validating if h not in eligible
            ],
        },
        "denials": {name: found for name, found in by_backend.items() if found},
        "errors": errors,
        "notSent": [e["object"] for e in entries if not e["sent"]],
        "objects": entries,
    }


# --- reports -------------------------------------------------------------------------------------


def _ref_text(ref: Mapping[str, str]) -> str:
    where = f"{ref['namespace']}/" if ref.get("namespace") else ""
    return f"{ref['kind']} {where}{ref['name']}"


def render_table(report: dict[str, Any]) -> str:
    lines = []
    for backend, found in report["denials"].items():
        lines.append(f"{backend}: would deny {len(found)} object(s)")
        lines.extend(f"  {_ref_text(d['object'])}: {d['message']}" for d in found)
    for e in report["errors"]:
        lines.append(f"error: {e['backend']}: {_ref_text(e['object'])}: {e['message']}")
    if report["notSent"]:
        lines.append(
            "not sent (the registration never sends their reviews): "
            + ", ".join(_ref_text(ref) for ref in report["notSent"])
        )
    s = report["summary"]
    skipped = report["backends"]["skipped (sideEffects refuse dry run)"]
    lines.append(
        f"audited {report['audited']} object(s) ({report['resumed']} from the state file) against "
        f"{len(report['backends']['audited'])} validating backend(s): {s['pass']} pass, {s['fail']} fail, "
        f"{s['error']} error, {s['skip']} skip"
        + (f"; not dry-run safe, skipped: {', '.join(skipped)}" if skipped else "")
    )
    return "\n".join(lines)


def policy_reports(report: dict[str, Any]) -> list[dict[str, Any]]:
    """PolicyReports (wgpolicyk8s.io/v1alpha2): one per namespace, a ClusterPolicyReport for
    cluster-scoped objects; a result per object and backend (the backend is the ``policy``)."""
    by_namespace: dict[str, list[dict[str, Any]]] = {}
    for entry in report["objects"]:
        ns = entry["object"].get("namespace", "")
        for r in entry["results"]:
            result: dict[str, Any] = {
                "source": SOURCE,
                "policy": r["policy"],
                "result": r["result"],
                "scored": True,
                "resources": [dict(entry["object"])],  # a copy each: YAML without anchors
                "timestamp": {"seconds": int(entry.get("timestamp", 0)), "nanos": 0},
            }
            if r["message"]:
                result["message"] = r["message"]
            by_namespace.setdefault(ns, []).append(result)
    docs = []
    for ns, results in sorted(by_namespace.items()):
        meta: dict[str, Any] = {
            "name": "webhook-gateway-audit",
            "labels": {"app.kubernetes.io/managed-by": SOURCE},
        }
        if ns:
            meta["namespace"] = ns
        summary = dict.fromkeys(("pass", "fail", "warn", "error", "skip"), 0)
        for r in results:
            summary[r["result"]] += 1
        docs.append(
            {
                "apiVersion": "wgpolicyk8s.io/v1alpha2",
                "kind": "PolicyReport" if ns else "ClusterPolicyReport",
                "metadata": meta,
                "summary": summary,
                "results": results,
            }
        )
    return docs


def run(options: AuditSettings) -> int:
    import trio
    import yaml

    from gateway.errors import ConfigError, GatewayError

    if not options.config:
        return fail(NO_CONFIG, EXIT_USAGE)
    if not options.kubeconfig and not options.files:
        return fail("audit needs --kubeconfig FILE or object FILEs", EXIT_USAGE)
    try:
        for spec in options.resources:
            _resource(spec)
        report = trio.run(audit, options)
    except KeyboardInterrupt:
        hint = f"; run again with --state {options.state} to resume" if options.state else ""
        return fail(f"interrupted{hint}", 130)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{problem.severity}: {problem}", file=sys.stderr)
        return fail(f"{options.config}: configuration refused", EXIT_USAGE)
    except (OSError, ValueError, GatewayError) as exc:
        return fail(str(exc), EXIT_USAGE)
    if options.output == "json":
        print(json.dumps(report, indent=2))
    elif options.output == "policyreport":
        print(yaml.safe_dump_all(policy_reports(report), sort_keys=False), end="")
    else:
        print(render_table(report))
    return exit_code(report["outcome"], options.fail_on)
