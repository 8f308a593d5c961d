"""The internal model of backend webhooks, after defaulting and validation (CFG-05).

Both ``admissionregistration.k8s.io`` versions load into these frozen Structs; nothing at request
time knows which version a webhook came from. A ``Snapshot`` is one immutable, ordered view of the
whole configuration; it is swapped whole on reload (CFG-25, ORD-04).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

import msgspec

from gateway.config.backend_policy import DEFAULT_POLICY, BackendPolicy
from gateway.config.cel import CompiledCondition
from gateway.config.plan import PlanSet
from gateway.config.selectors import LabelSelector
from gateway.config.trust import CaReference
from gateway.errors import ConfigProblem

WebhookKind = Literal["validating", "mutating"]
FailurePolicy = Literal["Fail", "Ignore"]
MatchPolicy = Literal["Exact", "Equivalent"]
SideEffects = Literal["None", "NoneOnDryRun", "Some", "Unknown"]
ReinvocationPolicy = Literal["Never", "IfNeeded"]
Scope = Literal["Cluster", "Namespaced", "*"]

SUPPORTED_REVIEW_VERSIONS: Final = ("v1", "v1beta1")


class Rule(msgspec.Struct, frozen=True, kw_only=True):
    """One ``rules[]`` entry (RuleWithOperations), validated (CFG-18/19)."""

    operations: tuple[str, ...]
    api_groups: tuple[str, ...]
    api_versions: tuple[str, ...]
    resources: tuple[str, ...]
    scope: Scope = "*"


class ServiceReference(msgspec.Struct, frozen=True, kw_only=True):
    namespace: str
    name: str
    path: str | None = None
    port: int = 443


class ClientConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how to call a backend: exactly one of ``url`` and ``service`` (CFG-13).

    ``ca_bundle`` is the decoded PEM bytes (``b""`` when absent: system roots, TRN-06). ``ca_from``,
    when set (the backend-policy annotation's ``caFrom``), is where the CA bundle is read instead:
    the static ``ca_bundle`` is then not used.
    """

    url: str | None = None
    service: ServiceReference | None = None
    ca_bundle: bytes = b""
    ca_from: CaReference | None = None


class Webhook(msgspec.Struct, frozen=True, kw_only=True):
    """One backend: an element of ``webhooks[]`` with every default applied.

    ``identity`` is ORD-03's ``<configuration>/<name>/<k>``; ``index`` is the position in the
    effective list of its kind (ORD-01), used for annotations (ORD-05) and deterministic ordering.
    """

    name: str
    configuration: str
    kind: WebhookKind
    identity: str
    index: int
    client_config: ClientConfig
    rules: tuple[Rule, ...]
    failure_policy: FailurePolicy
    match_policy: MatchPolicy
    namespace_selector: LabelSelector
    object_selector: LabelSelector
    side_effects: SideEffects
    timeout_seconds: int
    admission_review_versions: tuple[str, ...]
    reinvocation_policy: ReinvocationPolicy = "Never"
    match_conditions: tuple[CompiledCondition, ...] = ()
    source: str = ""  # the file (or cluster object) it was loaded from, for messages
    backend_policy: BackendPolicy = DEFAULT_POLICY  # the webhook-gateway.io/backend-policy annotation


class ConversionEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One CRD's conversion backend (CNV-01/02): where to call it and how the gateway treats it.

    ``versions`` are the CRD's version names (bounded metric labels); ``cache_identity`` changes
    whenever the client config, the review versions or the cache-generation annotation change, so
    cached conversions of an older entry are never served.
    """

    crd_name: str
    group: str = ""
    kind: str = ""
    versions: tuple[str, ...] = ()
    client_config: ClientConfig
    conversion_review_versions: tuple[str, ...]
    timeout_seconds: float = 30.0
    cache: bool = False
    cache_identity: str = ""
    source: str = ""


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One immutable, ordered configuration (ORD-01): what a review sees from start to end (ORD-04).

    ``validating``/``mutating`` are the effective lists; ``configurations`` maps
    ``(kind, metadata.name)`` to that configuration's webhooks in array order. ``namespaces`` holds
    the labels of ``Namespace`` objects found in the configuration sources (file mode, GW-01).
    ``plans(kind)`` is every webhook's match plan, compiled when the snapshot is constructed.
    """

    validating: tuple[Webhook, ...] = ()
    mutating: tuple[Webhook, ...] = ()
    configurations: Mapping[tuple[WebhookKind, str], tuple[Webhook, ...]] = msgspec.field(
        default_factory=dict
    )
    namespaces: Mapping[str, Mapping[str, str]] = msgspec.field(default_factory=dict)
    generation: int = 0
    warnings: tuple[ConfigProblem, ...] = ()
    conversions: Mapping[str, ConversionEntry] = msgspec.field(default_factory=dict)  # by CRD name

    # Compiled in __post_init__ from the lists above; never given by callers.
    validating_plans: PlanSet | None = None
    mutating_plans: PlanSet | None = None

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "validating_plans", PlanSet(self.validating))
        msgspec.structs.force_setattr(self, "mutating_plans", PlanSet(self.mutating))

    def webhooks(self, kind: WebhookKind) -> tuple[Webhook, ...]:
        return self.validating if kind == "validating" else self.mutating

    def plans(self, kind: WebhookKind) -> PlanSet:
        """The match plans of ``kind``, aligned with ``webhooks(kind)``."""
        plans = self.validating_plans if kind == "validating" else self.mutating_plans
        assert plans is not None  # set in __post_init__
        return plans

    def __repr__(self) -> str:
        return (
            f"<Snapshot generation={self.generation} validating={len(self.validating)}"
            f" mutating={len(self.mutating)} namespaces={len(self.namespaces)}>"
        )
