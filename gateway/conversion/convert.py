"""One conversion, end to end: look up the CRD, consult the cache, call the backend, verify, answer.

``ConversionService.handle`` takes a caller's body and deadline and returns the HTTP answer: 404
with a Status for an unknown CRD (CNV-01), 400 for a malformed review (CNV-04), otherwise HTTP 200
in the caller's version with ``Success`` or ``Failure`` (CNV-05, CNV-13: no failurePolicy). The
backend is called through the gateway's one outbound caller (``gateway.transport.caller``), as the
admission backends are: same targets, TLS, per-host credentials, endpoint balancing and error
mapping (CNV-15, §10); the facts of every conversion go to ``on_finished`` as a
``ConversionReport`` (metrics and the canonical log line).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import structlog
import trio

from gateway.config.model import ConversionEntry, Snapshot
from gateway.conversion.cache import ConversionCache
from gateway.conversion.codec import (
    ConversionRequest,
    ReviewVersion,
    decode_backend_reply,
    decode_inbound,
    encode_backend_request,
    encode_reply,
)
from gateway.conversion.verify import (
    CALL_FAILURE,
    ConversionFailedError,
    object_head,
    verify_count,
    verify_object,
    verify_review,
)
from gateway.dispatch.status import http_error_cause
from gateway.errors import BadReview, CallingWebhookError
from gateway.review import encode_status, new_request_uid
from gateway.transport.caller import BackendCaller

log = structlog.get_logger("gateway.conversion")

NO_SUPPORTED_VERSIONS: Final = "no supported conversion review versions"
_SPOKEN: Final[dict[str, ReviewVersion]] = {"v1": "v1", "v1beta1": "v1beta1"}


# --- the report ------------------------------------------------------------------------------------


@dataclass(slots=True)
class ConversionReport:
    """What happened in one conversion request, for metrics (MET-10/11) and the canonical log line."""

    crd: str
    code: int = 200
    uid: str = ""
    inbound_version: str = ""
    from_version: str = ""
    to_version: str = ""
    objects: int = 0
    backend: str = ""
    review_version: str = ""
    # "success" | "failure" | "error" (answered without a ConversionReview: 400, 404) | "cancelled"
    result: str = "success"
    failure_type: str = ""
    reason: str = ""
    timed_out: bool = False
    called: bool = False
    backend_seconds: float = 0.0
    seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    cache_bytes: int = 0
    cache_entries: int = 0
    trace: str = ""


def _version_label(api_version: object, entry: ConversionEntry) -> str:
    """The version part of an apiVersion, bounded to the CRD's versions (metric label cardinality)."""
    version = api_version.rpartition("/")[2] if isinstance(api_version, str) else ""
    return version if version in entry.versions or not entry.versions else "other"


def negotiate(entry: ConversionEntry) -> ReviewVersion | None:
    """CNV-06: the first of the backend's conversionReviewVersions the gateway speaks."""
    for name in entry.conversion_review_versions:
        if name in _SPOKEN:
            return _SPOKEN[name]
    return None


# --- the service -----------------------------------------------------------------------------------


class ConversionService:
    """Answers ``POST /convert/<crd name>``; one per gateway, shared by every request."""

    def __init__(
        self,
        caller: BackendCaller,
        *,
        cache: ConversionCache | None = None,
        on_finished: Callable[[ConversionReport], None] | None = None,
    ) -> None:
        self.caller = caller
        self.cache = cache
        self.on_finished = on_finished

    async def handle(
        self, snapshot: Snapshot, crd_name: str, body: bytes, *, deadline: float | None, trace: str = ""
    ) -> tuple[int, bytes]:
        """The HTTP status and body for one request; ``deadline=None``: the CRD's own timeout only."""
        started = trio.current_time()
        report = ConversionReport(crd=crd_name, trace=trace)
        try:
            entry = snapshot.conversions.get(crd_name)
            if entry is None:
                report.code, report.result = 404, "error"
                report.reason = (
                    f"no conversion webhook is configured for CustomResourceDefinition {crd_name!r}"
                )
                return 404, encode_status(404, "NotFound", report.reason)
            try:
                request = decode_inbound(body)
            except BadReview as exc:
                report.code, report.result, report.reason = 400, "error", str(exc)
                return 400, encode_status(400, "BadRequest", str(exc))
            report.uid, report.inbound_version = request.uid, request.version
            report.objects = len(request.objects)
            report.backend = self.caller.url_for(entry.client_config)
            report.to_version = _version_label(request.desired_api_version, entry)
            if request.objects:
                first = object_head(request.objects[0])
                report.from_version = _version_label(first.api_version if first else None, entry)
            limit = started + entry.timeout_seconds
            report.code, report.result = 499, "cancelled"  # until an answer exists: the caller went away
            try:
                converted = await self._convert(
                    entry, request, min(limit, deadline) if deadline is not None else limit, report
                )
                report.code, report.result = 200, "success"
            except ConversionFailedError as exc:
                report.code = 200
                report.result, report.failure_type = "failure", exc.failure_type
                report.reason, report.timed_out = exc.reason, exc.timed_out
                message = f'conversion webhook "{crd_name}" ({report.backend}) failed: {exc.reason}'
                return 200, encode_reply(request.version, uid=request.uid, failure=message)
            except Exception as exc:  # a gateway bug is a Failure answer, never a crash
                log.exception("conversion failed inside the gateway", crd=crd_name, uid=request.uid)
                report.code, report.result, report.failure_type = 200, "failure", CALL_FAILURE
                report.reason = f"internal error: {exc or type(exc).__name__}"
                message = f'conversion webhook "{crd_name}" ({report.backend}) failed: {report.reason}'
                return 200, encode_reply(request.version, uid=request.uid, failure=message)
            return 200, encode_reply(request.version, uid=request.uid, objects=converted)
        finally:
            report.seconds = trio.current_time() - started
            if self.cache is not None:
                report.cache_bytes, report.cache_entries = self.cache.bytes, len(self.cache)
            if self.on_finished is not None:
                self.on_finished(report)

    async def _convert(
        self, entry: ConversionEntry, request: ConversionRequest, deadline: float, report: ConversionReport
    ) -> tuple[bytes, ...]:
        """The converted objects in the caller's order, or ``ConversionFailedError``."""
        objects = request.objects
        if not objects:
            return ()  # CNV-07: nothing to convert, no call
        cache = self.cache if entry.cache else None
        found: list[bytes | None] = [None] * len(objects)
        if cache is not None:
            report.cache_evictions += cache.sync(entry)
            found, expired = cache.get_many(entry, request.desired_api_version, objects)
            report.cache_evictions += expired
        misses = [i for i, hit in enumerate(found) if hit is None]
        if cache is not None:
            report.cache_hits, report.cache_misses = len(objects) - len(misses), len(misses)
        if misses:
            to_send = tuple(objects[i] for i in misses)
            converted = await self._call(entry, request, to_send, deadline, report)
            for i, obj in zip(misses, converted, strict=True):
                found[i] = obj
            if cache is not None:
                report.cache_evictions += cache.put_many(
                    entry, request.desired_api_version, list(zip(to_send, converted, strict=True))
                )
        return tuple(o for o in found if o is not None)

    async def _call(
        self,
        entry: ConversionEntry,
        request: ConversionRequest,
        objects: tuple[bytes, ...],
        deadline: float,
        report: ConversionReport,
    ) -> list[bytes]:
        version = negotiate(entry)
        if version is None:
            raise ConversionFailedError(NO_SUPPORTED_VERSIONS, CALL_FAILURE)  # CNV-06
        report.review_version = version
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            url = self.caller.url_for(entry.client_config, timeout_seconds=0)
            raise ConversionFailedError(
                f'Post "{url}": context deadline exceeded', CALL_FAILURE, timed_out=True
            )
        uid = new_request_uid()
        body = encode_backend_request(
            version, uid=uid, desired_api_version=request.desired_api_version, objects=objects
        )
        report.called = True
        started = trio.current_time()
        try:
            reply = await self.caller.post(entry.client_config, body, timeout_seconds=remaining)
        except CallingWebhookError as exc:  # CNV-13: the transport's failure, as upstream words it
            reason = f'Post "{exc.url}": {exc.cause}' if exc.url else exc.cause
            raise ConversionFailedError(reason, CALL_FAILURE, timed_out=exc.kind == "timeout") from None
        finally:
            report.backend_seconds = trio.current_time() - started
        if not 200 <= reply.status <= 206:
            cause, _code = http_error_cause(reply.status, reply.content_type, reply.body)
            raise ConversionFailedError(cause, CALL_FAILURE)
        try:
            review = decode_backend_reply(reply.body)
        except ValueError as exc:
            raise ConversionFailedError(str(exc), CALL_FAILURE) from None
        converted = verify_review(review, version=version, sent_uid=uid)  # CNV-09
        verify_count(converted, len(objects))  # CNV-10
        for i, (original, out) in enumerate(zip(objects, converted, strict=True)):
            verify_object(i, original, out, request.desired_api_version)  # CNV-11
        return converted
