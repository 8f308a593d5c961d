"""CustomResourceDefinitions as conversion backend entries (CNV-02/03).

A CRD of ``apiextensions.k8s.io/v1`` or ``/v1beta1`` in the configuration directory names, in its
``spec.conversion``, the real conversion webhook the gateway relays to. Only the CRD's name, its
version names and ``spec.conversion`` are used; everything else ``kubectl get crd -o yaml`` prints
(schemas, status, managedFields) is accepted and ignored. Pipeline, as for webhook configurations:
structural decode (``schema``) → per-version defaults → validation with field paths of the document
as written → a ``model.ConversionEntry`` (strategy ``None``: no entry).

Gateway settings ride on annotations of the CRD object, so the operator keeps one object:
``webhook-gateway.io/conversion-timeout-seconds`` (default 30), ``webhook-gateway.io/conversion-cache``
(``"true"``/``"false"``) and ``webhook-gateway.io/conversion-cache-generation`` (any text; changing
it drops the CRD's cached conversions).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from gateway.config import model, schema, types
from gateway.config.build import decode_ca_bundle
from gateway.config.fielderrors import FieldError, child, forbidden, invalid, key, not_supported, required
from gateway.config.types import Base
from gateway.config.validation import (
    validate_admission_review_versions,
    validate_client_config,
    validate_object_meta,
)

API_GROUP: Final = "apiextensions.k8s.io"
V1: Final = f"{API_GROUP}/v1"
V1BETA1: Final = f"{API_GROUP}/v1beta1"
KIND: Final = "CustomResourceDefinition"

STRATEGIES: Final = ("None", "Webhook")
TIMEOUT_ANNOTATION: Final = "webhook-gateway.io/conversion-timeout-seconds"
CACHE_ANNOTATION: Final = "webhook-gateway.io/conversion-cache"
CACHE_GENERATION_ANNOTATION: Final = "webhook-gateway.io/conversion-cache-generation"
DEFAULT_TIMEOUT_SECONDS: Final = 30  # CNV-14: upstream's client default
MAX_TIMEOUT_SECONDS: Final = 60  # the apiserver's own default request timeout


# --- the document as written (both versions share one Struct; v1beta1-only fields included) ---------


class CRDNames(Base, frozen=True):
    plural: str | None = None
    singular: str | None = None
    short_names: tuple[str, ...] | None = None
    kind: str | None = None
    list_kind: str | None = None
    categories: tuple[str, ...] | None = None


class CRDVersion(Base, frozen=True):
    """One ``spec.versions[]`` entry; only its name is used."""

    name: str | None = None
    served: object = None
    storage: object = None
    deprecated: object = None
    deprecation_warning: str | None = None
    schema: object = None
    subresources: object = None
    additional_printer_columns: object = None
    selectable_fields: object = None


class WebhookConversion(Base, frozen=True):
    """v1 ``spec.conversion.webhook``."""

    client_config: types.WebhookClientConfig | None = None
    conversion_review_versions: tuple[str, ...] | None = None


class CustomResourceConversion(Base, frozen=True):
    """``spec.conversion``: v1 nests the webhook, v1beta1 keeps its fields flat."""

    strategy: str | None = None
    webhook: WebhookConversion | None = None  # v1
    webhook_client_config: types.WebhookClientConfig | None = None  # v1beta1
    conversion_review_versions: tuple[str, ...] | None = None  # v1beta1


class CRDSpec(Base, frozen=True):
    group: str | None = None
    names: CRDNames | None = None
    scope: str | None = None
    versions: tuple[CRDVersion, ...] | None = None
    conversion: CustomResourceConversion | None = None
    preserve_unknown_fields: object = None
    # v1beta1 only
    version: str | None = None
    validation: object = None
    subresources: object = None
    additional_printer_columns: object = None


class CustomResourceDefinition(Base, frozen=True):
    api_version: str | None = None
    kind: str | None = None
    metadata: types.ObjectMeta | None = None
    spec: CRDSpec | None = None
    status: object = None


# --- loading one document --------------------------------------------------------------------------


@dataclass(slots=True)
class LoadedCRD:
    """What one CRD document gave: its name, an entry (None for strategy None or on errors), findings."""

    name: str
    entry: model.ConversionEntry | None = None
    # (plural, every (group, version) it is served under): what ``matchPolicy: Equivalent`` would
    # reach that an Exact rule may not; kept for every CRD, whatever its conversion strategy
    served: tuple[str, tuple[tuple[str, str], ...]] | None = None
    errors: list[FieldError] = field(default_factory=list)
    warnings: list[FieldError] = field(default_factory=list)
    unknown_fields: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Webhook:
    """The webhook part of ``spec.conversion`` in either version, with the paths it was read at."""

    client_config: types.WebhookClientConfig | None
    client_config_path: str
    versions: tuple[str, ...] | None
    versions_path: str


def _webhook_of(conv: CustomResourceConversion, api_version: str) -> _Webhook:
    base = "spec.conversion"
    if api_version == V1:
        hook = conv.webhook or WebhookConversion()
        return _Webhook(
            hook.client_config,
            child(child(base, "webhook"), "clientConfig"),
            hook.conversion_review_versions,
            child(child(base, "webhook"), "conversionReviewVersions"),
        )
    return _Webhook(
        conv.webhook_client_config,
        child(base, "webhookClientConfig"),
        conv.conversion_review_versions,
        child(base, "conversionReviewVersions"),
    )


def _defaulted(conv: CustomResourceConversion | None, api_version: str) -> CustomResourceConversion:
    """CNV-02 defaults: strategy ``None``; v1beta1 Webhook review versions ``["v1beta1"]``."""
    from msgspec.structs import replace

    conv = conv or CustomResourceConversion()
    if conv.strategy is None:
        conv = replace(conv, strategy="None")
    if api_version == V1BETA1 and conv.strategy == "Webhook" and not conv.conversion_review_versions:
        conv = replace(conv, conversion_review_versions=("v1beta1",))
    return conv


def _annotations(meta: types.ObjectMeta) -> tuple[float, bool, str, list[FieldError]]:
    """The gateway's per-CRD settings: (timeout seconds, cache on, cache generation, errors)."""
    notes = meta.annotations or {}
    errors: list[FieldError] = []
    timeout = float(DEFAULT_TIMEOUT_SECONDS)
    raw = notes.get(TIMEOUT_ANNOTATION)
    if raw is not None:
        path = key("metadata.annotations", TIMEOUT_ANNOTATION)
        if raw.strip().isdigit() and 1 <= int(raw) <= MAX_TIMEOUT_SECONDS:
            timeout = float(int(raw))
        else:
            errors.append(
                invalid(path, raw, f"must be a whole number of seconds from 1 to {MAX_TIMEOUT_SECONDS}")
            )
    cache = False
    raw = notes.get(CACHE_ANNOTATION)
    if raw is not None:
        if raw in ("true", "false"):
            cache = raw == "true"
        else:
            errors.append(
                not_supported(key("metadata.annotations", CACHE_ANNOTATION), raw, ("false", "true"))
            )
    return timeout, cache, notes.get(CACHE_GENERATION_ANNOTATION, ""), errors


def _points_at_gateway(cc: types.WebhookClientConfig, crd_name: str) -> bool:
    """Whether a client config looks like the re-pointed (cluster) copy of the CRD, not the original."""
    path = (cc.service.path or "") if cc.service is not None else urlsplit(cc.url or "").path
    return path.rstrip("/") == f"/convert/{crd_name}"


def _client_config(cc: types.WebhookClientConfig, pem: bytes) -> model.ClientConfig:
    """The validated client config as the shared model (service port defaults to 443)."""
    service = None
    if cc.service is not None:
        service = model.ServiceReference(
            namespace=cc.service.namespace or "",
            name=cc.service.name or "",
            path=cc.service.path,
            port=cc.service.port if cc.service.port is not None else 443,
        )
    return model.ClientConfig(url=cc.url, service=service, ca_bundle=pem)


def load_crd(body: dict[object, object], *, strict_https: bool, source: str) -> LoadedCRD:
    """Decode, default and validate one CRD document (CNV-02/03) into its conversion entry."""
    decoded = schema.decode(body, CustomResourceDefinition)
    crd = decoded.value
    meta = crd.metadata or types.ObjectMeta()
    loaded = LoadedCRD(name=meta.name or "", unknown_fields=list(decoded.unknown_fields))
    loaded.errors.extend(decoded.errors)
    api_version = crd.api_version or V1
    found = validate_object_meta(crd.metadata)
    errors = list(found.errors)
    loaded.warnings.extend(found.warnings)
    timeout, cache, generation, annotation_errors = _annotations(meta)
    errors.extend(annotation_errors)

    spec = crd.spec or CRDSpec()
    plural = spec.names.plural if spec.names else None
    served = tuple(v.name for v in spec.versions or () if v.name and v.served is not False)
    if plural and spec.group and (served or spec.version):
        loaded.served = (plural, tuple((spec.group, v) for v in served or (spec.version or "",)))
    conv = _defaulted(spec.conversion, api_version)
    hook = _webhook_of(conv, api_version)
    strategy = conv.strategy or "None"
    if strategy not in STRATEGIES:
        errors.append(not_supported("spec.conversion.strategy", strategy, STRATEGIES))
    pem = b""
    if strategy == "Webhook":
        if hook.client_config is None:
            errors.append(required(hook.client_config_path, "required when strategy is set to Webhook"))
        else:
            errors.extend(
                validate_client_config(hook.client_config, hook.client_config_path, strict_https=strict_https)
            )
            ca_path = child(hook.client_config_path, "caBundle")
            pem, error, unparseable = decode_ca_bundle(hook.client_config.ca_bundle, ca_path)
            if pem.strip() == b"":
                pem = b""  # CNV-15: a whitespace-only caBundle counts as empty
            elif unparseable is not None:  # CNV-03: unlike admission configs, an error at load
                errors.append(FieldError(ca_path, unparseable.body.split(";")[0]))
            if error is not None:
                errors.append(error)
        errors.extend(validate_admission_review_versions(hook.versions, hook.versions_path))
    else:
        if hook.client_config is not None:
            errors.append(
                forbidden(hook.client_config_path, "should not be set when strategy is not set to Webhook")
            )
        if hook.versions:
            errors.append(
                forbidden(hook.versions_path, "should not be set when strategy is not set to Webhook")
            )

    if (
        strategy == "Webhook"
        and hook.client_config is not None
        and _points_at_gateway(hook.client_config, loaded.name)
    ):
        loaded.warnings.append(
            FieldError(
                hook.client_config_path,
                f"the path is the gateway's own conversion route for this CRD (/convert/{loaded.name}): "
                "the gateway's copy of a CRD must name the original conversion webhook, or every "
                "conversion calls the gateway again until it times out",
            )
        )
    loaded.errors.extend(e for e in errors if not schema.suppressed(e.path, decoded.bad_paths))
    if loaded.errors or strategy != "Webhook" or hook.client_config is None:
        return loaded
    client_config = _client_config(hook.client_config, pem)
    versions = tuple(v.name for v in spec.versions or () if v.name)
    if not versions and spec.version:
        versions = (spec.version,)  # v1beta1's single top-level version
    review_versions = hook.versions or ()
    identity = hashlib.sha256(repr((client_config, review_versions, generation)).encode()).hexdigest()[:16]
    loaded.entry = model.ConversionEntry(
        crd_name=loaded.name,
        group=spec.group or "",
        kind=(spec.names.kind if spec.names else None) or "",
        versions=versions,
        client_config=client_config,
        conversion_review_versions=review_versions,
        timeout_seconds=timeout,
        cache=cache,
        cache_identity=identity,
        source=source,
    )
    return loaded
