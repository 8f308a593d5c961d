"""namespaceSelector and exemptions through the real gateway, file mode (GW-01, MAT-11..16, MAT-31/32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.gateway import Expect, backend, pod, review, run_scenario

PAYMENTS = {"matchLabels": {"team": "payments"}}
NAMESPACES = {"shop": {"team": "payments"}, "blog": {"team": "content"}}

SCENARIOS: list[Any] = [
    pytest.param(
        review(),
        (),
        Expect(allowed=False, calls=1),
        id="MAT-13: a Pod in a namespace whose labels match is sent to the backend",
    ),
    pytest.param(
        review(pod(namespace="blog"), namespace="blog"),
        (),
        Expect(allowed=True, calls=0),
        id="MAT-13: a Pod in a namespace whose labels do not match is not sent",
    ),
    pytest.param(
        review(pod(namespace="nowhere"), namespace="nowhere"),
        (),
        Expect(allowed=False, code=404, reason="NotFound", message='namespaces "nowhere" not found', calls=0),
        id="MAT-16: an unknown namespace turns the review into 404 when rules match",
    ),
    pytest.param(
        review(pod(namespace="nowhere"), namespace="nowhere"),
        ("--unknown-namespace", "emptyLabels"),
        Expect(allowed=True, calls=0),
        id="GW-01: with unknownNamespace emptyLabels an unknown namespace has no labels",
    ),
    pytest.param(
        review(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": "new", "labels": {"team": "payments"}},
            },
            namespace="new",
            resource=("", "v1", "namespaces"),
            kind=("", "v1", "Namespace"),
        ),
        (),
        Expect(allowed=False, calls=1),
        id="MAT-13: a Namespace CREATE is matched on its own labels",
    ),
    pytest.param(
        review(
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}},
            namespace="",
            resource=("", "v1", "nodes"),
            kind=("", "v1", "Node"),
        ),
        (),
        Expect(allowed=False, calls=1),
        id="MAT-11: a cluster-scoped object other than a Namespace always passes the namespaceSelector",
    ),
    pytest.param(
        review(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": "x"},
            },
            namespace="",
            resource=("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations"),
            kind=("admissionregistration.k8s.io", "v1", "ValidatingWebhookConfiguration"),
        ),
        (),
        Expect(allowed=True, calls=0),
        id="MAT-31: reviews of webhook configurations never reach a backend",
    ),
]


@pytest.mark.parametrize(("doc", "args", "expect"), SCENARIOS)
async def test_namespace_selector(
    nursery: trio.Nursery, tmp_path: Path, doc: dict[str, Any], args: tuple[str, ...], expect: Expect
) -> None:
    """Namespace labels come from the Namespace objects in the configuration directory."""
    hooks = {"a": [backend("teams.example.com", "/deny", namespaceSelector=PAYMENTS)]}
    outcome = await run_scenario(
        nursery, tmp_path, validating=hooks, namespaces=NAMESPACES, doc=doc, gateway_args=args
    )
    expect.check(outcome)
