"""objectSelector (MAT-18..20) and the few other facts matching reads from inside objects.

Objects stay ``msgspec.Raw``: selectors use the lazily decoded ``metadata.labels`` view of
``AdmissionAttributes``; messages that need an object's name decode ``metadata.name``/``generateName``
through a view of their own. Nothing else of an object is decoded here.
"""

from __future__ import annotations

from typing import Final

import msgspec

from gateway.admission import AdmissionAttributes, NestedTooDeeplyError, decode_nested, is_null
from gateway.config.selectors import LabelSelector
from gateway.errors import MatchingError
from gateway.matching.namespace import internal_error


def match_object_selector(selector: LabelSelector, attrs: AdmissionAttributes) -> bool | MatchingError:
    """MAT-18/19/23: True when the selector matches ``object`` or ``oldObject``; an error is pending.

    A null object, or a value without a ``metadata`` object, never matches; metadata without labels
    is tested as the empty label set. ``attrs.object`` is the current object (MAT-20).
    """
    # upstream: predicates/object/matcher.go MatchObjectSelector (build error, empty, object || oldObject)
    if selector.error is not None:
        return internal_error(selector.error)
    if not selector.requirements:
        return True
    labels = attrs.object_labels()
    if labels is not None and selector.matches(labels):
        return True
    old_labels = attrs.old_object_labels()
    return old_labels is not None and selector.matches(old_labels)


class _Names(msgspec.Struct):
    name: str = ""
    generateName: str = ""  # noqa: N815 - the Kubernetes field name


class _NamedObject(msgspec.Struct):
    metadata: _Names | None = None


_names_decoder: Final = msgspec.json.Decoder(_NamedObject | None)


def name_for_message(attrs: AdmissionAttributes) -> str:
    """MAT-33's name: request.name, else metadata.name, else generateName, else ``Unknown``.

    ``Unknown/errorGettingName`` when the object exists but has no ``metadata`` (e.g. CONNECT options).
    """
    # upstream: admission/errors.go extractResourceName
    if attrs.name:
        return attrs.name
    raw = attrs.object
    if raw is None or is_null(raw):
        return "Unknown"
    try:
        doc = decode_nested(_names_decoder, raw)
    except (msgspec.DecodeError, NestedTooDeeplyError):
        return "Unknown/errorGettingName"
    if doc is None or doc.metadata is None:
        return "Unknown/errorGettingName"
    return doc.metadata.name or doc.metadata.generateName or "Unknown"
