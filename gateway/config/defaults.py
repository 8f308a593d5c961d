"""Defaulting per the document's own apiVersion (CFG-03/04, table 1.2), applied before validation.

A field is defaulted only when absent or null (and, for v1beta1 ``admissionReviewVersions``, also
when empty); explicit values are never replaced, so ``port: 0`` or ``timeoutSeconds: 0`` stay and
then fail validation. v1 has no default for ``sideEffects`` and ``admissionReviewVersions`` (CFG-04).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from msgspec.structs import replace

from gateway.config import types

API_GROUP: Final = "admissionregistration.k8s.io"
V1: Final = f"{API_GROUP}/v1"
V1BETA1: Final = f"{API_GROUP}/v1beta1"


@dataclass(frozen=True, slots=True)
class VersionDefaults:
    """The defaults of one API version (``None``: no default)."""

    failure_policy: str
    match_policy: str
    side_effects: str | None
    timeout_seconds: int
    admission_review_versions: tuple[str, ...] | None


# upstream: pkg/apis/admissionregistration/v1/defaults.go, .../v1beta1/defaults.go
DEFAULTS: Final = {
    V1: VersionDefaults("Fail", "Equivalent", None, 10, None),
    V1BETA1: VersionDefaults("Ignore", "Exact", "Unknown", 30, ("v1beta1",)),
}


def _default_rule(rule: types.RuleWithOperations) -> types.RuleWithOperations:
    return rule if rule.scope is not None else replace(rule, scope="*")


def _default_client_config(
    cc: types.WebhookClientConfig | None,
) -> types.WebhookClientConfig | None:
    if cc is None or cc.service is None or cc.service.port is not None:
        return cc
    return replace(cc, service=replace(cc.service, port=443))


def _selector(selector: types.LabelSelector | None) -> types.LabelSelector:
    # MAT-22: a null selector becomes {} (selects everything), never "selects nothing".
    return selector if selector is not None else types.LabelSelector()


def default_webhook(hook: types.ValidatingWebhook, api_version: str) -> types.ValidatingWebhook:
    """One ``webhooks[]`` element with the defaults of ``api_version`` filled in."""
    d = DEFAULTS[api_version]
    versions = hook.admission_review_versions
    if versions is None or (not versions and api_version == V1BETA1):
        versions = d.admission_review_versions
    hook = replace(
        hook,
        client_config=_default_client_config(hook.client_config),
        rules=None if hook.rules is None else tuple(_default_rule(r) for r in hook.rules),
        failure_policy=hook.failure_policy if hook.failure_policy is not None else d.failure_policy,
        match_policy=hook.match_policy if hook.match_policy is not None else d.match_policy,
        namespace_selector=_selector(hook.namespace_selector),
        object_selector=_selector(hook.object_selector),
        side_effects=hook.side_effects if hook.side_effects is not None else d.side_effects,
        timeout_seconds=hook.timeout_seconds if hook.timeout_seconds is not None else d.timeout_seconds,
        admission_review_versions=versions,
    )
    if isinstance(hook, types.MutatingWebhook) and hook.reinvocation_policy is None:
        hook = replace(hook, reinvocation_policy="Never")
    return hook


def default_configuration(config: types.WebhookConfiguration) -> types.WebhookConfiguration:
    """A whole configuration with every webhook defaulted per its own apiVersion."""
    if not config.webhooks or config.api_version not in DEFAULTS:
        return config
    version = config.api_version
    return replace(config, webhooks=tuple(default_webhook(h, version) for h in config.webhooks))
