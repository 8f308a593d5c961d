"""One inbound review, decoded once: the typed view every later stage reads.

``decode_inbound`` (``gateway.review.inbound``) builds an ``InboundReview`` once per HTTP request.
From then on nothing re-parses the body: matching reads ``attributes`` (rules, selectors), CEL reads
``cel_request`` (MAT-25), the backend encoder (``gateway.review.codec``) splices ``template`` bytes
around each call's uid and object, and the reply encoder reads ``api_version``/``uid``. The derived
parts are built on first use and kept on the instance (one review's lifetime; never module-level).

This module sits below both ``inbound`` and ``codec``, so neither imports the other.
"""

from __future__ import annotations

from typing import Final

import msgspec

from gateway.admission import (
    AdmissionAttributes,
    GroupVersionKind,
    GroupVersionResource,
    NestedTooDeeplyError,
    decode_nested,
)
from gateway.review.types import API_VERSIONS, InboundRequest, RequestHeader, ReviewVersion

_encoder: Final = msgspec.json.Encoder()
_decoder: Final = msgspec.json.Decoder()


class RequestTemplate:
    """The bytes of a backend request that never change within one inbound review.

    A request is ``head(version) + uid + middle + ',"object":' + object + suffix``: only the uid and
    the current object vary per call, and v1/v1beta1 differ only in the head. Joining five byte strings
    is cheaper than building and encoding a Struct per call, and the object is copied exactly once.
    """

    __slots__ = ("middle", "suffix")

    def __init__(self, req: InboundRequest) -> None:
        header = _encoder.encode(
            RequestHeader(
                kind=req.kind,
                resource=req.resource,
                sub_resource=req.sub_resource,
                request_kind=req.request_kind,
                request_resource=req.request_resource,
                request_sub_resource=req.request_sub_resource or "",
                name=req.name,
                namespace=req.namespace,
                operation=req.operation,
                user_info=req.user_info,
            )
        )
        self.middle = b"," + header[1:-1]  # the members of the object, without its braces
        self.suffix = b"".join(
            (
                b',"oldObject":',
                req.old_object,
                b',"dryRun":',
                b"true" if req.dry_run else b"false",  # always present (REV-06)
                b',"options":',
                req.options,
                b"}}",
            )
        )


def _gvk(gvk: GroupVersionKind | None) -> dict[str, str]:
    gvk = gvk or GroupVersionKind()
    return {"group": gvk.group, "version": gvk.version, "kind": gvk.kind}


def _gvr(gvr: GroupVersionResource | None) -> dict[str, str]:
    gvr = gvr or GroupVersionResource()
    return {"group": gvr.group, "version": gvr.version, "resource": gvr.resource}


class InboundReview:
    """One decoded, validated inbound AdmissionReview (immutable by convention).

    ``api_version`` is the full inbound apiVersion and ``version`` its short form; ``request`` is the
    request as received, with REV-07's defaults filled (objects Raw); ``attributes`` is what matching
    and dispatch read.
    """

    __slots__ = ("_cel_request", "_template", "api_version", "attributes", "request", "uid", "version")

    def __init__(self, *, api_version: str, request: InboundRequest, attributes: AdmissionAttributes) -> None:
        self.api_version = api_version
        self.version: ReviewVersion = API_VERSIONS[api_version]
        self.uid = request.uid
        self.request = request
        self.attributes = attributes
        self._template: RequestTemplate | None = None
        self._cel_request: dict[str, object] | None = None

    @property
    def template(self) -> RequestTemplate:
        """The unchanging bytes of every backend request of this review (built on first use)."""
        template = self._template
        if template is None:
            template = self._template = RequestTemplate(self.request)
        return template

    def cel_request(self) -> dict[str, object]:
        """CEL's ``request`` (MAT-25) as JSON-like data: the fields sent to a backend (REV-06).

        ``requestKind``/``requestResource``/``requestSubResource`` are the inbound request's own
        (REV-07 filled them when absent), not copies of ``kind``/``resource``. ``options`` is decoded
        here; an ``options`` CEL cannot use is caught where CEL converts it (MAT-26). Built on first
        use: most reviews never evaluate CEL. Callers must not modify the returned mapping.
        """
        fields = self._cel_request
        if fields is None:
            req = self.request
            user = req.user_info
            fields = self._cel_request = {
                "uid": req.uid,
                "kind": _gvk(req.kind),
                "resource": _gvr(req.resource),
                "subResource": req.sub_resource,
                "requestKind": _gvk(req.request_kind),
                "requestResource": _gvr(req.request_resource),
                "requestSubResource": req.request_sub_resource or "",
                "name": req.name,
                "namespace": req.namespace,
                "operation": req.operation,
                "userInfo": {
                    "username": user.username,
                    "uid": user.uid,
                    "groups": list(user.groups),
                    "extra": {key: list(values) for key, values in user.extra.items()},
                },
                "dryRun": bool(req.dry_run),
                "options": _options(req.options),
            }
        return fields

    def __repr__(self) -> str:
        return f"<InboundReview {self.api_version} {self.attributes!r}>"


def _options(raw: msgspec.Raw) -> object:
    if bytes(memoryview(raw)[:1]) == b"n":
        return None
    try:
        # As deep as the inbound decode allowed; whether CEL can use it is decided where CEL
        # converts it (too deep for the interpreter: an evaluation failure, MAT-26).
        return decode_nested(_decoder, raw)
    except (msgspec.DecodeError, NestedTooDeeplyError):  # not reachable for a decoded review
        return None
