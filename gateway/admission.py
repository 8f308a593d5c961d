"""The shared vocabulary of one admission review, independent of the AdmissionReview version.

The review codec (``gateway.review``) turns an inbound AdmissionReview into ``AdmissionAttributes``;
matching (``gateway.matching``) and dispatch read only these. Objects stay undecoded JSON bytes
(``msgspec.Raw``): the gateway mostly forwards them, and the few decisions that look inside an object
(label selectors) decode only ``metadata.labels`` through a tiny view Struct.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Final, TypeVar

import msgspec

OPERATIONS: Final = frozenset({"CREATE", "UPDATE", "DELETE", "CONNECT"})


class GroupVersionKind(msgspec.Struct, frozen=True, omit_defaults=False):
    group: str = ""
    version: str = ""
    kind: str = ""


class GroupVersionResource(msgspec.Struct, frozen=True, omit_defaults=False):
    group: str = ""
    version: str = ""
    resource: str = ""


class StatusCause(msgspec.Struct, omit_defaults=True):
    type: str = ""
    message: str = ""
    field: str = ""


class StatusDetails(msgspec.Struct, omit_defaults=True, rename="camel"):
    name: str = ""
    group: str = ""
    kind: str = ""
    uid: str = ""
    causes: list[StatusCause] | None = None
    retry_after_seconds: int = 0


class Status(msgspec.Struct, omit_defaults=True):
    """A ``meta.k8s.io/v1`` Status as carried in ``response.status`` of an AdmissionReview."""

    status: str = ""
    message: str = ""
    reason: str = ""
    details: StatusDetails | None = None
    code: int = 0


MAX_NESTING_DEPTH: Final = 10_000
"""How deeply JSON may nest: the limit of the apiserver's own JSON decoder."""

_RECURSION_SLACK: Final = 64  # envelope levels and msgspec's own calls above the document's


class NestedTooDeeplyError(ValueError):
    """A JSON document nests deeper than ``MAX_NESTING_DEPTH`` levels."""

    def __init__(self) -> None:
        super().__init__(f"JSON nested more than {MAX_NESTING_DEPTH} levels deep")


def _stack_depth() -> int:
    frame: FrameType | None = sys._getframe()
    depth = 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


@contextmanager
def nesting_allowed() -> Iterator[None]:
    """Let recursive JSON code (msgspec counts every nesting level) go ``MAX_NESTING_DEPTH`` deep.

    Python's default recursion limit (1000) would refuse documents the apiserver accepts. The limit
    is raised only around one synchronous step (a decode, a patch), on the slow path taken after a
    ``RecursionError``, and always restored. (On Python >= 3.12 C code has its own fixed limit;
    documents deeper than that are then refused as too deep instead of decoded.)
    """
    previous = sys.getrecursionlimit()
    wanted = _stack_depth() + MAX_NESTING_DEPTH + _RECURSION_SLACK
    if wanted > previous:
        sys.setrecursionlimit(wanted)
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


_T = TypeVar("_T")


def decode_nested(decoder: msgspec.json.Decoder[_T], data: bytes) -> _T:
    """``decoder.decode(data)`` for documents nested up to ``MAX_NESTING_DEPTH`` levels.

    Raises ``NestedTooDeeplyError`` beyond that, and msgspec's ``DecodeError`` as usual. Shallow
    documents (all real ones) take the plain fast path.
    """
    try:
        return decoder.decode(data)
    except RecursionError:
        pass
    with nesting_allowed():
        try:
            return decoder.decode(data)
        except RecursionError:
            raise NestedTooDeeplyError from None


class _Labels(msgspec.Struct):
    labels: dict[str, str] | None = None


class _ObjectMeta(msgspec.Struct):
    """Decodes only ``metadata.labels``; msgspec skips every other member without building it."""

    metadata: _Labels | None = None


_labels_decoder: Final = msgspec.json.Decoder(_ObjectMeta | None)

NULL: Final = msgspec.Raw(b"null")


def is_null(doc: msgspec.Raw | None) -> bool:
    """True for an absent object or a JSON ``null`` (oldObject on CREATE, object on DELETE)."""
    if doc is None:
        return True
    # Look at the first bytes only: objects are large, and nothing else that is valid JSON here
    # starts with "null" (the codec already turns a null object into None).
    head = bytes(memoryview(doc)[:16]).lstrip()
    return not head or head.startswith(b"null")


def object_labels(doc: msgspec.Raw | None) -> dict[str, str] | None:
    """The labels of an object for objectSelector (MAT-19).

    ``None`` when there is no object or it has no ``metadata`` object (never matches); ``{}`` when it
    has metadata but no labels (tested against the empty label set).
    """
    if doc is None or is_null(doc):
        return None
    try:
        meta = decode_nested(_labels_decoder, doc)
    except (msgspec.DecodeError, NestedTooDeeplyError):
        # A metadata member that is not an object, labels that are not strings ...: upstream cannot
        # build an accessor for it either, so it never matches.
        return None
    if meta is None or meta.metadata is None:
        return None
    return meta.metadata.labels or {}


class AdmissionAttributes:
    """One review's request attributes as matching and dispatch see them (immutable by convention).

    ``object`` is the *current* object: the inbound one, or in the mutating chain the result of the
    patches applied so far (``with_object``). Labels are decoded lazily, once per object version.
    """

    __slots__ = (
        "_labels",
        "_old_labels",
        "dry_run",
        "kind",
        "name",
        "namespace",
        "object",
        "old_object",
        "operation",
        "request_kind",
        "request_resource",
        "request_sub_resource",
        "resource",
        "sub_resource",
        "uid",
    )

    def __init__(
        self,
        *,
        uid: str,
        operation: str,
        kind: GroupVersionKind,
        resource: GroupVersionResource,
        sub_resource: str = "",
        name: str = "",
        namespace: str = "",
        object: msgspec.Raw | None = None,
        old_object: msgspec.Raw | None = None,
        dry_run: bool = False,
        request_kind: GroupVersionKind | None = None,
        request_resource: GroupVersionResource | None = None,
        request_sub_resource: str | None = None,
    ) -> None:
        self.uid = uid
        self.operation = operation
        self.kind = kind
        self.resource = resource
        self.sub_resource = sub_resource
        self.name = name
        self.namespace = namespace
        self.object = object
        self.old_object = old_object
        self.dry_run = dry_run
        # The original request (REV-07: the request itself when the caller omitted these).
        self.request_kind = kind if request_kind is None else request_kind
        self.request_resource = resource if request_resource is None else request_resource
        self.request_sub_resource = sub_resource if request_sub_resource is None else request_sub_resource
        self._labels: dict[str, str] | bool | None = False  # False: not decoded yet
        self._old_labels: dict[str, str] | bool | None = False

    def object_labels(self) -> dict[str, str] | None:
        if self._labels is False:
            self._labels = object_labels(self.object)
        return self._labels  # type: ignore[return-value]

    def old_object_labels(self) -> dict[str, str] | None:
        if self._old_labels is False:
            self._old_labels = object_labels(self.old_object)
        return self._old_labels  # type: ignore[return-value]

    def with_object(self, obj: msgspec.Raw) -> AdmissionAttributes:
        """The same request with a new current object (after a mutating backend's patch)."""
        new = AdmissionAttributes(
            uid=self.uid,
            operation=self.operation,
            kind=self.kind,
            resource=self.resource,
            sub_resource=self.sub_resource,
            name=self.name,
            namespace=self.namespace,
            object=obj,
            old_object=self.old_object,
            dry_run=self.dry_run,
            request_kind=self.request_kind,
            request_resource=self.request_resource,
            request_sub_resource=self.request_sub_resource,
        )
        new._old_labels = self._old_labels
        return new

    @property
    def is_namespace_object(self) -> bool:
        """MAT-14 quirk: only the resource name ``namespaces`` is looked at, not group or version."""
        return self.resource.resource == "namespaces"

    def __repr__(self) -> str:
        res = self.resource
        sub = f"/{self.sub_resource}" if self.sub_resource else ""
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return (
            f"<AdmissionAttributes {self.operation} {res.group or 'core'}/{res.version}/{res.resource}{sub}"
            f" {where!r} uid={self.uid}>"
        )
