"""``webhook-gateway audit``: what would the validating backends say about what already runs?

Lists objects from a cluster (read-only: GET requests only, through ``gateway.sources.kube``) or reads
them from YAML files, sends each as a dry-run review (``dryRun: true``) through the gateway's own
dispatcher to the validating backends that match it and allow dry runs (sideEffects None or
NoneOnDryRun), and reports the objects they would deny, grouped by backend: a table, JSON, or
PolicyReport-shaped YAML (``wgpolicyk8s.io/v1alpha2``, one report per namespace).

Bounded concurrency; a progress line on stderr; with ``--state FILE`` every finished object is
appended to FILE at once, and a second run with the same FILE skips them (resume after an interruption).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.commands.options import Parser, add_option, fail

SUMMARY = "dry-run existing objects (cluster or files) against the validating backends; report denials"

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
PAGE_SIZE = 500
ALLOWS_DRY_RUN = ("None", "NoneOnDryRun")


@dataclass(frozen=True, slots=True)
class AuditSettings:
    config: str = "config/webhooks"
    kubeconfig: str | None = None
    files: tuple[str, ...] = ()
    namespace: str | None = None
    resources: tuple[str, ...] = ("pods",)
    operation: str = "CREATE"
    concurrency: int = 8
    timeout: float = 10.0
    output: str = "table"
    state: str | None = None
    progress: str = "auto"
    backend_kubeconfig: str | None = None


def build_parser(prog: str) -> Parser:
    p = Parser(
        prog=prog,
        description="Send existing objects as dry-run reviews to the validating backends that match them "
        "and allow dry runs; report what they would deny. Never writes to the cluster.",
    )
    p.add_argument(
        "files", nargs="*", metavar="FILE", help="read objects from YAML/JSON files instead of a cluster"
    )
    p.add_option("--config", help="configuration directory", default="config/webhooks")
    p.add_option("--kubeconfig", help="list objects from this cluster (read-only)")
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
    p.add_option("--timeout", type=float, default=10.0, help="budget per review (seconds)")
    p.add_option("--state", help="resume file: finished objects are appended; a rerun skips them")
    add_option(
        p, "--progress", choices=("auto", "always", "never"), default="auto", help="progress line on stderr"
    )
    p.add_option("--backend-kubeconfig", help="per-host backend credentials")
    p.add_argument(
        "-o", "--output", choices=("table", "json", "policyreport"), default="table", help="report format"
    )
    return p


def settings(options: argparse.Namespace) -> AuditSettings:
    return AuditSettings(
        config=options.config,
        kubeconfig=options.kubeconfig,
        files=tuple(options.files),
        namespace=options.namespace,
        resources=tuple(r.strip() for r in options.resource.split(",") if r.strip()),
        operation=options.operation,
        concurrency=max(1, options.concurrency),
        timeout=options.timeout,
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


async def _list_all(client: Any, path: str) -> tuple[str, str, list[dict[str, Any]]]:
    """Every item of a list, page by page: (apiVersion, item kind, items)."""
    items: list[dict[str, Any]] = []
    query: dict[str, str] = {"limit": str(PAGE_SIZE)}
    api_version, kind = "v1", ""
    while True:
        body = json.loads(await client.get(path, query))
        api_version = body.get("apiVersion", api_version)
        kind = str(body.get("kind", "")).removesuffix("List")
        items.extend(body.get("items") or [])
        token = (body.get("metadata") or {}).get("continue")
        if not token:
            return api_version, kind, items
        query = {"limit": str(PAGE_SIZE), "continue": token}


async def from_cluster(options: AuditSettings) -> Inventory:
    from gateway.sources.kube import KubeClient, load_kubeconfig

    assert options.kubeconfig is not None
    client = KubeClient(load_kubeconfig(Path(options.kubeconfig)))
    inventory = Inventory()
    _, _, namespaces = await _list_all(client, "/api/v1/namespaces")
    for ns in namespaces:
        meta = ns.get("metadata") or {}
        inventory.namespaces[str(meta.get("name", ""))] = dict(meta.get("labels") or {})
    for spec in options.resources:
        group, version, resource, kind, namespaced = _resource(spec)
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        scoped = f"/namespaces/{options.namespace}" if options.namespace and namespaced else ""
        api_version, list_kind, items = await _list_all(client, f"{prefix}{scoped}/{resource}")
        for item in items:
            inventory.objects.append({"apiVersion": api_version, "kind": kind or list_kind, **item})
            inventory.resources.append(resource)
    return inventory


def from_files(options: AuditSettings, known_namespaces: Mapping[str, Mapping[str, str]]) -> Inventory:
    import yaml

    from gateway.commands.explain import plural

    inventory = Inventory(namespaces={k: dict(v) for k, v in known_namespaces.items()})
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
    for obj in inventory.objects:  # the apiserver labels every namespace with its name
        ns = (obj.get("metadata") or {}).get("namespace")
        if ns and ns not in inventory.namespaces:
            inventory.namespaces[ns] = {"kubernetes.io/metadata.name": ns}
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


async def audit(options: AuditSettings) -> dict[str, Any]:
    import msgspec
    import trio

    from gateway.commands import whatif
    from gateway.commands.explain import ExplainSettings, review_for
    from gateway.config.load import load_directory

    snapshot = load_directory(options.config)
    eligible = tuple(h for h in snapshot.validating if h.side_effects in ALLOWS_DRY_RUN)
    audited_snapshot = msgspec.structs.replace(snapshot, validating=eligible, mutating=())
    inventory = (
        await from_cluster(options) if options.kubeconfig else from_files(options, snapshot.namespaces)
    )

    done: dict[str, dict[str, Any]] = {}
    state_path = Path(options.state) if options.state else None
    if state_path is not None and state_path.exists():
        for line in state_path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
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
            explain_options = ExplainSettings(
                input="", operation=options.operation, resource=resource, dry_run=True,
                namespace=str(meta.get("namespace", "")),
            )  # fmt: skip
            doc = review_for(obj, explain_options)
            review = whatif.decode_review(json.dumps(doc).encode())
            deadline = trio.current_time() + options.timeout
            verdict = await whatif.run_review(
                engine, review, audited_snapshot, kind="validating", deadline=deadline
            )
            denials, errors = [], []
            for record in verdict.report.invocations if verdict.report else []:
                if record.outcome == "rejected":
                    denials.append({"backend": record.name, "message": record.reason})
                elif record.outcome in ("failed_closed", "internal_error", "failed_open"):
                    errors.append({"backend": record.name, "message": record.reason})
            if not verdict.allowed and not denials and not errors and verdict.status is not None:
                errors.append(
                    {
                        "backend": verdict.report.denied_by if verdict.report else "",
                        "message": verdict.status.message,
                    }
                )
            entry: dict[str, Any] = {
                "key": object_key(obj),
                "object": _object_ref(obj),
                "denials": denials,
                "errors": errors,
            }
            done[entry["key"]] = entry
            if state is not None:
                state.write(json.dumps(entry) + "\n")
                state.flush()
            progress.step(bool(denials))

    try:
        async with (
            whatif.dispatcher(inventory.namespaces, backend_kubeconfig=options.backend_kubeconfig) as engine,
            trio.open_nursery() as nursery,
        ):
            for obj, resource in todo:
                nursery.start_soon(one, engine, obj, resource)
    finally:
        progress.close()
        if state is not None:
            state.close()

    by_backend: dict[str, list[dict[str, Any]]] = {h.name: [] for h in eligible}
    errors: list[dict[str, Any]] = []
    for obj in inventory.objects:
        entry = done.get(object_key(obj))
        if entry is None:
            continue
        for d in entry["denials"]:
            by_backend.setdefault(d["backend"], []).append(
                {"object": entry["object"], "message": d["message"]}
            )
        errors.extend({"object": entry["object"], **e} for e in entry["errors"])
    return {
        "audited": len(inventory.objects),
        "resumed": resumed,
        "backends": {
            "audited": [h.name for h in eligible],
            "skipped (sideEffects refuse dry run)": [
                h.name for h in snapshot.validating if h not in eligible
            ],
        },
        "denials": {name: found for name, found in by_backend.items() if found},
        "errors": errors,
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
    denied = sum(len(v) for v in report["denials"].values())
    skipped = report["backends"]["skipped (sideEffects refuse dry run)"]
    lines.append(
        f"audited {report['audited']} object(s) ({report['resumed']} from the state file) against "
        f"{len(report['backends']['audited'])} validating backend(s): {denied} denial(s), "
        f"{len(report['errors'])} error(s)"
        + (f"; not dry-run safe, skipped: {', '.join(skipped)}" if skipped else "")
    )
    return "\n".join(lines)


def policy_reports(report: dict[str, Any]) -> list[dict[str, Any]]:
    """PolicyReport-shaped documents (wgpolicyk8s.io/v1alpha2): one per namespace, cluster-scoped
    objects in a ClusterPolicyReport; each denial is a ``fail`` result of the backend as ``policy``."""
    by_namespace: dict[str, list[dict[str, Any]]] = {}
    for backend, found in report["denials"].items():
        for d in found:
            ns = d["object"].get("namespace", "")
            by_namespace.setdefault(ns, []).append(
                {
                    "source": "webhook-gateway",
                    "policy": backend,
                    "result": "fail",
                    "message": d["message"],
                    "resources": [d["object"]],
                }
            )
    docs = []
    for ns, results in sorted(by_namespace.items()):
        meta: dict[str, Any] = {"name": f"webhook-gateway-audit{'-' + ns if ns else ''}"}
        if ns:
            meta["namespace"] = ns
        docs.append(
            {
                "apiVersion": "wgpolicyk8s.io/v1alpha2",
                "kind": "PolicyReport" if ns else "ClusterPolicyReport",
                "metadata": meta,
                "summary": {"pass": 0, "fail": len(results), "warn": 0, "error": 0, "skip": 0},
                "results": results,
            }
        )
    return docs


def run(options: AuditSettings) -> int:
    import trio
    import yaml

    from gateway.errors import ConfigError, GatewayError

    if not options.kubeconfig and not options.files:
        return fail("audit needs --kubeconfig FILE or object FILEs", 2)
    try:
        for spec in options.resources:
            _resource(spec)
        report = trio.run(audit, options)
    except KeyboardInterrupt:
        hint = f"; run again with --state {options.state} to resume" if options.state else ""
        return fail(f"interrupted{hint}", 130)
    except ConfigError as exc:
        return fail(f"{options.config}: configuration refused: {exc}".splitlines()[0])
    except (OSError, ValueError, GatewayError) as exc:
        return fail(str(exc))
    if options.output == "json":
        print(json.dumps(report, indent=2))
    elif options.output == "policyreport":
        print(yaml.safe_dump_all(policy_reports(report), sort_keys=False), end="")
    else:
        print(render_table(report))
    return 0
