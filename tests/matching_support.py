"""Builders for the matching tests: real ``Webhook`` and ``AdmissionAttributes`` values, nothing faked."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.admission import AdmissionAttributes, GroupVersionKind, GroupVersionResource
from gateway.config.cel import CompiledCondition, compile_condition
from gateway.config.model import ClientConfig, FailurePolicy, MatchPolicy, Rule, Scope, Webhook
from gateway.config.selectors import EVERYTHING, LabelSelector, Operator, Requirement

ALL = Rule(operations=("*",), api_groups=("*",), api_versions=("*",), resources=("*/*",))


def rule(
    operations: tuple[str, ...] = ("*",),
    groups: tuple[str, ...] = ("*",),
    versions: tuple[str, ...] = ("*",),
    resources: tuple[str, ...] = ("*/*",),
    scope: Scope = "*",
) -> Rule:
    """A rule that is a wildcard in every field not given."""
    return Rule(
        operations=operations, api_groups=groups, api_versions=versions, resources=resources, scope=scope
    )


def selector(
    match_labels: dict[str, str] | None = None, *expressions: tuple[str, Operator, tuple[str, ...]]
) -> LabelSelector:
    """A compiled selector: matchLabels become In requirements, as the loader compiles them."""
    reqs = [Requirement(k, "In", frozenset({v})) for k, v in (match_labels or {}).items()]
    reqs += [Requirement(k, op, frozenset(values)) for k, op, values in expressions]
    return LabelSelector(requirements=tuple(reqs))


def broken_selector(error: str = 'values[0][env]: Invalid value: "a b": bad') -> LabelSelector:
    """A selector that could not be built (CFG-24 lax source)."""
    return LabelSelector(error=error)


def conditions(*pairs: tuple[str, str]) -> tuple[CompiledCondition, ...]:
    return tuple(compile_condition(name, expression) for name, expression in pairs)


def hook(
    name: str = "hook.example.com",
    *,
    rules: tuple[Rule, ...] = (ALL,),
    namespace_selector: LabelSelector = EVERYTHING,
    object_selector: LabelSelector = EVERYTHING,
    match_policy: MatchPolicy = "Exact",
    failure_policy: FailurePolicy = "Fail",
    match_conditions: tuple[CompiledCondition, ...] = (),
    index: int = 0,
) -> Webhook:
    """A validating backend with every default applied."""
    return Webhook(
        name=name,
        configuration="config",
        kind="validating",
        identity=f"config/{name}/0",
        index=index,
        client_config=ClientConfig(url="https://backend.example.com/validate"),
        rules=rules,
        failure_policy=failure_policy,
        match_policy=match_policy,
        namespace_selector=namespace_selector,
        object_selector=object_selector,
        side_effects="None",
        timeout_seconds=10,
        admission_review_versions=("v1",),
        match_conditions=match_conditions,
    )


def raw(doc: Any) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(doc))


def obj(labels: dict[str, str] | None = None, **metadata: Any) -> msgspec.Raw:
    """An object with metadata (and labels, when given)."""
    meta = dict(metadata)
    if labels is not None:
        meta["labels"] = labels
    return raw({"apiVersion": "v1", "kind": "Pod", "metadata": meta})


def attrs(
    operation: str = "CREATE",
    group: str = "",
    version: str = "v1",
    resource: str = "pods",
    sub_resource: str = "",
    *,
    namespace: str = "ns",
    name: str = "name",
    object: msgspec.Raw | None = None,
    old_object: msgspec.Raw | None = None,
    kind: GroupVersionKind | None = None,
    dry_run: bool = False,
) -> AdmissionAttributes:
    """Review attributes; the kind defaults to ``k<resource>`` as in upstream's rules_test."""
    return AdmissionAttributes(
        uid="uid-1",
        operation=operation,
        kind=kind or GroupVersionKind(group=group, version=version, kind="k" + resource),
        resource=GroupVersionResource(group=group, version=version, resource=resource),
        sub_resource=sub_resource,
        name=name,
        namespace=namespace,
        object=object,
        old_object=old_object,
        dry_run=dry_run,
    )
