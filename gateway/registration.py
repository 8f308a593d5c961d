"""The gateway's own registration with the kube-apiserver, derived from its configuration.

Pure computation on a ``Snapshot``: the narrowest ValidatingWebhookConfiguration and
MutatingWebhookConfiguration pair that still delivers every review some backend could match, minus
the cluster infrastructure the gateway must never stand in front of. The apiserver matches the
gateway's rules with the same algorithm the gateway uses for its backends (MAT-03..08), so the union
of the backends' rules delivers exactly the reviews some backend's rules match. Selectors and
matchConditions of the backends are not carried over: a single webhook per endpoint cannot express
their union, and a second webhook would make the apiserver call the whole chain twice (GW-07).

Infrastructure is excluded in two ways: namespaces through the ``namespaceSelector``, and resources by
dropping rule entries that name only excluded resources, plus one CEL ``matchCondition`` per excluded
resource that a remaining wildcard still covers (Kubernetes rules cannot say "all but").

Also here: comparing a registration someone wrote against the computed one (``compare``), by
evaluating both on every request shape the two mention.
"""

from __future__ import annotations

import base64
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import msgspec

from gateway.admission import GroupVersionResource
from gateway.config.model import FailurePolicy, Rule, Scope, Snapshot, Webhook, WebhookKind
from gateway.matching.rules import CompiledRule

GATEWAY_TIMEOUT_SECONDS: Final = 30  # the apiserver refuses a larger timeoutSeconds
REVIEW_VERSIONS: Final = ("v1", "v1beta1")
OPERATIONS: Final = ("CREATE", "UPDATE", "DELETE", "CONNECT")
NAMESPACE_LABEL: Final = "kubernetes.io/metadata.name"

Document = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Exclusion:
    """A resource (all its subresources) the gateway is never registered for, and why."""

    group: str
    resource: str
    prevents: str

    @property
    def label(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource

    @property
    def condition_name(self) -> str:
        return f"exclude-{self.label}"

    @property
    def expression(self) -> str:
        return (
            f'!(request.resource.group == "{self.group}" && request.resource.resource == "{self.resource}")'
        )


_NODES = (
    "kubelets register their Node and report its status (nodes/status) through the apiserver: with "
    "the gateway down, new or restarted nodes could not join or become Ready, so no node could ever "
    "run a gateway pod again"
)
_LEASES = (
    "node heartbeats (kube-node-lease) and the leader election of the controller manager, the "
    "scheduler and the gateway itself renew Leases every few seconds: blocking them marks every node "
    "NotReady and stops the controllers that would restart the gateway"
)
_EVENTS = (
    "every component records Events, very often and mostly while something is already wrong: "
    "waiting on the gateway for them adds load and latency exactly during an outage"
)
_AUTHN_REVIEW = (
    "the apiserver and aggregated servers authenticate service-account tokens with TokenReviews: "
    "blocking them stops authentication (the gateway never shows these to backends anyway)"
)
_ACCESS_REVIEW = (
    "kubelets, aggregated API servers and controllers authorize through SubjectAccessReviews: "
    "blocking them stops authorization (the gateway never shows these to backends anyway)"
)
_CSR = (
    "kubelet TLS bootstrap and certificate rotation create CertificateSigningRequests: a new node "
    "could not get its client certificate and join, so the gateway could not be rescheduled"
)

DEFAULT_EXCLUDED_RESOURCES: Final = (
    Exclusion("", "nodes", _NODES),
    Exclusion("coordination.k8s.io", "leases", _LEASES),
    Exclusion("", "events", _EVENTS),
    Exclusion("events.k8s.io", "events", _EVENTS),
    Exclusion("authentication.k8s.io", "tokenreviews", _AUTHN_REVIEW),
    Exclusion("authorization.k8s.io", "subjectaccessreviews", _ACCESS_REVIEW),
    Exclusion("authorization.k8s.io", "selfsubjectaccessreviews", _ACCESS_REVIEW),
    Exclusion("authorization.k8s.io", "localsubjectaccessreviews", _ACCESS_REVIEW),
    Exclusion("authorization.k8s.io", "selfsubjectrulesreviews", _ACCESS_REVIEW),
    Exclusion("certificates.k8s.io", "certificatesigningrequests", _CSR),
)

NAMESPACE_REASONS: Final[Mapping[str, str]] = {
    "kube-system": (
        "the control plane, DNS, CNI and kube-proxy live here: the cluster must be able to repair "
        "itself while the gateway is down"
    ),
    "kube-node-lease": "node heartbeats: blocking them marks every node NotReady",
}
OWN_NAMESPACE_REASON: Final = (
    "the gateway's own pods, Secrets, Leases and Endpoints: with the gateway down, nothing could "
    "create the pods that would bring it back (a bootstrap deadlock)"
)
DEFAULT_SYSTEM_NAMESPACES: Final = ("kube-system", "kube-node-lease")


def resource_exclusion(spec: str) -> Exclusion:
    """``RESOURCE`` (core group) or ``RESOURCE.GROUP``, as ``kubectl`` names resources."""
    resource, _, group = spec.strip().partition(".")
    if not resource or "/" in spec:
        raise ValueError(
            f"{spec!r}: expected RESOURCE or RESOURCE.GROUP, e.g. nodes or leases.coordination.k8s.io"
        )
    for known in DEFAULT_EXCLUDED_RESOURCES:
        if (known.group, known.resource) == (group, resource):
            return known
    return Exclusion(group, resource, "excluded by the operator")


@dataclass(frozen=True, slots=True)
class Settings:
    """Where the gateway is reached and what it must never stand in front of."""

    name: str = "webhook-gateway"
    namespace: str = "webhook-gateway"
    service: str = "webhook-gateway"
    port: int = 443
    # "https://HOST:PORT[/PREFIX]": register clientConfig.url (a gateway beside the apiserver on a
    # control-plane host) instead of the Service reference; the endpoint paths are appended.
    url: str = ""
    validate_path: str = "/validate"
    mutate_path: str = "/mutate"
    ca_bundle: bytes = b""  # PEM; empty = filled in later (cert-manager's CA injector, a patch)
    # "auto": each backend's own (validating backends split into a Fail and an Ignore registration; the
    # mutating chain is Fail when some backend is); "Fail"/"Ignore": one registration per kind with it
    failure_policy: str = "auto"
    deadline_margin: float = 0.2  # the gateway answers this long before the caller's timeout
    # None: the gateway's own namespace and DEFAULT_SYSTEM_NAMESPACES
    excluded_namespaces: tuple[str, ...] | None = None
    excluded_resources: tuple[Exclusion, ...] = DEFAULT_EXCLUDED_RESOURCES
    labels: Mapping[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "webhook-gateway"})


def excluded_namespaces(settings: Settings) -> tuple[str, ...]:
    if settings.excluded_namespaces is None:
        return (settings.namespace, *DEFAULT_SYSTEM_NAMESPACES)
    return settings.excluded_namespaces


@dataclass(frozen=True, slots=True)
class Registration:
    """The two registration objects, and what an operator should know about them."""

    validating: Document
    mutating: Document
    notes: tuple[str, ...] = ()

    def documents(self) -> tuple[Document, Document]:
        return self.validating, self.mutating


# --- rules ---------------------------------------------------------------------------------------


def _split(entry: str) -> tuple[str, str]:
    res, _, sub = entry.partition("/")
    return res, sub


def _entry_covers(wide: str, narrow: str) -> bool:
    """Every request the resources entry ``narrow`` matches is matched by ``wide`` (MAT-06/07)."""
    (wr, ws), (nr, ns) = _split(wide), _split(narrow)
    return wr in ("*", nr) and ws in ("*", ns)


def _minimal_resources(entries: Iterable[str]) -> tuple[str, ...]:
    """Drop duplicate entries and entries another one already covers, keeping first-seen order."""
    kept: list[str] = []
    for entry in entries:
        if any(_entry_covers(k, entry) for k in kept):
            continue
        kept = [k for k in kept if not _entry_covers(entry, k)]
        kept.append(entry)
    return tuple(kept)


def _prune(rule: Rule, excluded: frozenset[tuple[str, str]]) -> Rule | None:
    """The rule without resource entries that only name excluded resources (None: nothing left)."""
    if "*" in rule.api_groups:
        return rule
    kept = tuple(
        entry
        for entry in rule.resources
        if _split(entry)[0] == "*" or not all((g, _split(entry)[0]) in excluded for g in rule.api_groups)
    )
    if not kept:
        return None
    return Rule(
        operations=rule.operations,
        api_groups=rule.api_groups,
        api_versions=rule.api_versions,
        resources=kept,
        scope=rule.scope,
    )


def _sorted_or_wild(values: Iterable[str], order: Sequence[str] = ()) -> tuple[str, ...]:
    unique = set(values)
    if "*" in unique:
        return ("*",)
    return tuple(sorted(unique, key=lambda v: (order.index(v) if v in order else len(order), v)))


def _rule_covers(wide: Rule, narrow: Rule) -> bool:
    """Every request ``narrow`` matches is matched by ``wide``."""

    def within(outer: tuple[str, ...], inner: tuple[str, ...]) -> bool:
        return "*" in outer or ("*" not in inner and set(inner) <= set(outer))

    return (
        within(wide.operations, narrow.operations)
        and within(wide.api_groups, narrow.api_groups)
        and within(wide.api_versions, narrow.api_versions)
        and wide.scope in ("*", narrow.scope)
        and all(any(_entry_covers(w, n) for w in wide.resources) for n in narrow.resources)
    )


def union_rules(rules: Iterable[Rule]) -> tuple[Rule, ...]:
    """Rules matching exactly the requests some given rule matches, in fewer rules where that is exact.

    Rules differing only in their operations merge (one operation list), then rules differing only in
    their resources merge (a rule matches when any entry does); a rule another one covers is dropped.
    """
    by_resources: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], Scope], list[str]] = {}
    for rule in rules:
        key = (
            _sorted_or_wild(rule.api_groups),
            _sorted_or_wild(rule.api_versions),
            _minimal_resources(rule.resources),
            rule.scope,
        )
        by_resources.setdefault(key, []).extend(rule.operations)
    by_operations: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], Scope], list[str]] = {}
    for (groups, versions, resources, scope), ops in by_resources.items():
        key = (_sorted_or_wild(ops, OPERATIONS), groups, versions, scope)
        by_operations.setdefault(key, []).extend(resources)
    merged = [
        Rule(
            operations=ops,
            api_groups=groups,
            api_versions=versions,
            resources=_minimal_resources(res),
            scope=scope,
        )
        for (ops, groups, versions, scope), res in by_operations.items()
    ]
    kept: list[Rule] = []
    for i, rule in enumerate(merged):
        others = kept + merged[i + 1 :]
        if not any(_rule_covers(other, rule) for other in others):
            kept.append(rule)
    return tuple(kept)


def _could_cover(rule: Rule, exclusion: Exclusion) -> bool:
    """Whether some request for the excluded resource (any subresource, version, scope) matches."""
    if "*" not in rule.api_groups and exclusion.group not in rule.api_groups:
        return False
    return any(_split(entry)[0] in ("*", exclusion.resource) for entry in rule.resources)


def _rule_document(rule: Rule) -> Document:
    return {
        "operations": list(rule.operations),
        "apiGroups": list(rule.api_groups),
        "apiVersions": list(rule.api_versions),
        "resources": list(rule.resources),
        "scope": rule.scope,
    }


# --- the registration ----------------------------------------------------------------------------

Half = Literal["fail", "ignore"]
HALVES: Final[tuple[tuple[Half, FailurePolicy], ...]] = (("fail", "Fail"), ("ignore", "Ignore"))


def half_path(base: str, half: Half) -> str:
    """The path the gateway serves one half of its validating backends on (``/validate/fail``)."""
    return f"{base.rstrip('/')}/{half}"


def half_of(snapshot: Snapshot, half: Half) -> Snapshot:
    """The configuration a half's path runs: only the validating backends of that failurePolicy.

    Computed once per snapshot and half (a review never pays for it), kept for the last few.
    """
    key = (id(snapshot), half)
    found = _HALVES_SEEN.get(key)
    if found is not None and found[0] is snapshot:
        return found[1]
    policy = dict(HALVES)[half]
    narrowed = msgspec.structs.replace(
        snapshot, validating=tuple(h for h in snapshot.validating if h.failure_policy == policy)
    )
    _HALVES_SEEN[key] = (snapshot, narrowed)
    while len(_HALVES_SEEN) > 8:
        del _HALVES_SEEN[next(iter(_HALVES_SEEN))]
    return narrowed


_HALVES_SEEN: dict[tuple[int, str], tuple[Snapshot, Snapshot]] = {}


def chain_budget(kind: WebhookKind, hooks: Sequence[Webhook], margin: float) -> int:
    """timeoutSeconds the gateway needs to give every backend its full timeout (GW-05, FPT-07).

    Validating backends run in parallel: the longest timeout. Mutating backends run one after the
    other, and ``IfNeeded`` ones may run a second time: the sum. Plus the gateway's answer margin,
    rounded up, at most 30 s (the most the apiserver allows).
    """
    if not hooks:
        return 1
    if kind == "validating":
        need = max(h.timeout_seconds for h in hooks)
    else:
        need = sum(h.timeout_seconds * (2 if h.reinvocation_policy == "IfNeeded" else 1) for h in hooks)
    return max(1, min(GATEWAY_TIMEOUT_SECONDS, math.ceil(need + margin)))


def _deliverable(
    kind: WebhookKind, hooks: Sequence[Webhook], settings: Settings, notes: list[str]
) -> list[tuple[Webhook, list[Rule]]]:
    """Each backend with the rules the registration can deliver (backends left with none dropped)."""
    excluded = frozenset((e.group, e.resource) for e in settings.excluded_resources)
    out = []
    for hook in hooks:
        kept = [r for r in (_prune(rule, excluded) for rule in hook.rules) if r is not None]
        if len(kept) < len(hook.rules) or any(
            r.resources != o.resources for r, o in zip(kept, hook.rules, strict=False)
        ):
            notes.append(
                f"{kind} backend {hook.identity} asks for resources the registration excludes; "
                "it will never see them"
            )
        if kept:
            out.append((hook, kept))
    return out


def _names(hooks: Iterable[Webhook]) -> str:
    return ", ".join(f"{h.name} ({h.configuration})" for h in hooks)


def _webhook(
    kind: WebhookKind,
    entries: Sequence[tuple[Webhook, list[Rule]]],
    settings: Settings,
    *,
    name: str,
    path: str,
    failure_policy: str,
) -> Document | None:
    rules = [r for _, kept in entries for r in kept]
    if not rules:
        return None
    merged = union_rules(rules)
    namespaces = excluded_namespaces(settings)
    client: Document = (
        {"url": settings.url.rstrip("/") + path}
        if settings.url
        else {
            "service": {
                "namespace": settings.namespace,
                "name": settings.service,
                "path": path,
                "port": settings.port,
            }
        }
    )
    if settings.ca_bundle:
        client["caBundle"] = base64.b64encode(settings.ca_bundle).decode()
    webhook: Document = {
        "name": name,
        "clientConfig": client,
        "rules": [_rule_document(r) for r in merged],
        "matchPolicy": "Exact",
        "namespaceSelector": (
            {
                "matchExpressions": [
                    {
                        "key": NAMESPACE_LABEL,
                        "operator": "NotIn",
                        "values": list(namespaces),
                    }
                ]
            }
            if namespaces
            else {}
        ),
        "objectSelector": {},
        "failurePolicy": failure_policy,
        "sideEffects": "NoneOnDryRun",
        "timeoutSeconds": chain_budget(kind, [h for h, _ in entries], settings.deadline_margin),
        "admissionReviewVersions": list(REVIEW_VERSIONS),
    }
    conditions = [
        {"name": e.condition_name, "expression": e.expression}
        for e in settings.excluded_resources
        if any(_could_cover(r, e) for r in merged)
    ]
    if conditions:
        webhook["matchConditions"] = conditions
    if kind == "mutating":
        webhook["reinvocationPolicy"] = "Never"
    return webhook


def _validating(snapshot: Snapshot, settings: Settings, notes: list[str]) -> list[Document]:
    """VAL: backends run in parallel, so they split by failurePolicy: each half behind a registration
    with its own policy and path, and a gateway outage fails open exactly where they would."""
    entries = _deliverable("validating", snapshot.validating, settings, notes)
    if settings.failure_policy != "auto":
        forced = settings.failure_policy
        changed = [h for h, _ in entries if h.failure_policy != forced]
        if changed:
            notes.append(
                f"--failure-policy {forced}: validating backends with failurePolicy "
                f"{'Ignore' if forced == 'Fail' else 'Fail'} "
                + (
                    "made fail-closed (while no gateway replica answers, the apiserver rejects what "
                    "they match): "
                    if forced == "Fail"
                    else "made fail-open (while no gateway replica answers, the apiserver admits what "
                    "they match unchecked): "
                )
                + _names(changed)
            )
        hook = _webhook(
            "validating",
            entries,
            settings,
            name="validate.webhook-gateway.io",
            path=settings.validate_path,
            failure_policy=forced,
        )
        return [hook] if hook else []
    webhooks = []
    for half, policy in HALVES:
        hook = _webhook(
            "validating",
            [(h, r) for h, r in entries if h.failure_policy == policy],
            settings,
            name=f"validate.webhook-gateway.io-{half}",
            path=half_path(settings.validate_path, half),
            failure_policy=policy,
        )
        if hook:
            webhooks.append(hook)
    return webhooks


def mutating_failure_policy(hooks: Iterable[Webhook]) -> FailurePolicy:
    """MUT: the chain's order cannot be split, so its one registration fails closed as soon as one
    covered backend does."""
    return "Fail" if any(h.failure_policy == "Fail" for h in hooks) else "Ignore"


def _mutating(snapshot: Snapshot, settings: Settings, notes: list[str]) -> list[Document]:
    entries = _deliverable("mutating", snapshot.mutating, settings, notes)
    hooks = [h for h, _ in entries]
    if settings.failure_policy == "auto":
        policy: str = mutating_failure_policy(hooks)
        failing = [h for h in hooks if h.failure_policy == "Fail"]
        why = f"because {len(failing)} of its backends fail closed, e.g. {_names(failing[:2])}"
    else:
        policy, why = settings.failure_policy, f"--failure-policy {settings.failure_policy}"
    closed = [h for h in hooks if h.failure_policy == "Ignore"] if policy == "Fail" else []
    opened = [h for h in hooks if h.failure_policy == "Fail"] if policy == "Ignore" else []
    if closed:
        notes.append(
            f"the mutating registration is failurePolicy Fail ({why}; one chain cannot be split), "
            "so these mutating backends with failurePolicy Ignore are made fail-closed: while no gateway "
            f"replica answers, the apiserver rejects what they match: {_names(closed)}"
        )
    if opened:
        notes.append(
            f"the mutating registration is failurePolicy Ignore ({why}), so these mutating backends with "
            "failurePolicy Fail are made fail-open: while no gateway replica answers, the apiserver "
            f"admits what they match unchanged: {_names(opened)}"
        )
    hook = _webhook(
        "mutating",
        entries,
        settings,
        name="mutate.webhook-gateway.io",
        path=settings.mutate_path,
        failure_policy=policy,
    )
    return [hook] if hook else []


def compute(snapshot: Snapshot, settings: Settings | None = None) -> Registration:
    """The narrowest registration pair delivering every review some backend could match, keeping
    each backend's failure semantics as far as one gateway can (see ``Settings.failure_policy``)."""
    settings = settings or Settings()
    notes: list[str] = []
    docs: dict[str, Document] = {}
    for kind, kind_name, webhooks in (
        ("validating", "ValidatingWebhookConfiguration", _validating(snapshot, settings, notes)),
        ("mutating", "MutatingWebhookConfiguration", _mutating(snapshot, settings, notes)),
    ):
        docs[kind] = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": kind_name,
            "metadata": {"name": settings.name, "labels": dict(settings.labels)},
            "webhooks": webhooks,
        }
    return Registration(docs["validating"], docs["mutating"], tuple(notes))


# --- comparing a written registration with the computed one ---------------------------------------

_EXCLUSION_EXPRESSION: Final = re.compile(
    r'^\s*!\s*\(\s*request\.resource\.group\s*==\s*"([^"]*)"\s*&&\s*'
    r'request\.resource\.resource\s*==\s*"([^"]*)"\s*\)\s*$'
)

# Request shapes are probed with every value either side names, plus one value neither names.
_OTHER_GROUP: Final = "other.invalid"
_OTHER_VERSION: Final = "v0other"
_OTHER_RESOURCE: Final = "other-resources"
_OTHER_SUBRESOURCE: Final = "other-subresource"

# Built-in resources and whether they are namespaced: examples name real request shapes only (no
# ``pods (cluster-scoped)``, no core-group ``certificatesigningrequests``).
_BUILTIN_NAMESPACED: Final[Mapping[tuple[str, str], bool]] = {
    **{("", r): True for r in (
        "pods", "services", "configmaps", "secrets", "serviceaccounts", "persistentvolumeclaims",
        "endpoints", "events", "limitranges", "resourcequotas", "replicationcontrollers", "podtemplates",
    )},
    **{("", r): False for r in ("nodes", "namespaces", "persistentvolumes", "componentstatuses")},
    **{("apps", r): True for r in (
        "deployments", "statefulsets", "daemonsets", "replicasets", "controllerrevisions",
    )},
    ("batch", "jobs"): True,
    ("batch", "cronjobs"): True,
    ("autoscaling", "horizontalpodautoscalers"): True,
    ("policy", "poddisruptionbudgets"): True,
    ("networking.k8s.io", "ingresses"): True,
    ("networking.k8s.io", "networkpolicies"): True,
    ("networking.k8s.io", "ingressclasses"): False,
    ("discovery.k8s.io", "endpointslices"): True,
    ("coordination.k8s.io", "leases"): True,
    ("events.k8s.io", "events"): True,
    ("rbac.authorization.k8s.io", "roles"): True,
    ("rbac.authorization.k8s.io", "rolebindings"): True,
    ("rbac.authorization.k8s.io", "clusterroles"): False,
    ("rbac.authorization.k8s.io", "clusterrolebindings"): False,
    ("certificates.k8s.io", "certificatesigningrequests"): False,
    ("authentication.k8s.io", "tokenreviews"): False,
    ("authorization.k8s.io", "subjectaccessreviews"): False,
    ("authorization.k8s.io", "selfsubjectaccessreviews"): False,
    ("authorization.k8s.io", "selfsubjectrulesreviews"): False,
    ("authorization.k8s.io", "localsubjectaccessreviews"): True,
    ("apiextensions.k8s.io", "customresourcedefinitions"): False,
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations"): False,
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): False,
    ("storage.k8s.io", "storageclasses"): False,
    ("scheduling.k8s.io", "priorityclasses"): False,
}  # fmt: skip
_BUILTIN_NAMES: Final = frozenset(r for _, r in _BUILTIN_NAMESPACED)
_BUILTIN_SUBRESOURCES: Final[Mapping[str, frozenset[str]]] = {
    "pods": frozenset(
        {
            "status",
            "exec",
            "attach",
            "portforward",
            "log",
            "binding",
            "eviction",
            "ephemeralcontainers",
            "proxy",
        }
    ),
    "nodes": frozenset({"status", "proxy"}),
    "services": frozenset({"status", "proxy"}),
    "namespaces": frozenset({"status", "finalize"}),
    "deployments": frozenset({"status", "scale"}),
    "statefulsets": frozenset({"status", "scale"}),
    "replicasets": frozenset({"status", "scale"}),
    "replicationcontrollers": frozenset({"status", "scale"}),
    "serviceaccounts": frozenset({"token"}),
}

Shape = tuple[str, GroupVersionResource, str, bool]  # operation, resource, subresource, cluster-scoped


@dataclass(frozen=True, slots=True)
class _Coverage:
    """What one registration webhook delivers, in the terms the comparison can evaluate."""

    rules: tuple[CompiledRule, ...]
    excluded: frozenset[tuple[str, str]]
    raw_rules: tuple[Rule, ...]

    def delivers(self, op: str, gvr: GroupVersionResource, sub: str, cluster: bool) -> bool:
        if (gvr.group, gvr.resource) in self.excluded:
            return False
        return any(r.matches(op, gvr, sub, cluster) for r in self.rules)


def _scope(value: object) -> Scope:
    if value == "Cluster":
        return "Cluster"
    if value == "Namespaced":
        return "Namespaced"
    return "*"


def _coverage(webhook: Mapping[str, Any], unknown: list[str]) -> _Coverage:
    rules = tuple(
        Rule(
            operations=tuple(r.get("operations") or ()),
            api_groups=tuple(r.get("apiGroups") or ()),
            api_versions=tuple(r.get("apiVersions") or ()),
            resources=tuple(r.get("resources") or ()),
            scope=_scope(r.get("scope")),
        )
        for r in webhook.get("rules") or ()
    )
    excluded = set()
    for condition in webhook.get("matchConditions") or ():
        found = _EXCLUSION_EXPRESSION.match(str(condition.get("expression", "")))
        if found:
            excluded.add((found.group(1), found.group(2)))
        else:
            unknown.append(str(condition.get("name", "?")))
    return _Coverage(tuple(CompiledRule(r) for r in rules), frozenset(excluded), rules)


def _excluded_namespaces(webhook: Mapping[str, Any]) -> set[str]:
    out: set[str] = set()
    for expr in (webhook.get("namespaceSelector") or {}).get("matchExpressions") or ():
        if expr.get("key") == NAMESPACE_LABEL and expr.get("operator") == "NotIn":
            out |= set(expr.get("values") or ())
    return out


def webhook_path(webhook: Mapping[str, Any]) -> str:
    """The path a registration webhook sends reviews to (service path, or the URL's path)."""
    client = webhook.get("clientConfig") or {}
    service = client.get("service") or {}
    if service:
        return str(service.get("path") or "/")
    return urlsplit(str(client.get("url") or "")).path or "/"


def base_path(path: str) -> str:
    """``/validate`` for ``/validate``, ``/validate/fail`` and ``/validate/ignore``."""
    for half, _ in HALVES:
        if path.endswith("/" + half):
            return path[: -len(half) - 1] or "/"
    return path


def _shapes(coverages: Iterable[_Coverage]) -> Iterable[Shape]:
    """Every request shape that tells the coverages apart: each named value, plus one unnamed."""
    groups, versions, resources, subs = (
        {_OTHER_GROUP},
        {_OTHER_VERSION},
        {_OTHER_RESOURCE},
        {"", _OTHER_SUBRESOURCE},
    )
    ops = set(OPERATIONS)
    for cov in coverages:
        for rule in cov.raw_rules:
            ops |= set(rule.operations) - {"*"}
            groups |= set(rule.api_groups) - {"*"}
            versions |= set(rule.api_versions) - {"*"}
            for entry in rule.resources:
                res, sub = _split(entry)
                resources |= {res} - {"*"}
                subs |= {sub} - {"*"}
        for group, resource in cov.excluded:
            groups.add(group)
            resources.add(resource)
    for op, group, version, resource, sub, cluster in itertools.product(
        sorted(ops), sorted(groups), sorted(versions), sorted(resources), sorted(subs), (False, True)
    ):
        yield op, GroupVersionResource(group=group, version=version, resource=resource), sub, cluster


def _realistic(shape: Shape) -> int:
    """How well a shape serves as an example: 0 a real request, 1 real in any version, 2 an unusual
    operation (CONNECT without a subresource), 3 synthetic; -1 one that cannot happen (a built-in
    resource in another group or scope)."""
    op, gvr, sub, cluster = shape
    known = _BUILTIN_NAMESPACED.get((gvr.group, gvr.resource))
    if known is not None and known == cluster:
        return -1
    if known is None and gvr.resource in _BUILTIN_NAMES:
        return -1
    if known is not None and sub and sub not in _BUILTIN_SUBRESOURCES.get(gvr.resource, {"status"}):
        return -1
    if gvr.group == _OTHER_GROUP or gvr.resource == _OTHER_RESOURCE or sub == _OTHER_SUBRESOURCE:
        return 3
    if op == "CONNECT" and not sub:
        return 2
    return 1 if gvr.version == _OTHER_VERSION else 0


def _describe(shape: Shape) -> str:
    """As kubectl names resources: ``CREATE pods``, ``UPDATE deployments.apps/scale (v1)``."""
    op, gvr, sub, cluster = shape
    resource = "resources" if gvr.resource == _OTHER_RESOURCE else gvr.resource
    if gvr.group == _OTHER_GROUP:
        resource += " of any other group"
    elif gvr.group:
        resource += f".{gvr.group}"
    if sub:
        resource += "/<any subresource>" if sub == _OTHER_SUBRESOURCE else f"/{sub}"
    notes = [] if gvr.version == _OTHER_VERSION else [gvr.version]
    if (gvr.group, gvr.resource) not in _BUILTIN_NAMESPACED:
        notes.append("cluster-scoped" if cluster else "namespaced")
    return f"{op} {resource}" + (f" ({', '.join(notes)})" if notes else "")


def _examples(shapes: list[Shape], count: int) -> str:
    ranked = sorted(
        (s for s in shapes if _realistic(s) >= 0),
        key=lambda s: (_realistic(s), s[2] != "", OPERATIONS.index(s[0])),
    )
    ranked = ranked or shapes
    described = list(dict.fromkeys(_describe(s) for s in ranked))
    more = len(described) - count
    return "; ".join(described[:count]) + (f" (and {more} more)" if more > 0 else "")


@dataclass(frozen=True, slots=True)
class _Written:
    """One webhook of a written registration: what it delivers and which backends it reaches."""

    doc: Mapping[str, Any]
    coverage: _Coverage
    serves: frozenset[str]  # "fail"/"ignore" (validating halves) or "all" (the mutating chain)

    @property
    def name(self) -> str:
        return str(self.doc.get("name", "?"))


def _group_label(kind: WebhookKind, group: str) -> str:
    if kind == "mutating":
        return "the mutating backends"
    return f"the validating backends with failurePolicy {group.capitalize()}"


def compare(
    written: Iterable[Mapping[str, Any]],
    snapshot: Snapshot,
    settings: Settings | None = None,
    *,
    examples: int = 3,
) -> list[str]:
    """Where a registration file differs from what the configuration needs: one line per finding.

    "Broader" means the apiserver sends the gateway reviews no backend needs (or waits on it where it
    should not); "stricter" means some backend will never see reviews its rules ask for. Validating
    backends are compared per failurePolicy: each half is served on its own path, and a written
    registration whose failurePolicy differs from its backends' changes what a gateway outage does.
    """
    settings = replace(settings or Settings(), failure_policy="auto")
    wanted = compute(snapshot, settings)
    findings: list[str] = []
    by_kind = {doc.get("kind"): doc for doc in written if isinstance(doc, Mapping)}
    kinds: tuple[tuple[WebhookKind, str, Document], ...] = (
        ("validating", "ValidatingWebhookConfiguration", wanted.validating),
        ("mutating", "MutatingWebhookConfiguration", wanted.mutating),
    )
    for kind, kind_name, computed in kinds:
        found = _compare_kind(
            kind, by_kind.get(kind_name), computed, snapshot, settings=settings, examples=examples
        )
        findings += [f"{kind_name}: {f}" for f in found]
    return findings


def _compare_kind(
    kind: WebhookKind,
    doc: Mapping[str, Any] | None,
    computed: Document,
    snapshot: Snapshot,
    *,
    settings: Settings,
    examples: int,
) -> list[str]:
    findings: list[str] = []
    want_hooks: list[Mapping[str, Any]] = computed["webhooks"]
    if doc is None:
        return ["missing, but some backend needs it (stricter)"] if want_hooks else []
    base = settings.validate_path if kind == "validating" else settings.mutate_path
    groups = ("fail", "ignore") if kind == "validating" else ("all",)

    def serves(path: str) -> frozenset[str]:
        if kind == "mutating":
            return frozenset({"all"}) if path == base else frozenset()
        if path == base:
            return frozenset(groups)
        return frozenset(h for h, _ in HALVES if path == half_path(base, h))

    needed: dict[str, _Coverage] = {}
    for hook in want_hooks:
        for group in serves(webhook_path(hook)):
            needed[group] = _coverage(hook, [])
    unknown: list[str] = []
    have: list[_Written] = []
    for hook in doc.get("webhooks") or ():
        path = webhook_path(hook)
        served = serves(path)
        if not served:
            paths = [base] if kind == "mutating" else [half_path(base, h) for h, _ in HALVES]
            findings.append(
                f"webhook {hook.get('name', '?')} sends reviews to {path}, which the gateway does not "
                f"serve ({', '.join(paths)})"
            )
            continue
        have.append(_Written(hook, _coverage(hook, unknown), served))
    if unknown:
        findings.append(
            f"matchConditions {', '.join(sorted(set(unknown)))} not compared "
            "(only resource exclusions are understood)"
        )
    shapes = list(_shapes([*(w.coverage for w in have), *needed.values()]))
    for w in have:
        broader = [
            s
            for s in shapes
            if w.coverage.delivers(*s) and not any(needed[g].delivers(*s) for g in w.serves if g in needed)
        ]
        if broader:
            findings.append(
                f"broader than the configuration needs: webhook {w.name} makes the apiserver wait on the "
                f"gateway for reviews no backend matches, e.g. {_examples(broader, examples)}"
            )
    for group in groups:
        serving = [w for w in have if group in w.serves]
        if group in needed:
            stricter = [
                s
                for s in shapes
                if needed[group].delivers(*s) and not any(w.coverage.delivers(*s) for w in serving)
            ]
            if stricter:
                findings.append(
                    f"stricter than the configuration needs: {_group_label(kind, group)} never see reviews "
                    f"their rules match, e.g. {_examples(stricter, examples)}"
                )
        twice = [
            (a, b)
            for i, a in enumerate(serving)
            for b in serving[i + 1 :]
            if any(a.coverage.delivers(*s) and b.coverage.delivers(*s) for s in shapes)
        ]
        for a, b in twice:
            findings.append(
                f"webhooks {a.name} and {b.name} both send reviews to {_group_label(kind, group)}: the "
                "apiserver calls them once for each"
            )
    wanted_ns = set(excluded_namespaces(settings))
    for w in have:
        mine = _excluded_namespaces(w.doc)
        if missing := wanted_ns - mine:
            findings.append(
                f"broader: webhook {w.name} does not exclude namespaces {', '.join(sorted(missing))}, so "
                "the cluster cannot repair itself while the gateway is down"
            )
        if extra := mine - wanted_ns:
            findings.append(
                f"stricter: webhook {w.name} excludes namespaces {', '.join(sorted(extra))}, so backends "
                "never see them"
            )
        backends = _served_backends(kind, snapshot, w.serves)
        budget = chain_budget(kind, backends, settings.deadline_margin) if backends else 0
        timeout = int(w.doc.get("timeoutSeconds") or 10)
        if timeout < budget:
            findings.append(
                f"stricter: webhook {w.name} has timeoutSeconds {timeout}, less than the {budget}s the "
                "backends' timeouts need; late backends time out"
            )
        findings += _policy_findings(kind, w, backends)
        if w.doc.get("sideEffects") not in ("None", "NoneOnDryRun"):
            findings.append(
                f"webhook {w.name} has sideEffects {w.doc.get('sideEffects')!r}: the apiserver rejects every "
                "dry run without asking the gateway; use NoneOnDryRun"
            )
        if w.doc.get("matchPolicy", "Equivalent") != "Exact":
            findings.append(
                f"webhook {w.name} has matchPolicy {w.doc.get('matchPolicy', 'Equivalent')!r}: the "
                "apiserver converts requests to the registered versions, which the backends did not ask "
                "for; use Exact"
            )
        if kind == "mutating" and w.doc.get("reinvocationPolicy") == "IfNeeded":
            findings.append(
                f"webhook {w.name} has reinvocationPolicy IfNeeded: the apiserver may run the whole chain "
                "twice, calling Never backends again; use Never"
            )
    return findings


def _served_backends(kind: WebhookKind, snapshot: Snapshot, serves: frozenset[str]) -> list[Webhook]:
    if kind == "mutating":
        return list(snapshot.mutating)
    policies = {dict(HALVES)[g] for g in serves if g in dict(HALVES)}
    return [h for h in snapshot.validating if h.failure_policy in policies]


def _policy_findings(kind: WebhookKind, w: _Written, backends: list[Webhook]) -> list[str]:
    policy = w.doc.get("failurePolicy", "Fail")
    if kind == "mutating":
        wanted = mutating_failure_policy(backends) if backends else policy
        closed = [h for h in backends if h.failure_policy == "Ignore"] if wanted == "Ignore" else []
        opened = [h for h in backends if h.failure_policy == "Fail"]
    else:
        closed = [h for h in backends if h.failure_policy == "Ignore"]
        opened = [h for h in backends if h.failure_policy == "Fail"]
    if policy == "Fail" and closed:
        return [
            f"stricter: webhook {w.name} is failurePolicy Fail, so these backends with failurePolicy Ignore "
            f"fail closed while no gateway replica answers: {_names(closed)}"
        ]
    if policy == "Ignore" and opened:
        return [
            f"broader: webhook {w.name} is failurePolicy Ignore, so these backends with failurePolicy Fail "
            f"fail open while no gateway replica answers: {_names(opened)}"
        ]
    return []
