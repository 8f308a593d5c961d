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
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.admission import GroupVersionResource
from gateway.config.model import Rule, Scope, Snapshot, Webhook, WebhookKind
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
    failure_policy: str = "Fail"
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


def _webhook(
    kind: WebhookKind, hooks: Sequence[Webhook], settings: Settings, notes: list[str]
) -> Document | None:
    excluded = frozenset((e.group, e.resource) for e in settings.excluded_resources)
    rules: list[Rule] = []
    delivered: list[Webhook] = []
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
            rules.extend(kept)
            delivered.append(hook)
    if not rules:
        return None
    merged = union_rules(rules)
    namespaces = excluded_namespaces(settings)
    prefix = "validate" if kind == "validating" else "mutate"
    path = settings.validate_path if kind == "validating" else settings.mutate_path
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
        "name": f"{prefix}.webhook-gateway.io",
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
        "failurePolicy": settings.failure_policy,
        "sideEffects": "NoneOnDryRun",
        "timeoutSeconds": chain_budget(kind, delivered, settings.deadline_margin),
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


def compute(snapshot: Snapshot, settings: Settings | None = None) -> Registration:
    """The narrowest registration pair delivering every review some backend could match."""
    settings = settings or Settings()
    notes: list[str] = []
    docs: dict[WebhookKind, Document] = {}
    kinds: tuple[tuple[WebhookKind, str], ...] = (
        ("validating", "ValidatingWebhookConfiguration"),
        ("mutating", "MutatingWebhookConfiguration"),
    )
    for kind, kind_name in kinds:
        hook = _webhook(kind, snapshot.webhooks(kind), settings, notes)
        docs[kind] = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": kind_name,
            "metadata": {"name": settings.name, "labels": dict(settings.labels)},
            "webhooks": [hook] if hook else [],
        }
    return Registration(docs["validating"], docs["mutating"], tuple(notes))


# --- comparing a written registration with the computed one ---------------------------------------

_EXCLUSION_EXPRESSION: Final = re.compile(
    r'^\s*!\s*\(\s*request\.resource\.group\s*==\s*"([^"]*)"\s*&&\s*'
    r'request\.resource\.resource\s*==\s*"([^"]*)"\s*\)\s*$'
)


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


def _shapes(coverages: Iterable[_Coverage]) -> Iterable[tuple[str, GroupVersionResource, str, bool]]:
    """Every request shape that tells the coverages apart: each named value, plus one unnamed."""
    groups, versions, resources, subs = (
        {"unlisted.example.com"},
        {"v0unlisted"},
        {"unlisted"},
        {"", "unlisted"},
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


def _describe(op: str, gvr: GroupVersionResource, sub: str, cluster: bool) -> str:
    what = f"{gvr.resource}/{sub}" if sub else gvr.resource
    group = f"{gvr.group}/{gvr.version}" if gvr.group else gvr.version
    return f"{op} {group} {what} ({'cluster-scoped' if cluster else 'namespaced'})"


def compare(written: Iterable[Mapping[str, Any]], wanted: Registration, *, examples: int = 3) -> list[str]:
    """Where a registration file differs from what the configuration needs: one line per finding.

    "Broader" means the apiserver sends the gateway reviews no backend needs (or waits on it where it
    should not); "stricter" means some backend will never see reviews its rules ask for.
    """
    findings: list[str] = []
    by_kind = {doc.get("kind"): doc for doc in written if isinstance(doc, Mapping)}
    for kind_name, computed in (
        ("ValidatingWebhookConfiguration", wanted.validating),
        ("MutatingWebhookConfiguration", wanted.mutating),
    ):
        doc = by_kind.get(kind_name)
        hooks = list((doc or {}).get("webhooks") or ())
        want_hooks = computed["webhooks"]
        if doc is None:
            if want_hooks:
                findings.append(f"{kind_name}: missing, but some backend needs it (stricter)")
            continue
        if len(hooks) > 1:
            findings.append(
                f"{kind_name}: {len(hooks)} webhooks point at the gateway; the apiserver calls the whole "
                "chain once for each of them"
            )
        unknown: list[str] = []
        have = [_coverage(h, unknown) for h in hooks]
        want = [_coverage(h, []) for h in want_hooks]
        if unknown:
            findings.append(
                f"{kind_name}: matchConditions {', '.join(sorted(set(unknown)))} not compared "
                "(only resource exclusions are understood)"
            )
        broader: list[str] = []
        stricter: list[str] = []
        for shape in _shapes([*have, *want]):
            delivered = any(c.delivers(*shape) for c in have)
            needed = any(c.delivers(*shape) for c in want)
            if delivered and not needed:
                broader.append(_describe(*shape))
            elif needed and not delivered:
                stricter.append(_describe(*shape))
        if broader:
            findings.append(
                f"{kind_name}: broader than the configuration needs: the apiserver waits on the gateway for "
                f"reviews no backend matches, e.g. {'; '.join(broader[:examples])}"
                + (f" (and {len(broader) - examples} more request shapes)" if len(broader) > examples else "")
            )
        if stricter:
            findings.append(
                f"{kind_name}: stricter than the configuration needs: backends never see reviews their rules "
                f"match, e.g. {'; '.join(stricter[:examples])}"
                + (
                    f" (and {len(stricter) - examples} more request shapes)"
                    if len(stricter) > examples
                    else ""
                )
            )
        if not hooks or not want_hooks:
            continue
        mine, theirs = hooks[0], want_hooks[0]
        missing_ns = _excluded_namespaces(theirs) - set().union(*(_excluded_namespaces(h) for h in hooks))
        extra_ns = set().union(*(_excluded_namespaces(h) for h in hooks)) - _excluded_namespaces(theirs)
        if missing_ns:
            findings.append(
                f"{kind_name}: broader: namespaces {', '.join(sorted(missing_ns))} are not excluded, so "
                "the cluster cannot repair itself while the gateway is down"
            )
        if extra_ns:
            findings.append(
                f"{kind_name}: stricter: namespaces {', '.join(sorted(extra_ns))} are excluded, so "
                "backends never see them"
            )
        timeout = min(int(h.get("timeoutSeconds") or 10) for h in hooks)
        if timeout < theirs["timeoutSeconds"]:
            findings.append(
                f"{kind_name}: stricter: timeoutSeconds {timeout} is less than the "
                f"{theirs['timeoutSeconds']}s the backends' timeouts need; late backends time out"
            )
        if mine.get("sideEffects") not in ("None", "NoneOnDryRun"):
            findings.append(
                f"{kind_name}: sideEffects {mine.get('sideEffects')!r}: the apiserver rejects every dry run "
                "without asking the gateway; use NoneOnDryRun"
            )
        if mine.get("matchPolicy", "Equivalent") != "Exact":
            findings.append(
                f"{kind_name}: matchPolicy {mine.get('matchPolicy', 'Equivalent')!r}: the apiserver converts "
                "requests to the registered versions, which the backends did not ask for; use Exact"
            )
        if kind_name == "MutatingWebhookConfiguration" and mine.get("reinvocationPolicy") == "IfNeeded":
            findings.append(
                f"{kind_name}: reinvocationPolicy IfNeeded: the apiserver may run the whole chain twice, "
                "calling Never backends again; use Never"
            )
    return findings
