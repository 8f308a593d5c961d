"""Validation of defaulted configuration documents (CFG-06..22), with upstream's paths and texts.

Pure functions from the ``types`` Structs (after ``defaults``) to field errors, in upstream's order
(upstream: pkg/apis/admissionregistration/validation/validation.go). Errors that the apiserver
relaxes on update are marked ``ratchet`` (CFG-24); the loader reports those as warnings for objects
read from a cluster. Match conditions are compiled here, once, and handed back for the model.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from gateway.config import cel, types
from gateway.config.defaults import V1, V1BETA1
from gateway.config.fielderrors import (
    FieldError,
    GoSlice,
    child,
    duplicate,
    forbidden,
    go_quote,
    index,
    invalid,
    not_supported,
    required,
    too_many,
)
from gateway.config.formats import (
    is_dns1035_label,
    is_dns1123_label,
    is_dns1123_subdomain,
    is_label_value,
    is_qualified_name,
)
from gateway.wire.redact import redact_url

# Supported values, sorted as upstream's sets.String.List() prints them.
FAILURE_POLICIES: Final = ("Fail", "Ignore")
MATCH_POLICIES: Final = ("Equivalent", "Exact")
SIDE_EFFECTS_V1: Final = ("None", "NoneOnDryRun")
SIDE_EFFECTS_ALL: Final = ("None", "NoneOnDryRun", "Some", "Unknown")
REINVOCATION_POLICIES: Final = ("IfNeeded", "Never")
SCOPES: Final = ("*", "Cluster", "Namespaced")
OPERATIONS: Final = ("*", "CONNECT", "CREATE", "DELETE", "UPDATE")
REVIEW_VERSIONS: Final = ("v1", "v1beta1")
MAX_MATCH_CONDITIONS: Final = 64


@dataclass(slots=True)
class Findings:
    """What validating one object found.

    ``errors`` include the ``ratchet``-marked ones; ``warnings`` are gateway notes (CFG-06 [GW]).
    ``conditions[i]`` are webhook i's compiled match conditions.
    """

    errors: list[FieldError] = field(default_factory=list)
    warnings: list[FieldError] = field(default_factory=list)
    conditions: list[tuple[cel.CompiledCondition, ...]] = field(default_factory=list)


# --- metadata ------------------------------------------------------------------------------------


def validate_object_meta(meta: types.ObjectMeta | None, *, name_is_label: bool = False) -> Findings:
    """CFG-06: ``metadata.name`` required and a DNS-1123 subdomain (label for Namespaces)."""
    found = Findings()
    meta = meta or types.ObjectMeta()
    if not meta.name:
        found.errors.append(required("metadata.name", "name or generateName is required"))
    else:
        check = is_dns1123_label if name_is_label else is_dns1123_subdomain
        found.errors.extend(invalid("metadata.name", meta.name, m) for m in check(meta.name))
    if meta.namespace:
        # [GW] upstream forbids it; rendered manifests often carry one, so only warn.
        found.warnings.append(
            FieldError(
                "metadata.namespace",
                f"the object is cluster-scoped; namespace {go_quote(meta.namespace)} is ignored",
            )
        )
    return found


def validate_labels(labels: dict[str, str] | None, path: str) -> list[FieldError]:
    """upstream: metav1validation.ValidateLabels (errors reported at the map's own path)."""
    errors: list[FieldError] = []
    for k, v in (labels or {}).items():
        errors.extend(invalid(path, k, m) for m in is_qualified_name(k))
        errors.extend(invalid(path, v, m) for m in is_label_value(v))
    return errors


def validate_namespace(ns: types.Namespace) -> Findings:
    """A v1 Namespace of file mode (GW-01): a DNS-1123 label name and valid labels."""
    found = validate_object_meta(ns.metadata, name_is_label=True)
    if ns.metadata is not None:
        found.errors.extend(validate_labels(ns.metadata.labels, "metadata.labels"))
    return found


# --- selectors (CFG-21) --------------------------------------------------------------------------


def validate_label_selector(selector: types.LabelSelector | None, path: str) -> list[FieldError]:
    """CFG-21; invalid ``matchExpressions`` values are ratcheted (CFG-24)."""
    if selector is None:
        return []
    errors = validate_labels(selector.match_labels, child(path, "matchLabels"))
    for i, expr in enumerate(selector.match_expressions or ()):
        p = index(child(path, "matchExpressions"), i)
        values = expr.values or ()
        if expr.operator in ("In", "NotIn"):
            if not values:
                errors.append(
                    required(child(p, "values"), "must be specified when `operator` is 'In' or 'NotIn'")
                )
        elif expr.operator in ("Exists", "DoesNotExist"):
            if values:
                errors.append(
                    forbidden(
                        child(p, "values"),
                        "may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                    )
                )
        else:
            errors.append(invalid(child(p, "operator"), expr.operator or "", "not a valid selector operator"))
        key = expr.key or ""
        errors.extend(invalid(child(p, "key"), key, m) for m in is_qualified_name(key))
        for j, value in enumerate(values):
            errors.extend(
                invalid(index(child(p, "values"), j), value, m, ratchet=True) for m in is_label_value(value)
            )
    return errors


def selector_build_error(selector: types.LabelSelector) -> str | None:
    """The error upstream's LabelSelectorAsSelector returns for a laxly accepted selector (MAT-23).

    upstream: apimachinery labels.NewRequirement — the first failing requirement's errors.
    """
    for expr in selector.match_expressions or ():
        if expr.operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return f"{go_quote(expr.operator or '')} is not a valid label selector operator"
        messages = [
            str(invalid(f"values[{j}][{expr.key}]", v, "; ".join(problems)))
            for j, v in enumerate(expr.values or ())
            if (problems := is_label_value(v))
        ]
        if messages:
            return messages[0] if len(messages) == 1 else "[" + ", ".join(messages) + "]"
    return None


# --- client config (CFG-13..16) ------------------------------------------------------------------

_URL_FORM: Final = "; desired format: https://host[/path]"
_PORT = re.compile(r"[0-9]*")


def _url_parse_error(url: str) -> str | None:
    """The few ``url.Parse`` failures Python's ``urlsplit`` would silently repair or miss."""
    shown = go_quote(redact_url(url))  # quoted in the errors: never with its password
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        return f"parse {shown}: net/url: invalid control character in URL"
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return f"parse {shown}: {exc}"
    hostport = parts.netloc.rpartition("@")[2]
    if " " in hostport:
        return f'parse {shown}: invalid character " " in host name'
    port = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
    if ":" in port:
        digits = port.rpartition(":")[2]  # Go takes the port after the last colon
        if not _PORT.fullmatch(digits):
            return f"parse {shown}: invalid port {go_quote(':' + digits)} after host"
    return None


def is_loopback_host(host: str) -> bool:
    """CFG-15: ``localhost`` in any case, an address in 127.0.0.0/8, or ``::1``."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv4Address):
        return address in ipaddress.IPv4Network("127.0.0.0/8")
    return address == ipaddress.IPv6Address("::1")


def validate_url(url: str, path: str, *, strict_https: bool) -> list[FieldError]:
    """CFG-14/15 (upstream: apiserver util/webhook ValidateWebhookURL, with the gateway's loopback http)."""
    if (problem := _url_parse_error(url)) is not None:
        return [required(path, f"url must be a valid URL: {problem}{_URL_FORM}")]
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    errors = []
    loopback_http = parts.scheme == "http" and not strict_https and is_loopback_host(parts.hostname or "")
    if parts.scheme != "https" and not loopback_http:
        errors.append(invalid(path, parts.scheme, "'https' is the only allowed URL scheme" + _URL_FORM))
    if not host:
        errors.append(invalid(path, host, "host must be specified" + _URL_FORM))
    if at:
        # Never echo a password (Go's URL.Redacted form): the error reaches logs on every reload.
        user, colon, _password = userinfo.partition(":")
        shown = user + (":xxxxx" if colon else "")
        errors.append(invalid(path, shown, "user information is not permitted in the URL"))
    if parts.fragment:
        errors.append(invalid(path, parts.fragment, "fragments are not permitted in the URL"))
    if parts.query:
        errors.append(invalid(path, parts.query, "query parameters are not permitted in the URL"))
    return errors


def validate_service(service: types.ServiceReference, path: str) -> list[FieldError]:
    """CFG-16 (upstream: apiserver util/webhook ValidateWebhookService, its path quirks included)."""
    errors = []
    if not service.name:
        errors.append(required(child(path, "name"), "service name is required"))
    if not service.namespace:
        errors.append(required(child(path, "namespace"), "service namespace is required"))
    port = service.port if service.port is not None else 443
    if not 1 <= port <= 65535:
        errors.append(
            invalid(child(path, "port"), port, "port is not valid: must be between 1 and 65535, inclusive")
        )
    url_path = service.path
    if url_path is None or url_path in ("", "/"):
        return errors
    p = child(path, "path")
    if url_path == "//":
        errors.append(invalid(p, url_path, "segment[0] may not be empty"))
        return errors
    if not url_path.startswith("/"):
        errors.append(invalid(p, url_path, "must start with a '/'"))
    # upstream drops the first character whatever it is, then at most one trailing '/'.
    to_check = url_path[1:]
    if to_check.endswith("/"):
        to_check = to_check[:-1]
    for i, step in enumerate(to_check.split("/")):
        if not step:
            errors.append(invalid(p, url_path, f"segment[{i}] may not be empty"))
            continue
        errors.extend(invalid(p, url_path, f"segment[{i}]: {m}") for m in is_dns1123_subdomain(step))
    return errors


def validate_client_config(
    cc: types.WebhookClientConfig | None, path: str, *, strict_https: bool
) -> list[FieldError]:
    """CFG-13: exactly one of ``url`` and ``service``, then that one's rules."""
    cc = cc or types.WebhookClientConfig()
    if (cc.url is None) == (cc.service is None):
        return [required(path, "exactly one of url or service is required")]
    if cc.url is not None:
        return validate_url(cc.url, child(path, "url"), strict_https=strict_https)
    assert cc.service is not None
    return validate_service(cc.service, child(path, "service"))


# --- rules (CFG-18..20) --------------------------------------------------------------------------


def validate_resources(resources: Sequence[str], path: str) -> list[FieldError]:
    """CFG-19/20, order-dependent exactly as upstream (validation.go validateResources)."""
    errors = []
    if not resources:
        errors.append(required(path))
    with_wildcard_sub: set[str] = set()  # "res/*" seen
    with_wildcard_res: set[str] = set()  # "*/sub" seen
    has_double_wildcard = False
    has_single_wildcard = False
    has_resource_without_subresource = False
    for i, res_sub in enumerate(resources):
        if not res_sub:
            errors.append(required(index(path, i)))
            continue
        if res_sub == "*/*":
            has_double_wildcard = True
        if res_sub == "*":
            has_single_wildcard = True
        res, slash, sub = res_sub.partition("/")
        if not slash:
            # upstream quirk: only the last entry without '/' decides (CFG-20)
            has_resource_without_subresource = res_sub != "*"
            continue
        if res in with_wildcard_sub:
            errors.append(
                invalid(index(path, i), res_sub, f"if '{res}/*' is present, must not specify {res_sub}")
            )
        if sub in with_wildcard_res:
            errors.append(
                invalid(index(path, i), res_sub, f"if '*/{sub}' is present, must not specify {res_sub}")
            )
        if sub == "*":
            with_wildcard_sub.add(res)
        if res == "*":
            with_wildcard_res.add(sub)
    if len(resources) > 1 and has_double_wildcard:
        errors.append(
            invalid(path, GoSlice(tuple(resources)), "if '*/*' is present, must not specify other resources")
        )
    if has_single_wildcard and has_resource_without_subresource:
        errors.append(
            invalid(
                path,
                GoSlice(tuple(resources)),
                "if '*' is present, must not specify other resources without subresources",
            )
        )
    return errors


def validate_rule(rule: types.RuleWithOperations, path: str) -> list[FieldError]:
    """CFG-18 (upstream: validateRuleWithOperations, then validateRule)."""
    errors = []
    operations = rule.operations or ()
    ops_path = child(path, "operations")
    if not operations:
        errors.append(required(ops_path))
    if len(operations) > 1 and "*" in operations:
        errors.append(
            invalid(
                ops_path,
                GoSlice(operations, "admissionregistration.OperationType"),
                "if '*' is present, must not specify other operations",
            )
        )
    errors.extend(
        not_supported(index(ops_path, i), op, OPERATIONS)
        for i, op in enumerate(operations)
        if op not in OPERATIONS
    )
    groups = rule.api_groups or ()
    if not groups:
        errors.append(required(child(path, "apiGroups")))
    if len(groups) > 1 and "*" in groups:
        errors.append(
            invalid(
                child(path, "apiGroups"),
                GoSlice(groups),
                "if '*' is present, must not specify other API groups",
            )
        )
    versions = rule.api_versions or ()
    if not versions:
        errors.append(required(child(path, "apiVersions")))
    if len(versions) > 1 and "*" in versions:
        errors.append(
            invalid(
                child(path, "apiVersions"),
                GoSlice(versions),
                "if '*' is present, must not specify other API versions",
            )
        )
    errors.extend(required(index(child(path, "apiVersions"), i)) for i, v in enumerate(versions) if not v)
    errors.extend(validate_resources(rule.resources or (), child(path, "resources")))
    if rule.scope is not None and rule.scope not in SCOPES:
        errors.append(not_supported(child(path, "scope"), rule.scope, SCOPES))
    return errors


# --- review versions (CFG-12) ----------------------------------------------------------------------


def validate_admission_review_versions(versions: Sequence[str] | None, path: str) -> list[FieldError]:
    """CFG-12; lacking a recognised version is ratcheted (CFG-24)."""
    if not versions:
        return [required(path, f"must specify one of {', '.join(REVIEW_VERSIONS)}")]
    errors: list[FieldError] = []
    seen: set[str] = set()
    for i, version in enumerate(versions):
        if version in seen:
            errors.append(invalid(index(path, i), version, "duplicate version"))
            continue
        seen.add(version)
        errors.extend(invalid(index(path, i), version, m) for m in is_dns1035_label(version))
    if not seen.intersection(REVIEW_VERSIONS):
        errors.append(
            invalid(
                path,
                GoSlice(tuple(versions)),
                f"must include at least one of {', '.join(REVIEW_VERSIONS)}",
                ratchet=True,
            )
        )
    return errors


# --- match conditions (CFG-22) ---------------------------------------------------------------------


def validate_match_conditions(
    conditions: Sequence[types.MatchCondition], path: str
) -> tuple[list[FieldError], tuple[cel.CompiledCondition, ...]]:
    """CFG-22; compile failures are ratcheted (CFG-24) and kept, with their error, in the result."""
    errors = []
    compiled = []
    if len(conditions) > MAX_MATCH_CONDITIONS:
        errors.append(too_many(path, len(conditions), MAX_MATCH_CONDITIONS))
    names: set[str] = set()
    for i, condition in enumerate(conditions):
        p = index(path, i)
        name = condition.name or ""
        expression = condition.expression or ""
        trimmed = expression.strip()
        if not trimmed:
            errors.append(required(child(p, "expression")))
        else:
            result = cel.compile_condition(name, expression)
            if result.error is not None:
                errors.append(invalid(child(p, "expression"), trimmed, result.error, ratchet=True))
            compiled.append(result)
        if not name:
            errors.append(required(child(p, "name")))
        else:
            errors.extend(invalid(child(p, "name"), name, m) for m in is_qualified_name(name))
            if name in names:
                errors.append(duplicate(child(p, "name"), name))
            names.add(name)
    return errors, tuple(compiled)


# --- webhooks and configurations ---------------------------------------------------------------


def _webhook_name_errors(name: str, path: str) -> list[FieldError]:
    """CFG-07 (upstream: util/validation IsFullyQualifiedName)."""
    if not name:
        return [required(path)]
    if problems := is_dns1123_subdomain(name):
        return [invalid(path, name, ",".join(problems))]
    if len(name.split(".")) < 3:
        return [invalid(path, name, "should be a domain with at least three segments separated by dots")]
    return []


def validate_webhook(
    hook: types.ValidatingWebhook, path: str, *, api_version: str, strict_https: bool
) -> tuple[list[FieldError], tuple[cel.CompiledCondition, ...]]:
    """CFG-07, 09..22 for one defaulted ``webhooks[]`` element, in upstream's order."""
    errors = _webhook_name_errors(hook.name or "", child(path, "name"))
    for i, rule in enumerate(hook.rules or ()):
        errors.extend(validate_rule(rule, index(child(path, "rules"), i)))
    if hook.failure_policy is not None and hook.failure_policy not in FAILURE_POLICIES:
        errors.append(not_supported(child(path, "failurePolicy"), hook.failure_policy, FAILURE_POLICIES))
    if hook.match_policy is not None and hook.match_policy not in MATCH_POLICIES:
        errors.append(not_supported(child(path, "matchPolicy"), hook.match_policy, MATCH_POLICIES))
    allowed = SIDE_EFFECTS_V1 if api_version == V1 else SIDE_EFFECTS_ALL
    if hook.side_effects is None:
        errors.append(required(child(path, "sideEffects"), f"must specify one of {', '.join(allowed)}"))
    elif hook.side_effects not in allowed:
        # CFG-24: the apiserver still accepts Some/Unknown on update of an object that had them.
        ratchet = hook.side_effects in SIDE_EFFECTS_ALL
        errors.append(not_supported(child(path, "sideEffects"), hook.side_effects, allowed, ratchet=ratchet))
    if hook.timeout_seconds is not None and not 1 <= hook.timeout_seconds <= 30:
        errors.append(
            invalid(
                child(path, "timeoutSeconds"),
                hook.timeout_seconds,
                "the timeout value must be between 1 and 30 seconds",
            )
        )
    errors.extend(validate_label_selector(hook.namespace_selector, child(path, "namespaceSelector")))
    errors.extend(validate_label_selector(hook.object_selector, child(path, "objectSelector")))
    if isinstance(hook, types.MutatingWebhook) and (
        hook.reinvocation_policy is not None and hook.reinvocation_policy not in REINVOCATION_POLICIES
    ):
        errors.append(
            not_supported(child(path, "reinvocationPolicy"), hook.reinvocation_policy, REINVOCATION_POLICIES)
        )
    errors.extend(
        validate_client_config(hook.client_config, child(path, "clientConfig"), strict_https=strict_https)
    )
    condition_errors, compiled = validate_match_conditions(
        hook.match_conditions or (), child(path, "matchConditions")
    )
    errors.extend(condition_errors)
    return errors, compiled


def validate_configuration(config: types.WebhookConfiguration, *, strict_https: bool = False) -> Findings:
    """CFG-06..22 for one defaulted configuration (its apiVersion decides CFG-08/10 relaxations)."""
    api_version = config.api_version or V1
    assert api_version in (V1, V1BETA1)
    found = validate_object_meta(config.metadata)
    names: set[str] = set()
    for i, hook in enumerate(config.webhooks or ()):
        path = index("webhooks", i)
        errors, compiled = validate_webhook(hook, path, api_version=api_version, strict_https=strict_https)
        found.errors.extend(errors)
        found.conditions.append(compiled)
        found.errors.extend(
            validate_admission_review_versions(
                hook.admission_review_versions, child(path, "admissionReviewVersions")
            )
        )
        # CFG-08: unique names in v1 only; duplicates are ratcheted for cluster objects (CFG-24).
        if api_version == V1 and hook.name:
            if hook.name in names:
                found.errors.append(duplicate(child(path, "name"), hook.name, ratchet=True))
            names.add(hook.name)
    return found
