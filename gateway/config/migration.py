"""The marks of a migration gone wrong: the gateway's own registration as a backend, and a parked copy.

``webhook-gateway registration`` emits a Validating/MutatingWebhookConfiguration pair pointing the
apiserver at the gateway. Copied into the gateway's configuration directory (an easy mistake: it is
"just another webhook configuration"), it would make the gateway call itself for every review it
matches, each call another review, until the caller's timeout: every matching request in the
cluster would fail or wait out its full timeout. So a configuration is refused when it carries the
marks of that registration: a webhook named as ``registration`` names the gateway's two webhooks,
the label it puts on them, or a webhook whose ``clientConfig`` points at the gateway's own Service.

Moving a project's webhook behind the gateway ends by *parking* the original registration: a
``matchCondition`` named ``PARKED_CONDITION`` whose expression is ``false`` makes the apiserver skip
it while its owner keeps it (and its ``caBundle``) fresh (docs/migrating.md). A copy in the
gateway's directory that still carries that condition never runs behind the gateway either, which
``check`` warns about (code ``parked``).

Pure; ``gateway.registration`` names its webhooks and label from here, so the two cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from gateway.config import types
from gateway.config.fielderrors import FieldError, child, forbidden, index, key

VALIDATING_WEBHOOK_NAME: Final = "validate.webhook-gateway.io"
MUTATING_WEBHOOK_NAME: Final = "mutate.webhook-gateway.io"
# The -fail/-ignore halves of the validating registration (gateway.registration) count too.
WEBHOOK_NAMES: Final = (
    VALIDATING_WEBHOOK_NAME,
    f"{VALIDATING_WEBHOOK_NAME}-fail",
    f"{VALIDATING_WEBHOOK_NAME}-ignore",
    MUTATING_WEBHOOK_NAME,
)
NAME_LABEL: Final = "app.kubernetes.io/name"
NAME_LABEL_VALUE: Final = "webhook-gateway"
PARKED_CONDITION: Final = "webhook-gateway.io/parked"
CODE_PARKED: Final = "parked"
WARNING_CODES: Final = {
    CODE_PARKED: "a webhook carries the parking matchCondition of an original registration: it never runs",
}

_WHY: Final = (
    "as a backend, the gateway would call itself for every review it matches until the caller's "
    "timeout; keep the output of `webhook-gateway registration` out of the configuration directory "
    "(apply it to the cluster instead)"
)


@dataclass(frozen=True, slots=True)
class GatewayService:
    """Where the gateway itself is reached in the cluster (``registration``'s --namespace/--service)."""

    namespace: str = "webhook-gateway"
    name: str = "webhook-gateway"

    def hosts(self) -> frozenset[str]:
        """The DNS names of the Service a URL could use."""
        base = f"{self.name}.{self.namespace}"
        return frozenset({base, f"{base}.svc", f"{base}.svc.cluster.local"})

    def is_target(self, client_config: types.WebhookClientConfig | None) -> str:
        """The field that points at the gateway (``service`` or ``url``), or ``""``."""
        if client_config is None:
            return ""
        service = client_config.service
        if service is not None and (service.namespace, service.name) == (self.namespace, self.name):
            return "service"
        if client_config.url:
            try:
                host = (urlsplit(client_config.url).hostname or "").rstrip(".").lower()
            except ValueError:
                return ""
            if host in self.hosts():
                return "url"
        return ""


DEFAULT_GATEWAY: Final = GatewayService()


def own_registration_errors(
    config: types.WebhookConfiguration, gateway: GatewayService = DEFAULT_GATEWAY
) -> list[FieldError]:
    """One error per mark of the gateway's own registration found in ``config`` (none: a backend)."""
    errors = []
    labels = (config.metadata.labels if config.metadata else None) or {}
    if labels.get(NAME_LABEL) == NAME_LABEL_VALUE:
        errors.append(
            forbidden(
                key(child("metadata", "labels"), NAME_LABEL),
                "this is the label `webhook-gateway registration` puts on the gateway's own registration: "
                + _WHY,
            )
        )
    for i, hook in enumerate(config.webhooks or ()):
        path = index("webhooks", i)
        if hook.name in WEBHOOK_NAMES:
            errors.append(
                forbidden(
                    child(path, "name"),
                    f"{hook.name} is the gateway's own webhook, as `webhook-gateway registration` names it: "
                    + _WHY,
                )
            )
        elif where := gateway.is_target(hook.client_config):
            target = f"{gateway.namespace}/{gateway.name}"
            errors.append(
                forbidden(
                    child(child(path, "clientConfig"), where),
                    f"points at the gateway's own Service {target}: {_WHY}",
                )
            )
    return errors


def parked_warnings(config: types.WebhookConfiguration) -> list[FieldError]:
    """A warning per webhook that carries the parking condition (copied from a parked original)."""
    found = []
    for i, hook in enumerate(config.webhooks or ()):
        for j, condition in enumerate(hook.match_conditions or ()):
            if condition.name == PARKED_CONDITION:
                found.append(
                    FieldError(
                        index(child(index("webhooks", i), "matchConditions"), j),
                        f"the matchCondition {PARKED_CONDITION} parks an original registration so that the "
                        "apiserver never calls it; in the gateway's copy it means this webhook never runs "
                        "either: remove it from the copy",
                        code=CODE_PARKED,
                    )
                )
    return found
