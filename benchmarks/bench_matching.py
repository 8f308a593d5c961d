"""Matching cost per review: which of 50 configured backends apply to an 8 KB Pod review.

Run: /work/venv/bin/python -m pytest benchmarks/bench_matching.py --benchmark-only
Each round builds fresh AdmissionAttributes, so decoding the object's labels (the only part of the
object selectors read) is included; the namespace labels are already looked up, as the dispatcher does.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.admission import AdmissionAttributes, GroupVersionKind, GroupVersionResource
from gateway.config.model import Webhook
from gateway.config.plan import PlanSet
from gateway.matching import Call, ConditionInputs, decide_all, decide_candidates, namespace_to_look_up
from tests.matching_support import hook, rule, selector


def pod_bytes(target: int = 8192) -> bytes:
    """A plausible Pod of about ``target`` bytes (containers with env, volumes, status)."""
    containers: list[dict[str, Any]] = []
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "web-7d9f8b6c5-x2x7q",
            "generateName": "web-7d9f8b6c5-",
            "namespace": "team-a",
            "uid": "0b7a3c1e-1f7e-4c43-9a55-6f0d5c1b2a11",
            "labels": {"app": "web", "tier": "frontend", "pod-template-hash": "7d9f8b6c5", "team": "a"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-07-01T10:00:00Z"},
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f8b6c5", "uid": "x"}
            ],
        },
        "spec": {"containers": containers, "volumes": [], "nodeName": "node-1", "serviceAccountName": "web"},
        "status": {"phase": "Pending"},
    }
    i = 0
    while len(msgspec.json.encode(doc)) < target:
        containers.append(
            {
                "name": f"c{i}",
                "image": f"registry.example.com/team-a/web-{i}:1.2.3",
                "env": [{"name": f"VAR_{i}_{j}", "value": "x" * 20} for j in range(6)],
                "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}, "requests": {"cpu": "100m"}},
                "ports": [{"containerPort": 8080 + i, "protocol": "TCP"}],
            }
        )
        i += 1
    return msgspec.json.encode(doc)


POD = msgspec.Raw(pod_bytes())


def backends() -> list[Webhook]:
    """50 backends: a mix of rules, namespace and object selectors, matching and not."""
    hooks: list[Webhook] = []
    for i in range(50):
        kind = i % 5
        if kind == 0:  # pods, any operation, no selectors
            h = hook(f"h{i}.example.com", rules=(rule(resources=("pods",)),), index=i)
        elif kind == 1:  # deployments only: skipped by rules
            h = hook(
                f"h{i}.example.com", rules=(rule(groups=("apps",), resources=("deployments",)),), index=i
            )
        elif kind == 2:  # namespace selector
            h = hook(
                f"h{i}.example.com", namespace_selector=selector({"team": "a" if i % 2 else "b"}), index=i
            )
        elif kind == 3:  # object selector on the pod's labels
            h = hook(
                f"h{i}.example.com",
                rules=(
                    rule(
                        operations=("CREATE", "UPDATE"),
                        groups=("",),
                        versions=("v1",),
                        resources=("pods", "pods/*"),
                    ),
                ),
                object_selector=selector({"app": "web"}, ("tier", "NotIn", ("db",))),
                index=i,
            )
        else:  # several rules, the last one matching; both selectors
            h = hook(
                f"h{i}.example.com",
                rules=(
                    rule(resources=("services",)),
                    rule(resources=("configmaps",)),
                    rule(resources=("*/*",), scope="Namespaced"),
                ),
                namespace_selector=selector(None, ("env", "DoesNotExist", ())),
                object_selector=selector(None, ("app", "Exists", ())),
                index=i,
            )
        hooks.append(h)
    return hooks


HOOKS = backends()
PLANS = PlanSet(HOOKS)  # compiled once, as the Snapshot does
NAMESPACE_LABELS = {"team": "a", "kubernetes.io/metadata.name": "team-a"}


def review() -> AdmissionAttributes:
    return AdmissionAttributes(
        uid="705ab4f5-6393-11e8-b7cc-42010a800002",
        operation="CREATE",
        kind=GroupVersionKind(group="", version="v1", kind="Pod"),
        resource=GroupVersionResource(group="", version="v1", resource="pods"),
        name="web-7d9f8b6c5-x2x7q",
        namespace="team-a",
        object=POD,
    )


def match_one_review() -> int:
    attrs = review()
    decisions = decide_all(PLANS, attrs, NAMESPACE_LABELS)
    return sum(isinstance(d, Call) for d in decisions)


def test_pod_size() -> None:
    """The review object is the advertised size."""
    assert 8000 <= len(POD) <= 9000


def test_fifty_backends(benchmark: Any) -> None:
    """50 backends, one 8 KB Pod review: target under 50 µs per review."""
    called = benchmark(match_one_review)
    assert called == 35


def test_lookup_decision(benchmark: Any) -> None:
    """Deciding which namespace to look up for the same 50 backends."""
    assert benchmark(lambda: namespace_to_look_up(review(), PLANS.plans)) == "team-a"


def scale(total: int, matching: int = 5) -> PlanSet:
    """``total`` backends of which ``matching`` apply to the Pod review; the rest name other resources."""
    hooks = [
        hook(f"pods{i}.example.com", rules=(rule(resources=("pods",)),), index=i) for i in range(matching)
    ]
    hooks += [
        hook(
            f"crd{i}.example.com",
            rules=(rule(groups=(f"g{i}.example.com",), resources=(f"things{i}",)),),
            index=matching + i,
        )
        for i in range(total - matching)
    ]
    return PlanSet(hooks)


@pytest.mark.parametrize("total", [10, 1000])
def test_many_backends_few_matching(benchmark: Any, total: int) -> None:
    """Issue 15's scale target: 1,000 backends with 5 matching within 2x of 10 with 5 matching."""
    plans = scale(total)

    def run() -> int:
        attrs = review()
        decided = decide_candidates(plans.candidates(attrs), attrs, NAMESPACE_LABELS)
        return sum(isinstance(d, Call) for _, d in decided)

    assert benchmark(run) == 5


@pytest.mark.parametrize("count", [1])
def test_one_backend_with_conditions(benchmark: Any, count: int) -> None:
    """For scale: one backend with two CEL conditions (decoding the 8 KB object for CEL included)."""
    from tests.matching_support import conditions

    h = hook(
        "cel.example.com",
        match_conditions=conditions(
            ("not-system", '!request.namespace.startsWith("kube-")'),
            ("has-web", 'object.metadata.labels.app == "web"'),
        ),
    )

    def run() -> bool:
        return isinstance(
            decide_all([h] * count, review(), NAMESPACE_LABELS, inputs=ConditionInputs())[0], Call
        )

    assert benchmark(run)
