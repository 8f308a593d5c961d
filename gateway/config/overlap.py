"""Which webhooks can see the same request, and which resources have equivalents — for load warnings.

Both warnings a configuration can earn here must be true to be useful in a CI gate
(``check --warnings-as-errors``):

- GW-05 "timeouts add up": only webhooks that can all match one request share its budget. Two
  webhooks cannot meet when their rules are disjoint, or when one's selector requires a label the
  other's forbids (istio's four sidecar-injector webhooks exclude each other this way).
- MAT-10 ``matchPolicy: Equivalent``: it changes what matches only for resources served under
  several groups or versions. ``EQUIVALENT_RESOURCES`` lists the built-in ones of current
  Kubernetes releases; ``extra`` adds the custom resources a configuration knows about.

The analysis is conservative: when unsure, two webhooks are assumed to overlap.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from gateway.config.model import Rule, Webhook
from gateway.config.selectors import LabelSelector, Requirement

GroupVersion = tuple[str, str]

EQUIVALENT_RESOURCES: Final[dict[str, tuple[GroupVersion, ...]]] = {
    # resource name → every (group, version) a current apiserver serves it under
    "events": (("", "v1"), ("events.k8s.io", "v1")),
    "horizontalpodautoscalers": (("autoscaling", "v1"), ("autoscaling", "v2")),
    "flowschemas": (("flowcontrol.apiserver.k8s.io", "v1"), ("flowcontrol.apiserver.k8s.io", "v1beta3")),
    "prioritylevelconfigurations": (
        ("flowcontrol.apiserver.k8s.io", "v1"),
        ("flowcontrol.apiserver.k8s.io", "v1beta3"),
    ),
    "validatingadmissionpolicies": (
        ("admissionregistration.k8s.io", "v1"),
        ("admissionregistration.k8s.io", "v1beta1"),
    ),
    "validatingadmissionpolicybindings": (
        ("admissionregistration.k8s.io", "v1"),
        ("admissionregistration.k8s.io", "v1beta1"),
    ),
    **dict.fromkeys(
        ("resourceclaims", "resourceclaimtemplates", "deviceclasses", "resourceslices"),
        (("resource.k8s.io", "v1"), ("resource.k8s.io", "v1beta1"), ("resource.k8s.io", "v1beta2")),
    ),
}


def _covers(values: Sequence[str], value: str) -> bool:
    return "*" in values or value in values


def equivalent_gaps(
    api_groups: Sequence[str],
    api_versions: Sequence[str],
    resources: Sequence[str],
    extra: dict[str, tuple[GroupVersion, ...]] | None = None,
) -> list[tuple[str, GroupVersion, GroupVersion]]:
    """For one rule: (resource, a matched group/version, an unmatched equivalent) where Exact and
    Equivalent differ."""
    table = {**EQUIVALENT_RESOURCES, **(extra or {})}
    names = {entry.partition("/")[0] for entry in resources}
    gaps = []
    for resource, served in table.items():
        if "*" not in names and resource not in names:
            continue
        matched = [gv for gv in served if _covers(api_groups, gv[0]) and _covers(api_versions, gv[1])]
        missed = [gv for gv in served if gv not in matched]
        if matched and missed:
            gaps.append((resource, matched[0], missed[0]))
    return gaps


# --- can two webhooks match the same request? ---------------------------------------------------------


def _lists_meet(a: Sequence[str], b: Sequence[str]) -> bool:
    return "*" in a or "*" in b or bool(set(a) & set(b))


def _resources_meet(a: Rule, b: Rule) -> bool:
    for x in a.resources:
        xr, _, xs = x.partition("/")
        for y in b.resources:
            yr, _, ys = y.partition("/")
            # MAT-07: a subresource "*" also matches the main resource
            if ("*" in (xr, yr) or xr == yr) and ("*" in (xs, ys) or xs == ys):
                return True
    return False


def rules_meet(a: Webhook, b: Webhook) -> bool:
    """Some request matches a rule of each (Equivalent webhooks: versions and groups are not compared)."""
    loose = "Equivalent" in (a.match_policy, b.match_policy)
    for ra in a.rules:
        for rb in b.rules:
            if not _lists_meet(ra.operations, rb.operations):
                continue
            if "*" not in (ra.scope, rb.scope) and ra.scope != rb.scope:
                continue
            if not loose and not (
                _lists_meet(ra.api_groups, rb.api_groups) and _lists_meet(ra.api_versions, rb.api_versions)
            ):
                continue
            if _resources_meet(ra, rb):
                return True
    return False


def _contradict(x: Requirement, y: Requirement) -> bool:
    """No label set satisfies both requirements (same key)."""
    ops = {x.operator, y.operator}
    if ops == {"Exists", "DoesNotExist"}:
        return True
    if ops == {"In", "DoesNotExist"}:
        return True
    if x.operator == y.operator == "In":
        return not (x.values & y.values)
    if ops == {"In", "NotIn"}:
        inside, outside = (x, y) if x.operator == "In" else (y, x)
        return inside.values <= outside.values
    return False


def selectors_exclude(a: LabelSelector, b: LabelSelector) -> bool:
    if a.error is not None or b.error is not None:
        return False
    return any(x.key == y.key and _contradict(x, y) for x in a.requirements for y in b.requirements)


def may_meet(a: Webhook, b: Webhook) -> bool:
    """Conservatively: can one request be matched by both webhooks?"""
    if selectors_exclude(a.namespace_selector, b.namespace_selector):
        return False
    if selectors_exclude(a.object_selector, b.object_selector):
        return False
    return rules_meet(a, b)


_EXACT_LIMIT: Final = 24  # beyond this many webhooks, assume they all meet (the sum: conservative)


def worst_request(hooks: Iterable[Webhook]) -> tuple[Webhook, ...]:
    """The webhooks that one request could all match with the largest total timeout."""
    items = list(hooks)
    if len(items) > _EXACT_LIMIT:
        return tuple(items)
    meets = [[may_meet(a, b) for b in items] for a in items]
    best: list[int] = []
    best_total = -1

    def grow(chosen: list[int], candidates: list[int], total: int) -> None:
        nonlocal best, best_total
        if total > best_total:
            best, best_total = list(chosen), total
        remaining = sum(items[c].timeout_seconds for c in candidates)
        if total + remaining <= best_total:
            return
        for pos, c in enumerate(candidates):
            chosen.append(c)
            grow(chosen, [d for d in candidates[pos + 1 :] if meets[c][d]], total + items[c].timeout_seconds)
            chosen.pop()

    grow([], list(range(len(items))), 0)
    return tuple(items[i] for i in sorted(best))
