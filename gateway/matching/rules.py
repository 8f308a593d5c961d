"""Rule matching (MAT-03..08): does a request's operation and resource fall under a backend's rules?

First stage of ``gateway.matching``: the cheapest predicate, so ``invocation`` evaluates it before the
selectors (the observable outcome still follows upstream's order, MAT-01/02). Each rules tuple is
compiled once into frozensets, and its verdicts are memoised per *request shape* (operation, resource,
subresource, scope class): a review of a known shape costs one dict lookup per backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from gateway.admission import AdmissionAttributes, GroupVersionResource
from gateway.config.model import Rule

NAMESPACE_RESOURCE: Final = GroupVersionResource(group="", version="v1", resource="namespaces")
"""The Namespace resource, exactly: the only cluster-scoped resource that carries a namespace (MAT-08)."""

_MEMO_LIMIT: Final = 1024
_CACHE_LIMIT: Final = 8192


def is_cluster_scoped(resource: GroupVersionResource, namespace: str) -> bool:
    """MAT-08: Namespace objects (any subresource) and requests without a namespace are cluster-scoped."""
    # upstream: predicates/rules/rules.go scope() compares the whole GVR, not just the resource name
    return namespace == "" or resource == NAMESPACE_RESOURCE


def shape_key(attrs: AdmissionAttributes) -> str:
    """The request shape of a review as a string: its hash is cached, so memo lookups stay cheap."""
    res = attrs.resource
    scope = "c" if is_cluster_scoped(res, attrs.namespace) else "n"
    return f"{attrs.operation}\0{res.group}\0{res.version}\0{res.resource}\0{attrs.sub_resource}\0{scope}"


def _split_resource(entry: str) -> tuple[str, str]:
    # MAT-06: split at the *first* slash; no slash means "no subresource"
    res, _, sub = entry.partition("/")
    return res, sub


class CompiledRule:
    """One Rule as sets; ``None`` stands for a wildcard list."""

    __slots__ = ("cluster", "groups", "namespaced", "operations", "resources", "versions")

    def __init__(self, rule: Rule) -> None:
        self.operations = None if "*" in rule.operations else frozenset(rule.operations)
        self.groups = None if "*" in rule.api_groups else frozenset(rule.api_groups)
        self.versions = None if "*" in rule.api_versions else frozenset(rule.api_versions)
        self.resources = tuple(_split_resource(entry) for entry in rule.resources)
        self.cluster = rule.scope in ("*", "Cluster")
        self.namespaced = rule.scope in ("*", "Namespaced")

    def matches(
        self,
        operation: str,
        resource: GroupVersionResource,
        sub_resource: str,
        cluster_scoped: bool,
    ) -> bool:
        """MAT-03: scope, operation, group, version and resource all match (upstream order)."""
        if not (self.cluster if cluster_scoped else self.namespaced):
            return False
        if self.operations is not None and operation not in self.operations:
            return False
        if self.groups is not None and resource.group not in self.groups:
            return False
        if self.versions is not None and resource.version not in self.versions:
            return False
        name = resource.resource
        # MAT-07 quirk: sub "*" also accepts the empty subresource, so "pods/*" matches "pods".
        # upstream: predicates/rules/rules.go resource()
        return any(res in ("*", name) and sub in ("*", sub_resource) for res, sub in self.resources)


class RulesMatcher:
    """A backend's rules compiled once; verdicts memoised per request shape."""

    __slots__ = ("_memo", "rules", "source")

    def __init__(self, rules: tuple[Rule, ...]) -> None:
        self.source = rules  # kept alive so that the identity cache below can never see a reused id
        self.rules = tuple(CompiledRule(rule) for rule in rules)
        self._memo: dict[str, bool] = {}

    def matches_key(self, key: str, attrs: AdmissionAttributes) -> bool:
        """``matches(attrs)`` where ``key == shape_key(attrs)`` was computed once for the review."""
        verdict = self._memo.get(key)
        if verdict is None:
            verdict = self.matches_resource(
                attrs.operation, attrs.resource, attrs.sub_resource, attrs.namespace
            )
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            self._memo[key] = verdict
        return verdict

    def matches(self, attrs: AdmissionAttributes) -> bool:
        """MAT-03: at least one rule matches the review's own resource."""
        return self.matches_key(shape_key(attrs), attrs)

    def matches_resource(
        self, operation: str, resource: GroupVersionResource, sub_resource: str, namespace: str
    ) -> bool:
        """MAT-03 for an explicit resource (used for MAT-09 equivalents, where the GVR is substituted)."""
        cluster = is_cluster_scoped(resource, namespace)
        return any(rule.matches(operation, resource, sub_resource, cluster) for rule in self.rules)

    def first_equivalent(
        self,
        attrs: AdmissionAttributes,
        equivalents: Iterable[GroupVersionResource],
    ) -> GroupVersionResource | None:
        """MAT-09: rules in order against each equivalent resource (same subresource); first hit wins."""
        # upstream: generic/webhook.go ShouldCallHook tries rule by rule, then equivalent by equivalent
        candidates = sorted(
            (e for e in equivalents if e != attrs.resource),
            key=lambda gvr: (gvr.group, gvr.version, gvr.resource),
        )
        for rule in self.rules:
            for equivalent in candidates:
                cluster = is_cluster_scoped(equivalent, attrs.namespace)
                if rule.matches(attrs.operation, equivalent, attrs.sub_resource, cluster):
                    return equivalent
        return None


# Identity-keyed: hashing a frozen Struct re-hashes every field on each call, which would cost more
# than the match itself. The matcher keeps its rules tuple alive, so an id cannot be reused while cached.
_matchers: dict[int, RulesMatcher] = {}


def rules_matcher(rules: tuple[Rule, ...]) -> RulesMatcher:
    """The compiled, memoising matcher of one rules tuple (built on first use)."""
    matcher = _matchers.get(id(rules))
    if matcher is None or matcher.source is not rules:
        if len(_matchers) >= _CACHE_LIMIT:
            _matchers.clear()
        matcher = RulesMatcher(rules)
        _matchers[id(rules)] = matcher
    return matcher


def rule_matches(rule: Rule, attrs: AdmissionAttributes) -> bool:
    """MAT-03..08 for a single rule (uncached; for tests and diagnostics)."""
    cluster = is_cluster_scoped(attrs.resource, attrs.namespace)
    return CompiledRule(rule).matches(attrs.operation, attrs.resource, attrs.sub_resource, cluster)


def rules_match(rules: tuple[Rule, ...], attrs: AdmissionAttributes) -> bool:
    """MAT-03: a backend's rules match when at least one rule does (an empty tuple never matches)."""
    return rules_matcher(rules).matches(attrs)
