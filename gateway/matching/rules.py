"""Rule matching (MAT-03..08): does a request's operation and resource fall under a backend's rules?

First stage of ``gateway.matching``: the cheapest predicate, so ``invocation`` evaluates it before the
selectors (the observable outcome still follows upstream's order, MAT-01/02). Rules are compiled into
frozensets once, when the Snapshot is built (``gateway.config.plan``); the helpers here compile on
the spot and exist for tests and diagnostics.
"""

from __future__ import annotations

from gateway.admission import AdmissionAttributes
from gateway.config.model import Rule
from gateway.config.plan import NAMESPACE_RESOURCE, CompiledRule, RulesPlan, is_cluster_scoped

__all__ = [
    "NAMESPACE_RESOURCE",
    "CompiledRule",
    "RulesPlan",
    "is_cluster_scoped",
    "rule_matches",
    "rules_match",
]


def rule_matches(rule: Rule, attrs: AdmissionAttributes) -> bool:
    """MAT-03..08 for a single rule."""
    cluster = is_cluster_scoped(attrs.resource, attrs.namespace)
    return CompiledRule(rule).matches(attrs.operation, attrs.resource, attrs.sub_resource, cluster)


def rules_match(rules: tuple[Rule, ...], attrs: AdmissionAttributes) -> bool:
    """MAT-03: a backend's rules match when at least one rule does (an empty tuple never matches)."""
    return RulesPlan(rules).matches(attrs)
