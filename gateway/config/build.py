"""From validated documents to the internal model (CFG-05) and one ordered Snapshot (ORD-01/03).

Input: configurations that passed validation (``Accepted``), already defaulted. Output: frozen
``Webhook`` values in the effective order of each kind, plus the gateway's own load-time warnings
(MAT-10, GW-05). Nothing here knows which API version a webhook came from, except through the
defaults it was given.
"""

from __future__ import annotations

import base64
import binascii
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, cast

from gateway.config import model, overlap, selectors, types
from gateway.config.backend_policy import PolicyAnnotation, policy_for
from gateway.config.cel import CompiledCondition
from gateway.config.fielderrors import FieldError, child, index, invalid_omitting_value
from gateway.config.trust import CaReference
from gateway.config.validation import selector_build_error
from gateway.errors import ConfigProblem

GATEWAY_TIMEOUT_SECONDS: Final = 30  # the most a caller may give the gateway itself (GW-05)

KIND_NAMES: Final[Mapping[model.WebhookKind, str]] = MappingProxyType(
    {"validating": "ValidatingWebhookConfiguration", "mutating": "MutatingWebhookConfiguration"}
)


@dataclass(frozen=True, slots=True)
class Accepted:
    """One configuration that passed validation, with what validation computed for it."""

    kind: model.WebhookKind
    name: str
    source: str
    config: types.WebhookConfiguration  # defaulted
    conditions: tuple[tuple[CompiledCondition, ...], ...]  # per webhook
    ca_bundles: tuple[bytes, ...]  # per webhook, decoded PEM
    backend_policy: PolicyAnnotation | None = None  # the webhook-gateway.io/backend-policy annotation


# --- caBundle (CFG-17) ---------------------------------------------------------------------------


def decode_ca_bundle(text: str | None, path: str) -> tuple[bytes, FieldError | None, FieldError | None]:
    """Decode a caBundle: ``(pem, error, warning)``.

    Not base64 is an error (the field cannot be decoded at all). [GW] Non-empty data without one
    parseable PEM certificate is only a warning: upstream finds out when calling (TRN-07).
    """
    if not text:
        return b"", None, None
    try:
        # Go's base64 decoder skips CR and LF, as YAML folding may leave them.
        pem = base64.b64decode(text.replace("\r", "").replace("\n", ""), validate=True)
    except (binascii.Error, ValueError) as exc:
        return b"", invalid_omitting_value(path, f"must be base64-encoded: {exc}"), None
    if not pem:
        return b"", None, None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, ssl.SSLError) and exc.reason else str(exc)
        warning = FieldError(
            path,
            f"no parseable PEM certificate ({reason}); calls to this webhook will fail",
        )
        return pem, None, warning
    return pem, None, None


# --- selectors -----------------------------------------------------------------------------------


def compile_selector(selector: types.LabelSelector | None) -> selectors.LabelSelector:
    """A defaulted selector as a compiled ``LabelSelector`` (matchLabels become ``In`` one value)."""
    if selector is None:
        return selectors.EVERYTHING
    if (error := selector_build_error(selector)) is not None:
        return selectors.LabelSelector(error=error)  # only reachable for lax sources (MAT-23)
    requirements = [
        selectors.Requirement(k, "In", frozenset((v,))) for k, v in (selector.match_labels or {}).items()
    ]
    requirements.extend(
        selectors.Requirement(e.key or "", cast(selectors.Operator, e.operator), frozenset(e.values or ()))
        for e in selector.match_expressions or ()
    )
    return selectors.LabelSelector(tuple(requirements)) if requirements else selectors.EVERYTHING


# --- webhooks ------------------------------------------------------------------------------------


def _client_config(
    cc: types.WebhookClientConfig | None, ca_bundle: bytes, ca_from: CaReference | None = None
) -> model.ClientConfig:
    cc = cc or types.WebhookClientConfig()
    service = None
    if cc.service is not None:
        service = model.ServiceReference(
            namespace=cc.service.namespace or "",
            name=cc.service.name or "",
            path=cc.service.path,
            port=cc.service.port if cc.service.port is not None else 443,
        )
    return model.ClientConfig(url=cc.url, service=service, ca_bundle=ca_bundle, ca_from=ca_from)


def _rule(rule: types.RuleWithOperations) -> model.Rule:
    return model.Rule(
        operations=rule.operations or (),
        api_groups=rule.api_groups or (),
        api_versions=rule.api_versions or (),
        resources=rule.resources or (),
        scope=cast(model.Scope, rule.scope or "*"),
    )


def build_webhook(
    hook: types.ValidatingWebhook,
    *,
    accepted: Accepted,
    identity: str,
    position: int,
    conditions: tuple[CompiledCondition, ...],
    ca_bundle: bytes,
) -> model.Webhook:
    """One defaulted, validated ``webhooks[]`` element as the internal model (CFG-05)."""
    reinvocation = hook.reinvocation_policy if isinstance(hook, types.MutatingWebhook) else None
    policy = policy_for(accepted.backend_policy, hook.name or "")
    return model.Webhook(
        name=hook.name or "",
        configuration=accepted.name,
        kind=accepted.kind,
        identity=identity,
        index=position,
        client_config=_client_config(hook.client_config, ca_bundle, policy.ca_from),
        rules=tuple(_rule(r) for r in hook.rules or ()),
        failure_policy=cast(model.FailurePolicy, hook.failure_policy),
        match_policy=cast(model.MatchPolicy, hook.match_policy),
        namespace_selector=compile_selector(hook.namespace_selector),
        object_selector=compile_selector(hook.object_selector),
        side_effects=cast(model.SideEffects, hook.side_effects),
        timeout_seconds=hook.timeout_seconds if hook.timeout_seconds is not None else 10,
        admission_review_versions=hook.admission_review_versions or (),
        reinvocation_policy=cast(model.ReinvocationPolicy, reinvocation or "Never"),
        match_conditions=conditions,
        source=accepted.source,
        backend_policy=policy,
    )


# --- gateway warnings ------------------------------------------------------------------------------


def _gv_text(group: str, version: str) -> str:
    return f"{group}/{version}" if group else version


def equivalent_warnings(
    config: types.WebhookConfiguration, extra: dict[str, tuple[overlap.GroupVersion, ...]] | None = None
) -> list[FieldError]:
    """MAT-10: an ``Equivalent`` backend is matched Exact; warn where that changes what matches —
    a rule that reaches a resource in one group/version but not in another one it is served under
    (the built-in list, plus ``extra``: the multi-version CRDs of the configuration)."""
    warnings = []
    for i, hook in enumerate(config.webhooks or ()):
        if hook.match_policy != "Equivalent":
            continue
        for j, r in enumerate(hook.rules or ()):
            gaps = overlap.equivalent_gaps(
                r.api_groups or (), r.api_versions or (), r.resources or (), extra=extra
            )
            if not gaps:
                continue
            resource, (group, version), (other_group, other_version) = gaps[0]
            warnings.append(
                FieldError(
                    child(index("webhooks", i), "matchPolicy"),
                    "Equivalent is matched as Exact: the gateway cannot convert objects between versions, "
                    f"so requests for {resource} in {_gv_text(other_group, other_version)} will not reach "
                    f"this webhook (rules[{j}] matches it only in {_gv_text(group, version)}); list every "
                    "group/version in the rule, or set matchPolicy: Exact",
                )
            )
            break
    return warnings


def chain_timeout_warning(mutating: Iterable[model.Webhook], origin: str) -> ConfigProblem | None:
    """GW-05: the timeouts of mutating webhooks that one request can meet should fit in the gateway's
    own (at most 30 s); webhooks that exclude each other (rules or selectors) never add up."""
    hooks = overlap.worst_request(mutating)
    total = sum(h.timeout_seconds for h in hooks)
    if total <= GATEWAY_TIMEOUT_SECONDS:
        return None
    names = ", ".join(h.name for h in hooks)
    return ConfigProblem(
        file=origin,
        message=(
            f"the timeouts of the {len(hooks)} mutating webhooks that one request can match add up to "
            f"{total}s, more than the {GATEWAY_TIMEOUT_SECONDS}s a caller can give the gateway: webhooks "
            f"late in the chain may time out (GW-05; {names})"
        ),
        severity="warning",
    )


# --- the snapshot --------------------------------------------------------------------------------


def build_snapshot(
    accepted: Iterable[Accepted],
    namespaces: Mapping[str, Mapping[str, str]],
    *,
    warnings: Iterable[ConfigProblem],
    origin: str,
    generation: int,
) -> model.Snapshot:
    """ORD-01/03: configurations sorted by name (bytewise), webhooks in array order, per kind."""
    by_kind: dict[model.WebhookKind, list[Accepted]] = {"validating": [], "mutating": []}
    for a in accepted:
        by_kind[a.kind].append(a)
    effective: dict[model.WebhookKind, list[model.Webhook]] = {"validating": [], "mutating": []}
    configurations: dict[tuple[model.WebhookKind, str], tuple[model.Webhook, ...]] = {}
    for kind, items in by_kind.items():
        for a in sorted(items, key=lambda a: a.name.encode()):
            seen: dict[str, int] = {}
            built = []
            for i, hook in enumerate(a.config.webhooks or ()):
                name = hook.name or ""
                k = seen.get(name, 0)
                seen[name] = k + 1
                webhook = build_webhook(
                    hook,
                    accepted=a,
                    identity=f"{a.name}/{name}/{k}",
                    position=len(effective[kind]),
                    conditions=a.conditions[i],
                    ca_bundle=a.ca_bundles[i],
                )
                effective[kind].append(webhook)
                built.append(webhook)
            configurations[(kind, a.name)] = tuple(built)
    all_warnings = list(warnings)
    if (late := chain_timeout_warning(effective["mutating"], origin)) is not None:
        all_warnings.append(late)
    return model.Snapshot(
        validating=tuple(effective["validating"]),
        mutating=tuple(effective["mutating"]),
        configurations=MappingProxyType(configurations),
        namespaces=MappingProxyType({n: MappingProxyType(dict(labels)) for n, labels in namespaces.items()}),
        generation=generation,
        warnings=tuple(all_warnings),
    )
