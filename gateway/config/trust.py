"""Where a backend's CA bundle comes from, and what ``check`` says about the CA a backend is given.

Most real webhooks have no static ``caBundle``: their owner keeps the CA fresh somewhere in the
cluster (cert-manager's cainjector and istiod patch the live webhook configuration, Kyverno and
Gatekeeper rotate it in a Secret, Istio publishes its root in a ConfigMap). A copy of such a
configuration in the gateway's directory names that place instead of copying the bundle, with the
``caFrom`` field of the ``webhook-gateway.io/backend-policy`` annotation::

    "*": {caFrom: {secret: {namespace: cert-manager, name: cert-manager-webhook-ca, key: ca.crt}}}

Exactly one source per reference: ``secret``, ``configMap`` (a key of its ``data``), the ``caBundle``
of a live ``validatingWebhookConfiguration`` / ``mutatingWebhookConfiguration`` (``webhook``: which
of its webhooks, by default the one of the same name), or a ``file`` (file mode, or a mounted
volume). Pure: parsing and validation here, with field paths under the annotation; the gateway's
rims read and watch the referenced objects. ``watch_plan`` is the set of objects to watch, and
``rbac_documents`` the Role/ClusterRole that allows exactly those names and nothing else.

Also here, ``check``'s CA warnings (each with a code of its own): a service backend that has
neither a ``caBundle`` nor a ``caFrom`` (every call fails TLS: the system roots never hold a
cluster-internal CA), and a ``caBundle`` certificate that has expired or expires within 30 days.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec
from cryptography import x509

from gateway.config.fielderrors import (
    FieldError,
    child,
    go_quote,
    invalid,
    invalid_omitting_value,
    required,
)
from gateway.config.formats import is_dns1123_label, is_dns1123_subdomain

if TYPE_CHECKING:
    from gateway.config.model import Snapshot

CA_FROM: Final = "caFrom"
CaSource = Literal[
    "secret", "configMap", "validatingWebhookConfiguration", "mutatingWebhookConfiguration", "file"
]
SOURCES: Final[tuple[CaSource, ...]] = (  # sorted, as errors list them
    "configMap",
    "file",
    "mutatingWebhookConfiguration",
    "secret",
    "validatingWebhookConfiguration",
)
DEFAULT_KEY: Final = "ca.crt"
EXPIRY_WARNING_DAYS: Final = 30
MAX_KEY_LENGTH: Final = 253

# The warning codes of `check` produced here (docs/configuration.md lists them with the others).
CODE_MISSING: Final = "ca-missing"
CODE_EXPIRY: Final = "ca-expiry"
WARNING_CODES: Final[Mapping[str, str]] = {
    CODE_MISSING: "a service backend with neither caBundle nor caFrom: every call fails TLS",
    CODE_EXPIRY: "a caBundle certificate has expired or expires within 30 days",
}

_FIELDS: Final[Mapping[CaSource, tuple[str, ...]]] = {
    "secret": ("key", "name", "namespace"),
    "configMap": ("key", "name", "namespace"),
    "validatingWebhookConfiguration": ("name", "webhook"),
    "mutatingWebhookConfiguration": ("name", "webhook"),
    "file": ("path",),
}
_KINDS: Final[Mapping[CaSource, str]] = {
    "secret": "Secret",
    "configMap": "ConfigMap",
    "validatingWebhookConfiguration": "ValidatingWebhookConfiguration",
    "mutatingWebhookConfiguration": "MutatingWebhookConfiguration",
}


@dataclass(frozen=True, slots=True, order=True)
class WatchedObject:
    """One object the gateway reads and watches, by name (``namespace`` empty: cluster-scoped)."""

    api_group: str
    version: str
    resource: str
    kind: str
    namespace: str
    name: str

    def describe(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.kind} {where}"


class CaReference(msgspec.Struct, frozen=True, kw_only=True, order=True):
    """Where one backend's CA bundle is read from; hashable, so it keys the trust store.

    ``webhook`` is empty only in a parsed ``"*"`` entry: the effective policy of a webhook fills in
    its own name (``for_webhook``).
    """

    source: CaSource
    namespace: str = ""
    name: str = ""
    key: str = ""
    webhook: str = ""
    path: str = ""

    def describe(self) -> str:
        """``secret cert-manager/cert-manager-webhook-ca[ca.crt]``, ``file /etc/ca.pem`` …"""
        if self.source == "file":
            return f"file {self.path}"
        if self.source in ("secret", "configMap"):
            return f"{self.source} {self.namespace}/{self.name}[{self.key}]"
        return f"{self.source} {self.name}[{self.webhook or '<same name>'}]"

    def for_webhook(self, name: str) -> CaReference:
        """This reference as webhook ``name`` uses it (a live configuration's webhook of its name)."""
        if (
            self.source in ("validatingWebhookConfiguration", "mutatingWebhookConfiguration")
            and not self.webhook
        ):
            return msgspec.structs.replace(self, webhook=name)
        return self

    @property
    def watched(self) -> WatchedObject | None:
        """The cluster object this reference reads (None for a file)."""
        if self.source == "secret":
            return WatchedObject("", "v1", "secrets", "Secret", self.namespace, self.name)
        if self.source == "configMap":
            return WatchedObject("", "v1", "configmaps", "ConfigMap", self.namespace, self.name)
        if self.source == "validatingWebhookConfiguration":
            return WatchedObject(
                "admissionregistration.k8s.io",
                "v1",
                "validatingwebhookconfigurations",
                "ValidatingWebhookConfiguration",
                "",
                self.name,
            )
        if self.source == "mutatingWebhookConfiguration":
            return WatchedObject(
                "admissionregistration.k8s.io",
                "v1",
                "mutatingwebhookconfigurations",
                "MutatingWebhookConfiguration",
                "",
                self.name,
            )
        return None


# --- parsing -------------------------------------------------------------------------------------


@dataclass(slots=True)
class ParsedReference:
    """What parsing one ``caFrom`` value found (``reference`` None: an explicit null, or errors)."""

    reference: CaReference | None = None
    errors: list[FieldError] = field(default_factory=list)
    warnings: list[FieldError] = field(default_factory=list)


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def _string(body: Mapping[str, Any], name: str, path: str, found: ParsedReference) -> str | None:
    value = body.get(name)
    p = child(path, name)
    if value is None or value == "":
        found.errors.append(required(p))
        return None
    if not isinstance(value, str):
        found.errors.append(invalid_omitting_value(p, f"must be a string, not {_type_name(value)}"))
        return None
    return value


def _check(problems: list[str], path: str, value: str, found: ParsedReference) -> bool:
    if problems:
        found.errors.append(invalid(path, value, ",".join(problems)))
        return False
    return True


def _key_problems(key: str) -> list[str]:
    """upstream: util/validation IsConfigMapKey (Secret and ConfigMap keys)."""
    problems = []
    if len(key) > MAX_KEY_LENGTH:
        problems.append(f"must be no more than {MAX_KEY_LENGTH} characters")
    if not key.replace("-", "").replace(".", "").replace("_", "").isalnum() or not key.isascii():
        problems.append("a valid config key must consist of alphanumeric characters, '-', '_' or '.'")
    if key in (".", ".."):
        problems.append(f"must not be {go_quote(key)}")
    elif key.startswith(".."):
        problems.append("must not start with '..'")
    return problems


def _valid(value: str | None, check: list[str] | None, path: str, found: ParsedReference) -> str | None:
    """``value`` when it passed ``check`` (its problems), else None (the problem reported)."""
    if value is None or check is None:
        return None
    return value if _check(check, path, value, found) else None


def _object_reference(source: CaSource, body: Mapping[str, Any], path: str, found: ParsedReference) -> None:
    given_name = _string(body, "name", path, found)
    name = _valid(given_name, is_dns1123_subdomain(given_name or ""), child(path, "name"), found)
    if source in ("secret", "configMap"):
        given_namespace = _string(body, "namespace", path, found)
        namespace = _valid(
            given_namespace, is_dns1123_label(given_namespace or ""), child(path, "namespace"), found
        )
        given_key = body.get("key", DEFAULT_KEY)
        key = None
        if not isinstance(given_key, str) or not given_key:
            found.errors.append(invalid_omitting_value(child(path, "key"), "must be a non-empty string"))
        else:
            key = _valid(given_key, _key_problems(given_key), child(path, "key"), found)
        if name is not None and namespace is not None and key is not None:
            found.reference = CaReference(source=source, namespace=namespace, name=name, key=key)
        return
    given_webhook = body.get("webhook", "")
    webhook: str | None = ""
    if not isinstance(given_webhook, str):
        found.errors.append(
            invalid_omitting_value(
                child(path, "webhook"), f"must be a string, not {_type_name(given_webhook)}"
            )
        )
        webhook = None
    elif given_webhook:
        webhook = _valid(given_webhook, is_dns1123_subdomain(given_webhook), child(path, "webhook"), found)
    if name is not None and webhook is not None:
        found.reference = CaReference(source=source, name=name, webhook=webhook)


def parse_ca_from(value: object, path: str) -> ParsedReference:
    """Parse and validate one ``caFrom`` value; ``path`` is its field path, for messages."""
    found = ParsedReference()
    if value is None:
        return found
    if not isinstance(value, dict):
        found.errors.append(
            invalid_omitting_value(path, f"must be an object or null, not {_type_name(value)}")
        )
        return found
    given = [k for k in value if k in SOURCES]
    for k in value:
        if k not in SOURCES:
            found.warnings.append(
                FieldError(child(path, str(k)), f"unknown field; known fields: {', '.join(SOURCES)}")
            )
    if len(given) != 1:
        what = "none" if not given else ", ".join(given)
        found.errors.append(
            invalid_omitting_value(path, f"must name exactly one of {', '.join(SOURCES)} (found {what})")
        )
        return found
    source: CaSource = given[0]
    body = value[source]
    p = child(path, source)
    if source == "file":
        if not isinstance(body, str) or not body:
            found.errors.append(invalid_omitting_value(p, "must be an absolute file path"))
        elif not body.startswith("/") or "\0" in body:
            found.errors.append(invalid(p, body, "must be an absolute file path"))
        else:
            found.reference = CaReference(source="file", path=body)
        return found
    if not isinstance(body, dict):
        found.errors.append(invalid_omitting_value(p, f"must be an object, not {_type_name(body)}"))
        return found
    for k in body:
        if k not in _FIELDS[source]:
            found.warnings.append(
                FieldError(child(p, str(k)), f"unknown field; known fields: {', '.join(_FIELDS[source])}")
            )
    _object_reference(source, body, p, found)
    return found


# --- what the gateway watches, and the RBAC for exactly that --------------------------------------


@dataclass(frozen=True, slots=True)
class WatchPlan:
    """Every object and file the configuration's CA references read, each once, sorted."""

    objects: tuple[WatchedObject, ...] = ()
    files: tuple[str, ...] = ()

    def namespaces(self) -> tuple[str, ...]:
        return tuple(sorted({o.namespace for o in self.objects if o.namespace}))


def references(snapshot: Snapshot) -> tuple[CaReference, ...]:
    """Every distinct CA reference of the snapshot's webhooks, sorted."""
    found = {
        hook.client_config.ca_from
        for hook in (*snapshot.validating, *snapshot.mutating)
        if hook.client_config.ca_from is not None
    }
    return tuple(sorted(found))


def watch_plan(snapshot: Snapshot) -> WatchPlan:
    """The objects (and files) to watch: exactly those the CA references name."""
    refs = references(snapshot)
    objects = {w for r in refs if (w := r.watched) is not None}
    files = {r.path for r in refs if r.source == "file"}
    return WatchPlan(tuple(sorted(objects)), tuple(sorted(files)))


VERBS: Final = ("get", "list", "watch")


def rbac_rules(plan: WatchPlan) -> dict[str, list[dict[str, Any]]]:
    """PolicyRules per namespace (``""``: cluster-scoped) allowing exactly the watched names.

    ``list`` and ``watch`` with ``resourceNames`` are allowed by the apiserver for requests that
    select one object by ``fieldSelector=metadata.name=<name>``, which is how the gateway reads them.
    """
    by_scope: dict[str, dict[tuple[str, str], set[str]]] = {}
    for obj in plan.objects:
        by_scope.setdefault(obj.namespace, {}).setdefault((obj.api_group, obj.resource), set()).add(obj.name)
    return {
        scope: [
            {
                "apiGroups": [group],
                "resources": [resource],
                "resourceNames": sorted(names),
                "verbs": list(VERBS),
            }
            for (group, resource), names in sorted(groups.items())
        ]
        for scope, groups in sorted(by_scope.items())
    }


def rbac_documents(
    plan: WatchPlan,
    *,
    name: str = "webhook-gateway-ca-sources",
    service_account: str = "webhook-gateway",
    service_account_namespace: str = "webhook-gateway",
    labels: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """A Role and RoleBinding per namespace, and a ClusterRole and ClusterRoleBinding for live webhook
    configurations, that let the gateway's service account read exactly the referenced objects."""
    meta_labels = dict(labels or {"app.kubernetes.io/name": "webhook-gateway"})
    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": service_account_namespace}
    docs: list[dict[str, Any]] = []
    for scope, rules in rbac_rules(plan).items():
        role_kind = "Role" if scope else "ClusterRole"
        metadata: dict[str, Any] = {"name": name}
        if scope:
            metadata["namespace"] = scope
        metadata["labels"] = dict(meta_labels)
        docs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": role_kind,
                "metadata": metadata,
                "rules": rules,
            }
        )
        docs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": f"{role_kind}Binding",
                "metadata": dict(metadata, labels=dict(meta_labels)),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": name},
                "subjects": [dict(subject)],
            }
        )
    return docs


# --- check's CA warnings -------------------------------------------------------------------------


def certificates(pem: bytes) -> list[x509.Certificate]:
    """The certificates of a PEM bundle ([] when it holds none that parse)."""
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        return []


def _subject(cert: x509.Certificate) -> str:
    try:
        return cert.subject.rfc4514_string() or "(empty subject)"
    except ValueError:
        return "(unreadable subject)"


def expiry_warnings(pem: bytes, path: str, *, now: dt.datetime | None = None) -> list[FieldError]:
    """A warning per certificate of the bundle that has expired, is not valid yet, or expires within
    ``EXPIRY_WARNING_DAYS``."""
    now = now or dt.datetime.now(dt.UTC)
    soon = now + dt.timedelta(days=EXPIRY_WARNING_DAYS)
    hint = (
        "a copied caBundle does not follow its owner's rotation: name where the owner keeps the CA "
        f"with {CA_FROM} in the webhook-gateway.io/backend-policy annotation"
    )
    found = []
    for cert in certificates(pem):
        after, before = cert.not_valid_after_utc, cert.not_valid_before_utc
        what = f"certificate {go_quote(_subject(cert))}"
        if after <= now:
            body = f"{what} expired on {after:%Y-%m-%d %H:%M} UTC: calls to this webhook fail TLS; {hint}"
        elif before > now:
            body = (
                f"{what} is not valid before {before:%Y-%m-%d %H:%M} UTC: calls to this webhook fail TLS "
                "until then"
            )
        elif after <= soon:
            days = (after - now).days
            body = f"{what} expires on {after:%Y-%m-%d %H:%M} UTC, in {days} day(s); {hint}"
        else:
            continue
        found.append(FieldError(path, body, code=CODE_EXPIRY))
    return found


def _hint(kind: str, config_name: str, annotations: Mapping[str, str]) -> str:
    secret = annotations.get("cert-manager.io/inject-ca-from-secret", "")
    namespace, _, name = secret.partition("/")
    if namespace and name:
        return f"{{{CA_FROM}: {{secret: {{namespace: {namespace}, name: {name}, key: {DEFAULT_KEY}}}}}}}"
    source = kind[0].lower() + kind[1:]
    return f"{{{CA_FROM}: {{{source}: {{name: {config_name}}}}}}} (the live object its owner keeps fresh)"


def missing_ca_warning(
    path: str, *, kind: str, config_name: str, annotations: Mapping[str, str] | None
) -> FieldError:
    """The warning for a service backend that has neither a caBundle nor a CA reference."""
    return FieldError(
        path,
        "a service backend with neither caBundle nor a caFrom reference: its certificate is checked "
        "against the system roots, which never hold a cluster's own CA, so every call fails TLS; "
        "name where its owner keeps the CA in the webhook-gateway.io/backend-policy annotation, e.g. "
        f'"*": {_hint(kind, config_name, annotations or {})}',
        code=CODE_MISSING,
    )


def ca_warnings(
    *,
    path: str,
    has_service: bool,
    ca_bundle: bytes,
    ca_from: CaReference | None,
    kind: str,
    config_name: str,
    annotations: Mapping[str, str] | None,
    now: dt.datetime | None = None,
) -> list[FieldError]:
    """``check``'s CA warnings for one webhook (``path``: its ``clientConfig``).

    With a ``caFrom`` the static ``caBundle`` is not used, so it is not judged either.
    """
    if ca_from is not None:
        return []
    if ca_bundle.strip():
        return expiry_warnings(ca_bundle, child(path, "caBundle"), now=now)
    if has_service:
        return [missing_ca_warning(path, kind=kind, config_name=config_name, annotations=annotations)]
    return []
