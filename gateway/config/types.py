"""The configuration documents as written: admissionregistration.k8s.io objects and v1 Namespace.

These Structs mirror the wire schema field for field (both API versions share it). They are the
single source of the field sets: ``schema`` derives the unknown-field and type checks from them, and
every field is optional (``None`` = absent or null) so that defaulting (CFG-03) and validation
(CFG-06..22) can tell "absent" from "explicitly set". Nothing here is defaulted or validated yet.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class Base(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """Wire names are camelCase; every field may be absent."""


class ObjectMeta(Base, frozen=True):
    """metav1.ObjectMeta: every field ``kubectl get -o yaml`` may print, so none of them warns."""

    name: str | None = None
    generate_name: str | None = None
    namespace: str | None = None
    self_link: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: Int64 | None = None
    creation_timestamp: object = None
    deletion_timestamp: object = None
    deletion_grace_period_seconds: Int64 | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    owner_references: tuple[object, ...] | None = None
    finalizers: tuple[str, ...] | None = None
    managed_fields: tuple[object, ...] | None = None
    cluster_name: str | None = None  # removed in 1.25; still printed by older clusters


class ServiceReference(Base, frozen=True):
    """admissionregistration ServiceReference: ``{namespace, name, path, port}``."""

    namespace: str | None = None
    name: str | None = None
    path: str | None = None
    port: Int32 | None = None


class WebhookClientConfig(Base, frozen=True):
    """``clientConfig``: ``url`` or ``service``, and a base64 ``caBundle``."""

    url: str | None = None
    service: ServiceReference | None = None
    ca_bundle: str | None = None  # base64 on the wire


class RuleWithOperations(Base, frozen=True):
    """One ``rules[]`` entry."""

    operations: tuple[str, ...] | None = None
    api_groups: tuple[str, ...] | None = None
    api_versions: tuple[str, ...] | None = None
    resources: tuple[str, ...] | None = None
    scope: str | None = None


class LabelSelectorRequirement(Base, frozen=True):
    """One ``matchExpressions[]`` entry."""

    key: str | None = None
    operator: str | None = None
    values: tuple[str, ...] | None = None


class LabelSelector(Base, frozen=True):
    """metav1.LabelSelector."""

    match_labels: dict[str, str] | None = None
    match_expressions: tuple[LabelSelectorRequirement, ...] | None = None


class MatchCondition(Base, frozen=True):
    """One ``matchConditions[]`` entry (CEL)."""

    name: str | None = None
    expression: str | None = None


class ValidatingWebhook(Base, frozen=True):
    """One ``webhooks[]`` element of a ValidatingWebhookConfiguration."""

    name: str | None = None
    client_config: WebhookClientConfig | None = None
    rules: tuple[RuleWithOperations, ...] | None = None
    failure_policy: str | None = None
    match_policy: str | None = None
    namespace_selector: LabelSelector | None = None
    object_selector: LabelSelector | None = None
    side_effects: str | None = None
    timeout_seconds: Int32 | None = None
    admission_review_versions: tuple[str, ...] | None = None
    match_conditions: tuple[MatchCondition, ...] | None = None


class MutatingWebhook(ValidatingWebhook, frozen=True):
    """One ``webhooks[]`` element of a MutatingWebhookConfiguration (adds reinvocationPolicy)."""

    reinvocation_policy: str | None = None


class ValidatingWebhookConfiguration(Base, frozen=True):
    """A ValidatingWebhookConfiguration document (v1 or v1beta1)."""

    api_version: str | None = None
    kind: str | None = None
    metadata: ObjectMeta | None = None
    webhooks: tuple[ValidatingWebhook, ...] | None = None


class MutatingWebhookConfiguration(Base, frozen=True):
    """A MutatingWebhookConfiguration document (v1 or v1beta1)."""

    api_version: str | None = None
    kind: str | None = None
    metadata: ObjectMeta | None = None
    webhooks: tuple[MutatingWebhook, ...] | None = None


class Namespace(Base, frozen=True):
    """A v1 Namespace: only its name and labels matter (file mode, GW-01)."""

    api_version: str | None = None
    kind: str | None = None
    metadata: ObjectMeta | None = None
    spec: object = None
    status: object = None


WebhookConfiguration = ValidatingWebhookConfiguration | MutatingWebhookConfiguration
