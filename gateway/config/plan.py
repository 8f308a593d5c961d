"""Match plans: every backend's rules and selectors compiled once, when a Snapshot is built.

A ``MatchPlan`` is what matching needs of one ``Webhook`` in a form that is cheap to test per review:
rules as frozensets (``None`` for a wildcard), selectors as the cheapest equivalent predicates, and
the flags that let matching skip whole stages. ``PlanSet`` holds the plans of one kind in effective
order with an index by (operation, group, resource), so that a review only looks at the backends
whose rules can match it: with 1,000 backends of which 5 match, matching costs about what it costs
with 10.

Everything here is immutable and owned by the Snapshot (no module-level caches); *what* a plan
decides (upstream's precedence, selector errors, CEL) is ``gateway.matching``'s business.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Final, NamedTuple, TypeAlias

from gateway.admission import AdmissionAttributes, GroupVersionResource
from gateway.config.selectors import LabelSelector

if TYPE_CHECKING:
    from gateway.config.model import Rule, Webhook

NAMESPACE_RESOURCE: Final = GroupVersionResource(group="", version="v1", resource="namespaces")
"""The Namespace resource, exactly: the only cluster-scoped resource that carries a namespace (MAT-08)."""

WILDCARD: Final = "*"

LabelPredicate: TypeAlias = Callable[[Mapping[str, str]], bool]


def is_cluster_scoped(resource: GroupVersionResource, namespace: str) -> bool:
    """MAT-08: Namespace objects (any subresource) and requests without a namespace are cluster-scoped."""
    # upstream: predicates/rules/rules.go scope() compares the whole GVR, not just the resource name
    return namespace == "" or resource == NAMESPACE_RESOURCE


def _split_resource(entry: str) -> tuple[str, str]:
    # MAT-06: split at the *first* slash; no slash means "no subresource"
    res, _, sub = entry.partition("/")
    return res, sub


class CompiledRule:
    """One Rule as sets; ``None`` stands for a wildcard list."""

    __slots__ = ("cluster", "entries", "everything", "groups", "namespaced", "operations", "versions")

    def __init__(self, rule: Rule) -> None:
        self.operations = None if WILDCARD in rule.operations else frozenset(rule.operations)
        self.groups = None if WILDCARD in rule.api_groups else frozenset(rule.api_groups)
        self.versions = None if WILDCARD in rule.api_versions else frozenset(rule.api_versions)
        self.entries = frozenset(_split_resource(entry) for entry in rule.resources)
        self.everything = (WILDCARD, WILDCARD) in self.entries
        self.cluster = rule.scope in (WILDCARD, "Cluster")
        self.namespaced = rule.scope in (WILDCARD, "Namespaced")

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
        if self.everything:
            return True
        name, entries = resource.resource, self.entries
        # MAT-07 quirk: sub "*" also accepts the empty subresource, so "pods/*" matches "pods".
        # upstream: predicates/rules/rules.go resource()
        return (
            (name, sub_resource) in entries
            or (name, WILDCARD) in entries
            or (WILDCARD, sub_resource) in entries
        )

    def index_keys(self) -> Iterable[tuple[str, str, str]]:
        """(operation, group, resource) keys this rule can match, ``*`` standing for any."""
        operations = (WILDCARD,) if self.operations is None else tuple(self.operations)
        groups = (WILDCARD,) if self.groups is None else tuple(self.groups)
        names = {res for res, _ in self.entries}
        for op in operations:
            for group in groups:
                for name in names:
                    yield op, group, name


class RulesPlan:
    """A backend's rules, compiled (MAT-03..09)."""

    __slots__ = ("rules",)

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = tuple(CompiledRule(rule) for rule in rules)

    def matches(self, attrs: AdmissionAttributes) -> bool:
        """MAT-03: at least one rule matches the review's own resource (an empty list never does)."""
        return self.matches_resource(attrs.operation, attrs.resource, attrs.sub_resource, attrs.namespace)

    def matches_resource(
        self, operation: str, resource: GroupVersionResource, sub_resource: str, namespace: str
    ) -> bool:
        """MAT-03 for an explicit resource (used for MAT-09 equivalents, where the GVR is substituted)."""
        return self.matches_scoped(operation, resource, sub_resource, is_cluster_scoped(resource, namespace))

    def matches_scoped(
        self, operation: str, resource: GroupVersionResource, sub_resource: str, cluster_scoped: bool
    ) -> bool:
        """MAT-03 with the scope class already worked out (once per review)."""
        for rule in self.rules:  # noqa: SIM110 - a plain loop: no generator per backend per review
            if rule.matches(operation, resource, sub_resource, cluster_scoped):
                return True
        return False

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


def label_predicate(selector: LabelSelector) -> LabelPredicate | None:
    """A selector as the cheapest equivalent callable; None for ``{}`` (MAT-22)."""
    requirements = selector.requirements
    if not requirements:
        return None
    if len(requirements) == 1:
        only = requirements[0]
        if only.operator == "In" and len(only.values) == 1:
            # the common ``matchLabels: {k: v}`` case
            key, (value,) = only.key, tuple(only.values)
            return lambda labels: labels.get(key) == value
        return only.matches
    return selector.matches


class MatchPlan:
    """One backend, prepared once: compiled rules and selectors, and what matching may skip.

    ``namespace_error``/``object_error`` are the texts of selectors that cannot be built (MAT-23);
    ``simple``: no selector and no condition, so matching rules is the whole decision.
    """

    __slots__ = (
        "has_conditions",
        "hook",
        "namespace",
        "namespace_error",
        "needs_namespace",
        "object",
        "object_error",
        "rules",
        "simple",
    )

    def __init__(self, hook: Webhook) -> None:
        self.hook = hook
        self.rules = RulesPlan(hook.rules)
        ns, obj = hook.namespace_selector, hook.object_selector
        self.namespace = label_predicate(ns)
        self.namespace_error = ns.error
        self.needs_namespace = not ns.is_empty  # MAT-12: only these need the namespace's labels
        self.object = label_predicate(obj)
        self.object_error = obj.error
        self.has_conditions = bool(hook.match_conditions)
        self.simple = (
            self.namespace is None
            and self.namespace_error is None
            and self.object is None
            and self.object_error is None
            and not self.has_conditions
        )

    def __repr__(self) -> str:
        return f"<MatchPlan {self.hook.identity}>"


_MEMO_LIMIT: Final = 1024


class PlanSet:
    """The plans of one webhook kind, in effective order (ORD-01), indexed by what rules name.

    ``candidates(attrs)`` answers "whose rules match this request?" from an index by (operation,
    group, resource) and remembers the answer per request shape (operation, group, version, resource,
    subresource, scope class): a bounded memo owned by this immutable set and dropped with its
    Snapshot. A review of a known shape costs one dict lookup, however many backends are configured.
    """

    __slots__ = ("_always", "_index", "_memo", "plans")

    def __init__(self, hooks: Iterable[Webhook]) -> None:
        self.plans = tuple(MatchPlan(hook) for hook in hooks)
        index: dict[tuple[str, str, str], list[int]] = {}
        always: list[int] = []
        for position, plan in enumerate(self.plans):
            if plan.hook.match_policy == "Equivalent":
                # MAT-09: may match through another resource; looked at for every review
                always.append(position)
                continue
            for key in {key for rule in plan.rules.rules for key in rule.index_keys()}:
                index.setdefault(key, []).append(position)
        self._index = {key: tuple(positions) for key, positions in index.items()}
        self._always = tuple(always)
        self._memo: dict[tuple[str, str, str, str, str, bool], tuple[Candidate, ...]] = {}

    def __len__(self) -> int:
        return len(self.plans)

    def __eq__(self, other: object) -> bool:
        # Derived data: two sets are equal when compiled from equal webhooks (keeps Snapshot ==).
        if not isinstance(other, PlanSet):
            return NotImplemented
        return [p.hook for p in self.plans] == [p.hook for p in other.plans]

    __hash__ = None  # type: ignore[assignment]

    def candidates(self, attrs: AdmissionAttributes) -> tuple[Candidate, ...]:
        """In effective order: the plans whose rules match ``attrs`` (``direct=True``), and the
        ``Equivalent`` plans whose rules do not (``direct=False``: they may match through an
        equivalent resource, MAT-09). Every other plan skips by rules."""
        res = attrs.resource
        cluster = is_cluster_scoped(res, attrs.namespace)
        key = (attrs.operation, res.group, res.version, res.resource, attrs.sub_resource, cluster)
        found = self._memo.get(key)
        if found is None:
            found = self._candidates(attrs.operation, res, attrs.sub_resource, cluster)
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            self._memo[key] = found
        return found

    def _candidates(
        self, op: str, res: GroupVersionResource, sub_resource: str, cluster: bool
    ) -> tuple[Candidate, ...]:
        group, name = res.group, res.resource
        get = self._index.get
        positions: set[int] = set(self._always)
        for key in (
            (op, group, name),
            (op, group, WILDCARD),
            (op, WILDCARD, name),
            (op, WILDCARD, WILDCARD),
            (WILDCARD, group, name),
            (WILDCARD, group, WILDCARD),
            (WILDCARD, WILDCARD, name),
            (WILDCARD, WILDCARD, WILDCARD),
        ):
            found = get(key)
            if found:
                positions.update(found)
        out: list[Candidate] = []
        for position in sorted(positions):
            plan = self.plans[position]
            direct = plan.rules.matches_scoped(op, res, sub_resource, cluster)
            if direct or plan.hook.match_policy == "Equivalent":
                out.append(Candidate(plan, direct))
        return tuple(out)


class Candidate(NamedTuple):
    """A plan that may apply to a request; ``direct``: its rules match the request's own resource."""

    plan: MatchPlan
    direct: bool
