"""Realistic Pod AdmissionReviews, pre-encoded once with a uid placeholder patched per request.

The Pod comes from ``fixtures/pod.json`` (a Deployment-made pod with an init container, a sidecar,
probes, projected token volume); it is trimmed or grown with environment variables to reach a review
size. CREATE reviews carry one object; UPDATE reviews carry object and oldObject, each half the size.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import msgspec

_PLACEHOLDER = "@@LOADTEST-UID@@"
SLOW_LABEL = "loadtest.webhook-gateway.dev/slow"
_encode = msgspec.json.encode


def base_pod() -> dict[str, Any]:
    """The fixture Pod as a fresh dict."""
    doc: dict[str, Any] = json.loads(resources.files("loadtests").joinpath("fixtures/pod.json").read_text())
    return doc


def _size(doc: Any) -> int:
    return len(_encode(doc))


def pod_of_size(target: int, *, name: str = "", labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Pod whose compact JSON is close to ``target`` bytes (never below the smallest trim)."""
    pod = base_pod()
    pod["metadata"]["name"] = name
    if labels:
        pod["metadata"]["labels"].update(labels)
    spec = pod["spec"]
    main = spec["containers"][0]
    # Trim optional parts, least essential first, until the pod is small enough.
    trims: list[Callable[[], object]] = [
        lambda: spec.pop("initContainers", None),
        lambda: spec.pop("affinity", None),
        lambda: spec.pop("tolerations", None),
        lambda: spec["containers"].pop() if len(spec["containers"]) > 1 else None,
        lambda: (main.pop("livenessProbe", None), main.pop("readinessProbe", None)),
        lambda: pod["metadata"].pop("annotations", None),
        lambda: (spec.pop("volumes", None), main.pop("volumeMounts", None)),
        lambda: main.__setitem__("env", main["env"][:2]),
    ]
    for trim in trims:
        if _size(pod) <= target:
            break
        trim()
    k = 0
    while _size(pod) < target - 60:
        main["env"].append(
            {"name": f"FEATURE_FLAG_{k:03d}", "value": f"enabled-for-cohort-{k % 7}-rollout-{k:04d}"}
        )
        k += 1
    return pod


@dataclass(frozen=True)
class ReviewTemplate:
    """One pre-encoded review: ``body(uid)`` splices a uid into the cached bytes."""

    prefix: bytes
    suffix: bytes
    api_version: str
    operation: str
    cls: str  # latency class: "fast", or "slow" for reviews the slow backend selects
    obj: dict[str, Any] = field(repr=False, compare=False)

    def body(self, uid: str) -> bytes:
        return self.prefix + uid.encode() + self.suffix

    @property
    def size(self) -> int:
        return len(self.prefix) + len(self.suffix) + 36


def review(
    operation: str, obj: dict[str, Any], old: dict[str, Any] | None, version: str, uid: str
) -> dict[str, Any]:
    """The AdmissionReview kube-apiserver sends for a Pod ``operation``."""
    options_kind = "CreateOptions" if operation == "CREATE" else "UpdateOptions"
    return {
        "apiVersion": f"admission.k8s.io/{version}",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": obj["metadata"].get("name", ""),
            "namespace": obj["metadata"].get("namespace", ""),
            "operation": operation,
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "uid": "0b6f7a8e-3c2d-4e1f-9a8b-7c6d5e4f3a2b",
                "groups": [
                    "system:serviceaccounts",
                    "system:serviceaccounts:kube-system",
                    "system:authenticated",
                ],
            },
            "object": obj,
            "oldObject": old,
            "dryRun": False,
            "options": {
                "apiVersion": "meta.k8s.io/v1",
                "kind": options_kind,
                "fieldManager": "kube-controller-manager",
            },
        },
    }


def make_template(doc: dict[str, Any], cls: str) -> ReviewTemplate:
    """Pre-encode ``doc`` (whose request.uid is the placeholder) into a template."""
    raw = _encode(doc)
    prefix, _, suffix = raw.partition(_PLACEHOLDER.encode())
    return ReviewTemplate(
        prefix, suffix, doc["apiVersion"], doc["request"]["operation"], cls, doc["request"]["object"]
    )


def review_templates(size_kb: float = 8, version: str = "v1", *, slow: bool = False) -> list[ReviewTemplate]:
    """A CREATE and an UPDATE review of about ``size_kb`` KB each (class "slow" when ``slow``)."""
    labels = {SLOW_LABEL: "true"} if slow else None
    cls = "slow" if slow else "fast"
    target = int(size_kb * 1024)
    envelope = _size(review("CREATE", {"metadata": {}}, None, version, _PLACEHOLDER))
    created = pod_of_size(target - envelope, labels=labels)
    half = (target - envelope) // 2
    new = pod_of_size(half, name="checkout-7d9f8c6b5-x2x9z", labels=labels)
    old = copy.deepcopy(new)
    old["metadata"]["labels"]["app.kubernetes.io/version"] = "2.14.2"
    new["metadata"]["resourceVersion"] = "48213"
    old["metadata"]["resourceVersion"] = "48190"
    return [
        make_template(review("CREATE", created, None, version, _PLACEHOLDER), cls),
        make_template(review("UPDATE", new, old, version, _PLACEHOLDER), cls),
    ]


def with_labels(template: ReviewTemplate, labels: dict[str, str]) -> ReviewTemplate:
    """The same review with ``labels`` added to the object (what validating backends see after mutation)."""
    doc = json.loads(template.body(_PLACEHOLDER))
    doc["request"]["object"]["metadata"].setdefault("labels", {}).update(labels)
    return make_template(doc, template.cls)
