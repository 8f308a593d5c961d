"""The ASGI application: /validate, /mutate, /convert/<crd name>, /healthz, /readyz, /metrics.

Reads the body (bounded, TRN-13), decodes the inbound review (REV-01), takes the configuration
snapshot the review will use from start to end (ORD-04), runs dispatch under the caller's deadline
(FPT-07) and answers in the caller's version (REV-02). A caller that disconnects cancels its
review's backend calls. Nothing a client or a backend does can raise out of here.

A plain ASGI application: it imports nothing of the server that runs it. The gateway's server
tells it that a caller went away through the ``webhook-gateway.disconnect`` scope extension
(``gateway.server.extensions``, docs/inbound.md); under any other ASGI server a task per review
reads ``receive`` for ``http.disconnect`` instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import structlog
import trio

from gateway.config.model import Snapshot
from gateway.dispatch import status as statuses
from gateway.dispatch.engine import Dispatcher, Verdict
from gateway.errors import BadReview
from gateway.registration import HALVES, Half, half_of, half_path
from gateway.review import InboundReview, ReplyTemplate, decode_inbound, encode_reply, encode_status
from gateway.server.extensions import disconnect_signal
from gateway.server.overload import OverloadGate
from gateway.server.timeouts import caller_timeout
from gateway.tracing import start_review_trace

if TYPE_CHECKING:
    from gateway.conversion.convert import ConversionService

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = structlog.get_logger("gateway.server")

_JSON = [(b"content-type", b"application/json")]
_TEXT = [(b"content-type", b"text/plain; charset=utf-8")]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    validate_path: str = "/validate"
    mutate_path: str = "/mutate"
    max_request_bytes: int = 32 * 1024 * 1024  # TRN-13: object + oldObject at 3 MiB each, and headroom
    default_timeout_seconds: float = 10.0  # FPT-07 when ?timeout= is missing or unparseable
    deadline_margin_seconds: float = 0.2  # FPT-07: answer this long before the caller gives up
    readiness_wait_seconds: float = 10.0  # MAT-33
    convert_prefix: str = "/convert/"  # CNV-01: POST /convert/<crd name>
    serve_metrics: bool = True  # False when a separate metrics listener (--metrics-bind) serves them


class ReviewObserver(Protocol):
    """Receives the facts of every request (metrics, logs). Must be cheap and must not raise."""

    def review_started(self, endpoint: str) -> None: ...

    def review_finished(
        self,
        endpoint: str,
        *,
        code: int,
        seconds: float,
        inbound: InboundReview | None,
        verdict: Verdict | None,
        error: str = "",
        trace: str = "",
        line: bool = True,
    ) -> None: ...

    def metrics(self) -> tuple[bytes, str] | None: ...


class NullObserver:
    """An observer that records nothing (tests, and `--no-metrics --log-level off`)."""

    def review_started(self, endpoint: str) -> None:
        pass

    def review_finished(self, endpoint: str, **_: Any) -> None:
        pass

    def metrics(self) -> tuple[bytes, str] | None:
        return None


class Readiness:
    """Ready means: a configuration is loaded and the namespace source (if needed) has synced.

    ``draining`` flips /readyz to 503 at once on shutdown while reviews keep being served.
    Whoever changes what a check reads (a source's first sync, a configuration reload) calls
    ``changed``: reviews waiting for readiness (MAT-33) look again then, and only then.
    """

    def __init__(self) -> None:
        self.draining = False
        self._checks: list[Callable[[], bool]] = []
        self._changed = trio.Event()
        # With --workers N: are the other worker processes ready too? Only /readyz asks (reviews
        # need this process to be ready, nothing more).
        self.peers: Callable[[], bool] | None = None

    def add_check(self, check: Callable[[], bool]) -> None:
        self._checks.append(check)
        self.changed()

    @property
    def ready(self) -> bool:
        return all(check() for check in self._checks)

    def changed(self) -> None:
        """Something a check reads may have changed: wake everyone waiting in ``wait``."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, until: float, *, also: Callable[[], bool] = lambda: True) -> bool:
        """Wait until ready (and ``also()``), at most until trio time ``until``; whether it is.

        Woken by ``changed``, not by polling: a review starts the moment the gateway is ready.
        """
        with trio.move_on_at(until):
            while not (self.ready and also()):
                await self._changed.wait()
            return True
        return False


def _encode_verdict(inbound: InboundReview, verdict: Verdict, endpoint: str) -> bytes:
    """The AdmissionReview reply for ``verdict``, on both paths (answered at once and ASGI)."""
    try:
        return encode_reply(
            inbound,
            allowed=verdict.allowed,
            status=verdict.status,
            patch=verdict.patch,
            warnings=verdict.warnings,
            audit_annotations=verdict.audit_annotations,
        )
    except Exception as exc:  # ERR-08: a gateway bug is a deny, never a crash or an HTTP error
        log.exception("encoding the reply failed", uid=inbound.uid, endpoint=endpoint)
        status = statuses.internal_error_status("encoding the reply", str(exc) or type(exc).__name__)
        return encode_reply(inbound, allowed=False, status=status)


_SHED_REPLIES: Final = 1024  # reply templates kept (then forgotten together)


class GatewayApp:
    """The ASGI callable hypercorn serves."""

    def __init__(
        self,
        *,
        snapshot: Callable[[], Snapshot | None],
        dispatcher: Dispatcher,
        readiness: Readiness,
        observer: ReviewObserver | None = None,
        settings: ServerSettings | None = None,
        conversions: ConversionService | None = None,
        overload: OverloadGate | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.conversions = conversions
        self.dispatcher = dispatcher
        self.readiness = readiness
        self.observer: ReviewObserver = observer or NullObserver()
        self.settings = settings or ServerSettings()
        self.overload = overload  # sheds reviews the gateway cannot start in time (None: never)
        self._endpoints = {self.settings.validate_path: "validating", self.settings.mutate_path: "mutating"}
        # The validating backends of one failurePolicy only, for the -fail/-ignore registrations.
        self._halves = {half_path(self.settings.validate_path, half): half for half, _ in HALVES}
        self._endpoints.update(dict.fromkeys(self._halves, "validating"))
        self.in_flight = 0  # reviews being handled right now (graceful shutdown waits for zero)
        self._shed_line_at: dict[str, int] = {}  # endpoint -> the second of its last shed review line
        self.answered_at_once = 0  # shed reviews answered where they were read (no task, no ASGI request)
        # verdict id and apiVersion -> the verdict (kept alive, so the id stays its) and its reply
        self._shed_replies: dict[tuple[int, str], tuple[Verdict, ReplyTemplate]] = {}
        self._idle = trio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no review is in flight."""
        await self._idle.wait()

    def answer_at_once(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """The whole answer to a review the overload gate sheds, decided right where it was read.

        The server asks this for a request whose body came whole with its head, before it starts
        anything for it (``gateway.server.limits.InboundRuntime.answer_at_once``): a shed review
        then costs its decision (decode, match, the failurePolicy of each matched backend, encode)
        and no task, ASGI scope or stream. The answer is the one ``_review`` gives the same review
        when shed, byte for byte. None for everything else, which the server hands to the ASGI
        path as usual: not a review, not shed, malformed (400), or a decision that must wait (the
        gateway not ready yet, a namespace lookup).
        """
        if self.overload is None or method != b"POST":
            return None
        try:
            return self._answer_at_once(target, headers, body)
        except Exception:  # a gateway bug here must not cost the connection: the ordinary path decides
            log.exception("answering a shed review at once failed")
            return None

    def _answer_at_once(
        self, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        overload = self.overload
        assert overload is not None
        raw_path, _, query = target.partition(b"?")
        path = raw_path.decode("latin-1")
        endpoint = self._endpoints.get(path)
        if endpoint is None or not self.readiness.ready:
            return None
        reason = overload.shed_reason()
        if reason is None:
            return None
        snapshot = self.snapshot()
        if snapshot is None:
            return None
        half = self._halves.get(path)
        if half is not None:
            snapshot = half_of(snapshot, half)
        try:
            inbound = decode_inbound(body)
        except BadReview:
            return None
        arrived = trio.current_time()
        budget = caller_timeout(query)
        budget = self.settings.default_timeout_seconds if budget is None else budget
        deadline = arrived + budget - self.settings.deadline_margin_seconds
        verdict = self.dispatcher.decide_shed(
            endpoint,  # type: ignore[arg-type]
            inbound,
            snapshot,
            deadline=deadline,
            shed=reason,
        )
        if verdict is None:
            return None
        overload.count_shed(reason)
        self.answered_at_once += 1
        reply = self._shed_reply(inbound, verdict, endpoint)
        observer = self.observer
        observer.review_started(endpoint)
        # The review line of one shed review per endpoint and second; the others are counted only
        # (webhook_gateway_reviews_total, ..._shed_total): a line costs a tenth of a shed answer.
        second = int(arrived)
        line = self._shed_line_at.get(endpoint) != second
        if line:
            self._shed_line_at[endpoint] = second
        observer.review_finished(
            endpoint,
            code=200,
            seconds=trio.current_time() - arrived,
            inbound=inbound,
            verdict=verdict,
            trace=_value(headers, b"traceparent"),
            line=line,
        )
        return 200, [*_JSON, (b"content-length", str(len(reply)).encode())], reply

    def _shed_reply(self, inbound: InboundReview, verdict: Verdict, endpoint: str) -> bytes:
        """``_encode_verdict``'s bytes, from a template per verdict and apiVersion: the shed reviews
        of one class share one verdict (``Dispatcher.decide_shed``), so only their uids differ."""
        key = (id(verdict), inbound.api_version)
        found = self._shed_replies.get(key)
        if found is None or found[0] is not verdict:
            try:
                template = ReplyTemplate(
                    inbound.api_version,
                    allowed=verdict.allowed,
                    status=verdict.status,
                    patch=verdict.patch,
                    warnings=verdict.warnings,
                    audit_annotations=verdict.audit_annotations,
                )
            except Exception:  # noqa: BLE001 - _encode_verdict says what failed and denies (ERR-08)
                return _encode_verdict(inbound, verdict, endpoint)
            if len(self._shed_replies) >= _SHED_REPLIES:
                self._shed_replies.clear()
            found = self._shed_replies[key] = (verdict, template)
        return found[1].render(inbound.uid)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await _lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = request_path(scope)
        method: str = scope["method"]
        if self.conversions is not None and path.startswith(self.settings.convert_prefix):
            await self._conversion(path, method, scope, receive, send)
            return
        endpoint = self._endpoints.get(path)
        if endpoint is not None:
            if method != "POST":
                await _respond(
                    send,
                    405,
                    encode_status(405, "MethodNotAllowed", f"{method} is not allowed on {path}: use POST"),
                    _JSON,
                    extra=[(b"allow", b"POST")],
                )
                return
            await self._review(endpoint, scope, receive, send, half=self._halves.get(path))
            return
        if method not in ("GET", "HEAD"):
            await _respond(send, 405 if path in ("/healthz", "/readyz", "/metrics") else 404, b"", _TEXT)
            return
        if path == "/healthz":
            await _respond(send, 200, b"ok\n", _TEXT)
        elif path == "/readyz":
            if self.readiness.draining:
                await _respond(send, 503, b"draining\n", _TEXT)
            elif not self.readiness.ready or (
                self.readiness.peers is not None and not self.readiness.peers()
            ):
                await _respond(send, 503, b"not ready\n", _TEXT)
            else:
                await _respond(send, 200, b"ok\n", _TEXT)
        elif (
            path == "/metrics" and self.settings.serve_metrics and (m := self.observer.metrics()) is not None
        ):
            await self.respond_metrics(send, m)
        else:
            await _respond(send, 404, encode_status(404, "NotFound", f"no such path: {path}"), _JSON)

    @staticmethod
    async def respond_metrics(send: Send, rendered: tuple[bytes, str]) -> None:
        body, content_type = rendered
        await _respond(send, 200, body, [(b"content-type", content_type.encode())])

    async def _review(
        self, endpoint: str, scope: Scope, receive: Receive, send: Send, *, half: Half | None = None
    ) -> None:
        arrived = trio.current_time()
        traceparent = _header(scope, b"traceparent")
        start_review_trace(traceparent)  # backend calls carry child contexts of the caller's trace
        self.observer.review_started(endpoint)
        if not self.in_flight:
            self._idle = trio.Event()
        self.in_flight += 1
        code, inbound, verdict, error = 500, None, None, ""
        try:
            try:
                body = await self._read_body(scope, receive)
            except _DisconnectedError:
                code, error = 499, "caller disconnected while sending"
                return
            if body is None:
                code, error = 413, f"request body exceeds {self.settings.max_request_bytes} bytes"
                await _respond(send, 413, encode_status(413, "RequestEntityTooLarge", error), _JSON)
                return
            try:
                inbound = decode_inbound(body)
            except BadReview as exc:  # REV-01
                code, error = 400, str(exc)
                await _respond(send, 400, encode_status(400, "BadRequest", error), _JSON)
                return
            deadline = arrived + self._budget(scope) - self.settings.deadline_margin_seconds
            with self.overload.review() if self.overload is not None else nullcontext() as shed:
                verdict = await self._decide(
                    endpoint, inbound, deadline, scope, receive, shed=shed, half=half
                )
            if verdict is None:  # the caller went away; nobody is listening
                code, error = 499, "caller disconnected"
                return
            reply = _encode_verdict(inbound, verdict, endpoint)
            code = 200
            await _respond(send, 200, reply, _JSON)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()
            self.observer.review_finished(
                endpoint,
                code=code,
                seconds=trio.current_time() - arrived,
                inbound=inbound,
                verdict=verdict,
                error=error,
                trace=traceparent,
            )

    async def _conversion(self, path: str, method: str, scope: Scope, receive: Receive, send: Send) -> None:
        """CNV-01..15: relay one ConversionReview to the CRD's conversion backend."""
        assert self.conversions is not None
        if method != "POST":
            message = f"{method} is not allowed on {path}: use POST"
            await _respond(send, 405, encode_status(405, "MethodNotAllowed", message), _JSON)
            return
        arrived = trio.current_time()
        traceparent = _header(scope, b"traceparent")
        start_review_trace(traceparent)  # the backend call carries a child of the caller's trace
        if not self.in_flight:
            self._idle = trio.Event()
        self.in_flight += 1
        try:
            try:
                body = await self._read_body(scope, receive)
            except _DisconnectedError:
                return
            if body is None:
                error = f"request body exceeds {self.settings.max_request_bytes} bytes"
                await _respond(send, 413, encode_status(413, "RequestEntityTooLarge", error), _JSON)
                return
            snapshot = self.snapshot()
            if snapshot is None:
                error = "the gateway has not loaded its configuration yet"
                await _respond(send, 503, encode_status(503, "ServiceUnavailable", error), _JSON)
                return
            # CNV-14: the CRD's own timeout, capped by the caller's ?timeout= minus the margin.
            budget = self._budget(scope) if _has_timeout(scope) else None
            deadline = None if budget is None else arrived + budget - self.settings.deadline_margin_seconds
            crd_name = path[len(self.settings.convert_prefix) :]  # as sent, like every path
            handled: list[tuple[int, bytes]] = []
            signal = disconnect_signal(scope)
            with trio.CancelScope() as cancel:  # a caller that goes away cancels the backend call
                if signal is not None:
                    if signal.disconnected:
                        return
                    signal.on_disconnect = cancel.cancel
                try:
                    handled.append(
                        await self.conversions.handle(
                            snapshot, crd_name, body, deadline=deadline, trace=traceparent
                        )
                    )
                finally:
                    if signal is not None:
                        signal.on_disconnect = None
            if handled:
                await _respond(send, handled[0][0], handled[0][1], _JSON)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    def _budget(self, scope: Scope) -> float:
        """FPT-07: the caller's ``?timeout=`` (Go duration), else the configured default."""
        seconds = caller_timeout(scope.get("query_string", b""))
        return self.settings.default_timeout_seconds if seconds is None else seconds

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole request body, or None once it exceeds the limit (TRN-13)."""
        limit = self.settings.max_request_bytes
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _DisconnectedError
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks) if len(chunks) != 1 else chunks[0]

    async def _decide(
        self,
        endpoint: str,
        inbound: InboundReview,
        deadline: float,
        scope: Scope,
        receive: Receive,
        *,
        shed: str | None,
        half: Half | None = None,
    ) -> Verdict | None:
        """Run dispatch while watching for the caller going away (then cancel everything).

        ``shed``: the overload gate's reason to refuse every backend call of this review, or None.
        """
        signal = disconnect_signal(scope)
        if signal is not None:
            # The gateway's server says when the caller goes away (gateway.server.extensions):
            # cancel through a callback instead of a watcher task and a nursery per review (~50 µs).
            if signal.disconnected:
                return None
            with trio.CancelScope() as cancel:
                signal.on_disconnect = cancel.cancel
                try:
                    return await self._decide_now(endpoint, inbound, deadline, shed, half)
                finally:
                    signal.on_disconnect = None
            return None
        # Any other ASGI server: a task reads ``receive`` until it says the caller went away.
        result: list[Verdict] = []

        async def watch_disconnect(cancel: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, nursery.cancel_scope)
            result.append(await self._decide_now(endpoint, inbound, deadline, shed, half))
            nursery.cancel_scope.cancel()
        return result[0] if result else None

    async def _decide_now(
        self,
        endpoint: str,
        inbound: InboundReview,
        deadline: float,
        shed: str | None,
        half: Half | None = None,
    ) -> Verdict:
        return await self.dispatcher.decide(
            endpoint,  # type: ignore[arg-type]
            inbound,
            self._ready_snapshot if half is None else lambda d: self._ready_half(d, half),
            deadline=deadline,
            shed=shed,
        )

    async def _ready_half(self, deadline: float, half: Half) -> Snapshot | None:
        """The ready snapshot narrowed to the validating backends of one failurePolicy."""
        snapshot = await self._ready_snapshot(deadline)
        return None if snapshot is None else half_of(snapshot, half)

    async def _ready_snapshot(self, deadline: float) -> Snapshot | None:
        """The snapshot to decide with once the gateway is ready (MAT-33), or None if not by then."""
        return self.snapshot() if await self._wait_ready(deadline) else None

    async def _wait_ready(self, deadline: float) -> bool:
        """MAT-33: wait up to min(10 s, budget) for readiness (``Readiness.changed`` wakes it)."""
        if self.readiness.ready and self.snapshot() is not None:
            return True
        give_up = min(trio.current_time() + self.settings.readiness_wait_seconds, deadline)
        return await self.readiness.wait(give_up, also=lambda: self.snapshot() is not None)


class _DisconnectedError(Exception):
    """The caller went away while sending its body."""


def _has_timeout(scope: Scope) -> bool:
    """Whether the caller sent a usable ``?timeout=`` (CNV-14 falls back to the CRD's own timeout)."""
    return caller_timeout(scope.get("query_string", b"")) is not None


def request_path(scope: Scope) -> str:
    """The path the gateway routes on: the request's path exactly as sent (docs/inbound.md, "Paths").

    Not ASGI's ``path``, which is percent-decoded: one rule for every protocol path, and no second
    spelling of a path — ``/%6detrics`` is not ``/metrics``, ``/validate/`` is not ``/validate`` —
    so that no filter in front of the gateway (a proxy, an L7 policy) can be walked around by
    spelling a path differently. The apiserver sends the path of the registration as written; the
    gateway's paths need no escapes. Under an ASGI server without ``raw_path``, ``path`` is used.
    """
    raw = scope.get("raw_path")
    return raw.decode("latin-1") if raw is not None else str(scope["path"])


def _header(scope: Scope, name: bytes) -> str:
    return _value(scope["headers"], name)


def _value(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    key: bytes
    value: bytes
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return ""


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    hdrs = [*headers, (b"content-length", str(len(body)).encode())]
    if extra:
        hdrs += extra
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
