"""namespaceSelector (MAT-11..17, GW-01): which labels a review's namespace has, and whether they match.

Looking labels up is I/O (a watch cache, a live GET, a file), so it is not done here. The dispatcher
asks ``namespace_to_look_up`` once per review, resolves that name with its label source, and passes the
result (a ``NamespaceLabels`` value) to matching. Matching only turns a failed lookup into an error
when a backend with a non-empty selector has matching rules (MAT-02, MAT-16/17).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, Literal, TypeAlias

import msgspec

from gateway.admission import AdmissionAttributes
from gateway.config.model import Webhook
from gateway.config.plan import MatchPlan
from gateway.config.selectors import LabelSelector
from gateway.errors import MatchingError


class NamespaceNotFound(msgspec.Struct, frozen=True):
    """The label source knows no namespace of this name (MAT-16)."""

    name: str


class NamespaceLookupFailed(msgspec.Struct, frozen=True):
    """The label source could not answer; ``error`` is the text for MAT-17's 500."""

    error: str


NamespaceLabels: TypeAlias = Mapping[str, str] | NamespaceNotFound | NamespaceLookupFailed
"""What the dispatcher's lookup produced for ``namespace_to_look_up(attrs)``."""

UnknownNamespace = Literal["notFound", "emptyLabels"]

_NOT_AN_OBJECT: Final = "object does not implement the Object interfaces"
_NOT_LOOKED_UP: Final = "namespace labels were not looked up"


def internal_error(text: str) -> MatchingError:
    """A 500 ``Internal error occurred: <text>`` answering the whole review (MAT-17, MAT-23)."""
    return MatchingError(code=500, reason="InternalError", message=f"Internal error occurred: {text}")


def not_found(name: str) -> MatchingError:
    """MAT-16: 404 ``namespaces "<ns>" not found``."""
    return MatchingError(
        code=404,
        reason="NotFound",
        message=f'namespaces "{name}" not found',
        details={"name": name, "kind": "namespaces"},
    )


def is_exempt_from_namespace_selector(attrs: AdmissionAttributes) -> bool:
    """MAT-11 (+ MAT-14 quirk): cluster-scoped requests other than ``namespaces`` always pass."""
    return attrs.namespace == "" and not attrs.is_namespace_object


def _uses_own_object(attrs: AdmissionAttributes) -> bool:
    # MAT-13: CREATE/UPDATE of the Namespace itself (no subresource) tests the object being written,
    # because no cache holds it yet. upstream: predicates/namespace/matcher.go GetNamespaceLabels
    return attrs.is_namespace_object and attrs.sub_resource == "" and attrs.operation in ("CREATE", "UPDATE")


def _labels_from_request(attrs: AdmissionAttributes) -> Mapping[str, str] | MatchingError | None:
    """Labels the review itself provides (MAT-13, MAT-15), an error, or None when a lookup is needed."""
    if _uses_own_object(attrs):
        labels = attrs.object_labels()
        return internal_error(_NOT_AN_OBJECT) if labels is None else labels
    if attrs.is_namespace_object:
        # MAT-15 [GW]: the stored Namespace is what oldObject carries; no lookup needed
        return attrs.old_object_labels()
    return None


def _name_to_look_up(attrs: AdmissionAttributes) -> str:
    if attrs.is_namespace_object and attrs.namespace == "":
        return attrs.name  # MAT-15: fall back to request.name
    return attrs.namespace


def namespace_to_look_up(
    attrs: AdmissionAttributes, hooks: Iterable[Webhook | MatchPlan] | None = None
) -> str | None:
    """The namespace whose stored labels matching will need, or None when no lookup is needed.

    None for cluster-scoped non-Namespace requests (MAT-11) and when the review carries the labels
    itself (MAT-13, MAT-15). With ``hooks`` (webhooks or their compiled plans), also None unless one
    of them has a non-empty namespaceSelector (MAT-12) and rules matching this review (its selector
    result could matter).
    """
    if is_exempt_from_namespace_selector(attrs) or _labels_from_request(attrs) is not None:
        return None
    if hooks is not None:
        plans = (h if isinstance(h, MatchPlan) else MatchPlan(h) for h in hooks)
        if not any(plan.needs_namespace and plan.rules.matches(attrs) for plan in plans):
            return None
    return _name_to_look_up(attrs)


def labels_from_map(
    namespaces: Mapping[str, Mapping[str, str]],
    name: str,
    *,
    unknown_namespace: UnknownNamespace = "notFound",
) -> NamespaceLabels:
    """GW-01 file mode: a static map of namespace labels; an unknown name per ``unknownNamespace``."""
    labels = namespaces.get(name)
    if labels is not None:
        return labels
    return {} if unknown_namespace == "emptyLabels" else NamespaceNotFound(name)


def match_namespace_selector(
    selector: LabelSelector,
    attrs: AdmissionAttributes,
    looked_up: NamespaceLabels | None,
) -> bool | MatchingError:
    """MAT-11..17, MAT-23: True/False for a clean answer, or the error that would answer the review.

    ``looked_up`` is the dispatcher's result for ``namespace_to_look_up(attrs)`` (None if it did not
    look). The error is only *pending*: ``should_call`` returns it only when the rules match (MAT-02).
    """
    # upstream: predicates/namespace/matcher.go MatchNamespaceSelector (exemption, build, empty, lookup)
    if is_exempt_from_namespace_selector(attrs):
        return True
    if selector.error is not None:
        return internal_error(selector.error)
    if not selector.requirements:
        return True
    labels = resolve_namespace_labels(attrs, looked_up)
    if isinstance(labels, MatchingError):
        return labels
    return selector.matches(labels)


def resolve_namespace_labels(
    attrs: AdmissionAttributes, looked_up: NamespaceLabels | None
) -> Mapping[str, str] | MatchingError:
    """MAT-13..17: the labels a non-empty namespaceSelector tests, or the error consulting them gives.

    Only meaningful for requests that are not exempt (MAT-11); the same for every backend of a review.
    """
    labels: NamespaceLabels | MatchingError | None = _labels_from_request(attrs)
    if labels is None:
        labels = looked_up
    if labels is None:
        return internal_error(_NOT_LOOKED_UP)
    if isinstance(labels, NamespaceNotFound):
        return not_found(labels.name)
    if isinstance(labels, NamespaceLookupFailed):
        return internal_error(labels.error)
    return labels
