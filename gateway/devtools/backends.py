"""Sample backend admission webhooks: a small, fast HTTP/1.1 + HTTP/2 server whose behaviour is
chosen by the URL path, like upstream's test webhook server (agnhost webhook, apiserver
``webhook_server.go``).

It sits *behind* the gateway: the gateway's tests, ``webhook-gateway demo`` and the load tests point
backend ``clientConfig.url`` at it. It is hand-written on h11/h2 rather than served by hypercorn because
an ASGI server costs ~500 µs CPU per request, which would dominate a load-test baseline.

Protocols: HTTP/1.1 keep-alive and HTTP/2 (h2c prior knowledge on plaintext; ALPN ``h2``/``http/1.1``
when an ``ssl.SSLContext`` is given). The query string (the gateway's ``?timeout=10s``) is ignored.

A path is a sequence of *steps*, percent-decoded per segment (so ``%2F`` stays inside a segment).
Modifier steps may repeat and compose; one terminal step ends the path (``allow`` when none is given)::

    sleep/<ms>                          wait before answering
    latency/fixed/<ms>                  the same, as a distribution
    latency/uniform/<lo_ms>/<hi_ms>     uniform random delay (seeded RNG: deterministic per server)
    latency/lognormal/<median_ms>/<sigma>
    errors/<fraction>                   answer HTTP 500 with that probability (after the delay)
    only-v1beta1                        HTTP 400 unless the review is admission.k8s.io/v1beta1
    warn/<text>                         add ``response.warnings`` entry
    annotate/<key>/<value>              add ``response.auditAnnotations`` entry
    patch/<name>                        JSONPatch adding label ``<name>: "true"`` (creates the map if absent)
    patch-annotation/<key>/<value>      JSONPatch adding annotation ``<key>: <value>``
    jsonpatch/<percent-encoded JSON array>  append these operations to the patch

    allow                               allowed (with any patch/warnings/annotations collected)
    deny[/<code>][/<message>]           allowed false, status {code (default 403), reason, message}
    deny-no-message                     allowed false, no status
    echo                                allowed, auditAnnotations["echo"] = the received body
    invalid-patch                       allowed, patch removing a path that does not exist
    undecodable-patch                   allowed, patch that is a JSON object, not an array
    wrong-uid | wrong-api-version | no-response | empty-body
    status/<code>[/<text>]              plain-text HTTP error
    close                               close the connection without answering (HTTP/2: the whole connection)
    redirect[/<path…>]                  307 to ``/<path…>`` (default ``/allow``)
    huge[/<bytes>]                      200 JSON body of that size (default 17 MiB: over the gateway's limit)

``/convert[/...]`` is the sample CRD conversion webhook (``gateway.devtools.conversion``).

Examples: ``/deny/403/image%20registry%20not%20allowed``, ``/sleep/200/deny``,
``/warn/tag%20latest/annotate/team/pay/patch/checked``. Replies echo ``request.uid`` and the request's
``apiVersion``. ``GET /healthz`` answers ``ok``. Unknown steps get 404, non-POST 405, undecodable
reviews 400.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import math
import random
import ssl
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import h11
import msgspec
import trio

from gateway.admission import NestedTooDeeplyError, decode_nested
from gateway.wire.tls import server_context

V1: Final = "admission.k8s.io/v1"
V1BETA1: Final = "admission.k8s.io/v1beta1"

HANDSHAKE_TIMEOUT_SECONDS: Final = 10.0
IDLE_TIMEOUT_SECONDS: Final = 120.0  # keep-alive connections with no request in flight
IO_TIMEOUT_SECONDS: Final = 30.0  # reading one request / writing one reply
MAX_DELAY_SECONDS: Final = 120.0
MAX_REQUEST_BYTES: Final = 64 * 1024 * 1024
HUGE_DEFAULT_BYTES: Final = 17 * 1024 * 1024
_PLAN_CACHE_SIZE: Final = 4096
_H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_RECEIVE_SIZE: Final = 65536


# --------------------------------------------------------------------------------------------------
# The plan: what a path asks for (pure, cached per path)


@dataclass(frozen=True, slots=True)
class Delay:
    """A delay distribution in milliseconds: fixed (a), uniform (a..b) or lognormal (median a, sigma b)."""

    kind: str
    a: float
    b: float = 0.0

    def sample_seconds(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            ms = self.a
        elif self.kind == "uniform":
            ms = rng.uniform(self.a, self.b)
        else:
            ms = rng.lognormvariate(math.log(self.a), self.b) if self.a > 0 else 0.0
        return min(max(ms, 0.0) / 1000.0, MAX_DELAY_SECONDS)


@dataclass(frozen=True, slots=True)
class Plan:
    """The behaviour a path selects; ``terminal`` names the final step, ``args`` its arguments."""

    terminal: str = "allow"
    args: tuple[str, ...] = ()
    delays: tuple[Delay, ...] = ()
    error_rate: float = 0.0
    only_v1beta1: bool = False
    warnings: tuple[str, ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    labels: tuple[str, ...] = ()
    patch_annotations: tuple[tuple[str, str], ...] = ()
    extra_ops: tuple[Any, ...] = ()

    @property
    def mutates(self) -> bool:
        return bool(self.labels or self.patch_annotations or self.extra_ops)


class PlanError(ValueError):
    """The path does not spell a known behaviour (answered with 404)."""


_TERMINALS_NO_ARGS: Final = frozenset(
    {
        "allow",
        "deny-no-message",
        "echo",
        "invalid-patch",
        "undecodable-patch",
        "wrong-uid",
        "wrong-api-version",
        "no-response",
        "empty-body",
        "close",
    }
)


def parse_plan(path: str) -> Plan:
    """Parse a request path (without query) into a Plan; raise PlanError for unknown steps."""
    segs = [unquote(s) for s in path.split("/") if s]
    delays: list[Delay] = []
    error_rate = 0.0
    only_v1beta1 = False
    warnings: list[str] = []
    annotations: list[tuple[str, str]] = []
    labels: list[str] = []
    patch_annotations: list[tuple[str, str]] = []
    extra_ops: list[Any] = []
    terminal = "allow"
    args: tuple[str, ...] = ()
    i = 0

    def take(n: int) -> list[str]:
        nonlocal i
        if i + n > len(segs):
            raise PlanError(f"step {segs[i - 1]!r} needs {n} argument(s)")
        got = segs[i : i + n]
        i += n
        return got

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise PlanError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < 0:
            raise PlanError(f"not a non-negative number: {text!r}")
        return value

    while i < len(segs):
        step = segs[i]
        i += 1
        if step == "sleep":
            delays.append(Delay("fixed", number(take(1)[0])))
        elif step == "latency":
            kind = take(1)[0]
            if kind == "fixed":
                delays.append(Delay("fixed", number(take(1)[0])))
            elif kind in ("uniform", "lognormal"):
                a, b = take(2)
                delays.append(Delay(kind, number(a), number(b)))
            else:
                raise PlanError(f"unknown latency distribution {kind!r}")
        elif step == "errors":
            error_rate = min(number(take(1)[0]), 1.0)
        elif step == "only-v1beta1":
            only_v1beta1 = True
        elif step == "warn":
            warnings.append(take(1)[0])
        elif step == "annotate":
            k, v = take(2)
            annotations.append((k, v))
        elif step == "patch":
            labels.append(take(1)[0])
        elif step == "patch-annotation":
            k, v = take(2)
            patch_annotations.append((k, v))
        elif step == "jsonpatch":
            try:
                ops = msgspec.json.decode(take(1)[0])
            except msgspec.DecodeError as exc:
                raise PlanError(f"jsonpatch argument is not JSON: {exc}") from None
            if not isinstance(ops, list):
                raise PlanError("jsonpatch argument must be a JSON array")
            extra_ops.extend(ops)
        elif step in _TERMINALS_NO_ARGS:
            terminal = step
            break
        elif step == "deny":
            terminal = step
            rest = segs[i:]
            i = len(segs)
            code = "403"
            if rest and rest[0].isdigit():
                code, rest = rest[0], rest[1:]
            args = (code, "/".join(rest))
            break
        elif step == "status":
            terminal = step
            code_text = take(1)[0]
            if not code_text.isdigit() or not 100 <= int(code_text) <= 599:
                raise PlanError(f"not an HTTP status: {code_text!r}")
            args = (code_text, "/".join(segs[i:]))
            i = len(segs)
            break
        elif step == "redirect":
            terminal = step
            args = ("/" + "/".join(segs[i:]) if i < len(segs) else "/allow",)
            i = len(segs)
            break
        elif step == "huge":
            terminal = step
            size = int(number(take(1)[0])) if i < len(segs) else HUGE_DEFAULT_BYTES
            args = (str(size),)
            break
        else:
            raise PlanError(f"unknown behaviour step {step!r}")
    if i < len(segs):
        raise PlanError(f"unexpected segments after {terminal!r}: {'/'.join(segs[i:])!r}")
    return Plan(
        terminal=terminal,
        args=args,
        delays=tuple(delays),
        error_rate=error_rate,
        only_v1beta1=only_v1beta1,
        warnings=tuple(warnings),
        annotations=tuple(annotations),
        labels=tuple(labels),
        patch_annotations=tuple(patch_annotations),
        extra_ops=tuple(extra_ops),
    )


# --------------------------------------------------------------------------------------------------
# The answer: a pure function of the plan and the received body


@dataclass(frozen=True, slots=True)
class Reply:
    """What to send back; ``close`` means drop the connection without answering."""

    status: int
    body: bytes = b""
    content_type: bytes = b"application/json"
    headers: tuple[tuple[bytes, bytes], ...] = ()
    close: bool = False


class _Meta(msgspec.Struct):
    # Raw members: only their presence matters, so they are never built as Python objects.
    labels: msgspec.Raw = msgspec.Raw(b"")
    annotations: msgspec.Raw = msgspec.Raw(b"")


class _Object(msgspec.Struct):
    metadata: _Meta | None = None


class _Request(msgspec.Struct):
    uid: str = ""
    object: _Object | None = None


class _Review(msgspec.Struct, rename={"api_version": "apiVersion"}):
    api_version: str = ""
    kind: str = ""
    request: _Request | None = None


_review_decoder = msgspec.json.Decoder(_Review)
_encode = msgspec.json.Encoder().encode
_REASONS: Final = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict"}
_HUGE_CACHE: dict[int, bytes] = {}


def _present(raw: msgspec.Raw) -> bool:
    return bool(raw) and bytes(raw) != b"null"


def _pointer(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _build_patch(plan: Plan, obj: _Object | None) -> list[Any]:
    """JSONPatch ops for the plan's labels/annotations, creating absent maps whole (one op each)."""
    ops: list[Any] = []
    meta = obj.metadata if obj is not None else None
    if meta is None and (plan.labels or plan.patch_annotations):
        ops.append({"op": "add", "path": "/metadata", "value": {}})
    for member, pairs in (
        ("labels", [(name, "true") for name in plan.labels]),
        ("annotations", list(plan.patch_annotations)),
    ):
        if not pairs:
            continue
        if meta is not None and _present(getattr(meta, member)):
            ops.extend(
                {"op": "add", "path": f"/metadata/{member}/{_pointer(k)}", "value": v} for k, v in pairs
            )
        else:
            ops.append({"op": "add", "path": f"/metadata/{member}", "value": dict(pairs)})
    ops.extend(plan.extra_ops)
    return ops


def _text(status: int, message: str) -> Reply:
    return Reply(status, message.encode() + b"\n", b"text/plain; charset=utf-8")


def _huge_body(size: int) -> bytes:
    body = _HUGE_CACHE.get(size)
    if body is None:
        head = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"",'
        head += b'"allowed":true,"auditAnnotations":{"padding":"'
        tail = b'"}}}'
        body = head + b"x" * max(size - len(head) - len(tail), 0) + tail
        if len(_HUGE_CACHE) < 4:
            _HUGE_CACHE[size] = body
    return body


def answer(plan: Plan, body: bytes, rng: random.Random) -> Reply:
    """Compute the reply for a received body (the delay is applied by the caller, before this)."""
    t = plan.terminal
    if plan.error_rate and rng.random() < plan.error_rate:
        return _text(500, "injected backend error")
    if t == "close":
        return Reply(0, close=True)
    if t == "status":
        return _text(int(plan.args[0]), plan.args[1] or f"status {plan.args[0]} from test backend")
    if t == "redirect":
        return Reply(307, b"", b"text/plain", ((b"location", plan.args[0].encode()),))
    if t == "empty-body":
        return Reply(200, b"")
    if t == "huge":
        return Reply(200, _huge_body(int(plan.args[0])))
    try:
        review = decode_nested(_review_decoder, body)  # as deep as the apiserver's decoder allows
    except (msgspec.DecodeError, NestedTooDeeplyError) as exc:
        return _text(400, f"cannot decode AdmissionReview: {exc}")
    if review.request is None:
        return _text(400, "AdmissionReview has no request")
    version = review.api_version or V1
    if plan.only_v1beta1 and version != V1BETA1:
        return _text(400, f"this backend only accepts {V1BETA1}, got {version!r}")
    uid = review.request.uid
    if t == "no-response":
        return Reply(200, _encode({"apiVersion": version, "kind": "AdmissionReview"}))
    if t == "wrong-uid":
        uid = uid + "-wrong"
    if t == "wrong-api-version":
        version = V1 if version == V1BETA1 else V1BETA1
    resp: dict[str, Any] = {"uid": uid, "allowed": t not in ("deny", "deny-no-message")}
    if t == "deny":
        code = int(plan.args[0])
        resp["status"] = {
            "code": code,
            "reason": _REASONS.get(code, "Forbidden"),
            "message": plan.args[1] or "denied by test backend",
        }
    ops: list[Any] | None = None
    if t == "invalid-patch":
        ops = [{"op": "remove", "path": "/metadata/this-field-does-not-exist"}]
    elif plan.mutates:
        ops = _build_patch(plan, review.request.object)
    if t == "undecodable-patch":
        resp["patch"] = base64.b64encode(b'{"op":"add","path":"/metadata/labels/x","value":"y"}').decode()
        resp["patchType"] = "JSONPatch"
    elif ops is not None:
        resp["patch"] = base64.b64encode(_encode(ops)).decode()
        resp["patchType"] = "JSONPatch"
    annotations = dict(plan.annotations)
    if t == "echo":
        annotations["echo"] = body.decode("utf-8", "replace")
    if annotations:
        resp["auditAnnotations"] = annotations
    if plan.warnings:
        resp["warnings"] = list(plan.warnings)
    return Reply(200, _encode({"apiVersion": version, "kind": "AdmissionReview", "response": resp}))


# --------------------------------------------------------------------------------------------------
# The server: I/O around ``answer``


@dataclass(frozen=True, slots=True)
class Call:
    """One received request, recorded for assertions."""

    method: str
    path: str  # the request target, query included
    headers: tuple[tuple[str, str], ...]
    body: bytes
    http_version: str  # "1.1" or "2"

    @property
    def review(self) -> Any:
        """The received body decoded as JSON."""
        return msgspec.json.decode(self.body)

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k == name), None)


@dataclass(eq=False)
class BackendServer:
    """A running backend: where it listens, what it received, how many connections it accepted."""

    host: str
    port: int
    tls: bool
    record_calls: bool = True
    strict_http2: bool = True  # h2 checks the header rules of every HTTP/2 call (serve_backend)
    calls: list[Call] = field(default_factory=list)
    connections: int = 0
    open_connections: int = 0
    requests: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # noqa: S311  # simulation, not crypto
    _plans: dict[str, Plan | PlanError] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def url(self, path: str = "/allow") -> str:
        """Absolute URL of ``path`` on this server (``http`` or ``https``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{path if path.startswith('/') else '/' + path}"

    def plan_for(self, target: str) -> Plan | PlanError:
        path = target.split("?", 1)[0]
        plan = self._plans.get(path)
        if plan is None:
            try:
                plan = parse_plan(path)
            except PlanError as exc:
                plan = exc
            if len(self._plans) >= _PLAN_CACHE_SIZE:
                self._plans.clear()
            self._plans[path] = plan
        return plan

    async def respond(
        self, method: str, target: str, headers: tuple[tuple[str, str], ...], body: bytes, version: str
    ) -> Reply:
        """Record the call, wait the plan's delay, and compute the reply."""
        reply = self.reply_for(method, target, headers, body, version)
        return reply if isinstance(reply, Reply) else await reply()

    def reply_for(
        self, method: str, target: str, headers: tuple[tuple[str, str], ...], body: bytes, version: str
    ) -> Reply | Callable[[], Awaitable[Reply]]:
        """Record the call; its reply, or what gives it when it has to wait (a delay, a conversion)."""
        self.requests += 1
        if self.record_calls:
            self.calls.append(Call(method, target, headers, body, version))
        if target.split("?", 1)[0] == "/healthz":
            return Reply(200, b"ok\n", b"text/plain")
        if method != "POST":
            return Reply(405, b"only POST\n", b"text/plain", ((b"allow", b"POST"),))
        if target.startswith("/convert"):  # the sample CRD conversion webhook
            from gateway.devtools.conversion import respond as convert

            return functools.partial(convert, target, body)
        plan = self.plan_for(target)
        if isinstance(plan, PlanError):
            return _text(404, str(plan))
        if not plan.delays:
            return answer(plan, body, self.rng)

        async def delayed(plan: Plan = plan) -> Reply:
            for delay in plan.delays:
                await trio.sleep(delay.sample_seconds(self.rng))
            return answer(plan, body, self.rng)

        return delayed


def _headers_str(raw: Any) -> tuple[tuple[str, str], ...]:
    return tuple(
        (bytes(k).decode("latin-1").lower(), bytes(v).decode("latin-1"))
        for k, v in raw
        if not bytes(k).startswith(b":")
    )


async def _receive(stream: trio.abc.Stream, timeout: float) -> bytes:
    with trio.fail_after(timeout):
        data = await stream.receive_some(_RECEIVE_SIZE)
    return data if type(data) is bytes else bytes(data)


async def _send(stream: trio.abc.Stream, data: bytes) -> None:
    with trio.fail_after(IO_TIMEOUT_SECONDS):
        await stream.send_all(data)


async def _serve_http11(stream: trio.abc.Stream, server: BackendServer, first: bytes) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    if first:
        conn.receive_data(first)
    while True:
        # Wait for the next request: idle timeout until it starts, then the I/O timeout.
        timeout = IDLE_TIMEOUT_SECONDS
        request: h11.Request | None = None
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await _send(stream, _h11_bytes(conn, _text(400, "bad HTTP/1.1 request")))
                return
            if event is h11.NEED_DATA:
                data = await _receive(stream, timeout)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                request = event
                timeout = IO_TIMEOUT_SECONDS
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > MAX_REQUEST_BYTES:
                    await _send(stream, _h11_bytes(conn, _text(413, "request body too large")))
                    return
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return
        assert request is not None
        reply = await server.respond(
            request.method.decode(),
            request.target.decode("latin-1"),
            _headers_str(request.headers),
            b"".join(chunks),
            "1.1",
        )
        if reply.close:
            return
        await _send(stream, _h11_bytes(conn, reply))
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return
        conn.start_next_cycle()


def _h11_bytes(conn: h11.Connection, reply: Reply) -> bytes:
    headers = [
        (b"content-type", reply.content_type),
        (b"content-length", str(len(reply.body)).encode()),
        *reply.headers,
    ]
    out = conn.send(h11.Response(status_code=reply.status, headers=headers)) or b""
    if reply.body:
        out += conn.send(h11.Data(data=reply.body)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


class _H2Session:
    """One HTTP/2 connection: a reader loop plus one task per request (so a slow step blocks one stream)."""

    def __init__(self, stream: trio.abc.Stream, server: BackendServer) -> None:
        self.stream = stream
        self.server = server
        # Strict by default: h2 then checks the header rules of whatever calls it (the gateway's own
        # framer, in tests). Lenient skips those checks: ~13 % of this server's CPU per call.
        strict = server.strict_http2
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=False,
                header_encoding=None,
                validate_inbound_headers=strict,
                normalize_inbound_headers=strict,
                validate_outbound_headers=strict,
                normalize_outbound_headers=strict,
            )
        )
        self.send_lock = trio.StrictFIFOLock()
        self.window_changed = trio.Event()
        self.pending: dict[int, tuple[Any, list[bytes]]] = {}

    async def flush(self) -> None:
        async with self.send_lock:
            data = self.conn.data_to_send()
            if data:
                await _send(self.stream, data)

    async def run(self, first: bytes) -> None:
        self.conn.initiate_connection()
        # Generous receive windows: a stalled client must not need a WINDOW_UPDATE per review.
        self.conn.update_settings(
            {
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1000,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20,
            }
        )
        self.conn.increment_flow_control_window(1 << 24)
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            data = first
            while True:
                if data:
                    try:
                        events = self.conn.receive_data(data)
                    except h2.exceptions.ProtocolError:
                        await self.flush()  # h2 queued a GOAWAY
                        break
                    if not self._handle(events, nursery):
                        await self.flush()
                        break
                await self.flush()
                data = await _receive(self.stream, IDLE_TIMEOUT_SECONDS)
                if not data:
                    break
            nursery.cancel_scope.cancel()

    def _handle(self, events: list[Any], nursery: trio.Nursery) -> bool:
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                self.pending[ev.stream_id] = (ev.headers, [])
                if ev.stream_ended is not None:
                    self._start(ev.stream_id, nursery)
            elif isinstance(ev, h2.events.DataReceived):
                entry = self.pending.get(ev.stream_id)
                if entry is not None:
                    entry[1].append(ev.data)
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                self._start(ev.stream_id, nursery)
            elif isinstance(ev, h2.events.StreamReset):
                self.pending.pop(ev.stream_id, None)
                self._wake()
            elif isinstance(ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self._wake()
            elif isinstance(ev, h2.events.ConnectionTerminated):
                return False
        return True

    def _wake(self) -> None:
        self.window_changed.set()
        self.window_changed = trio.Event()

    def _start(self, stream_id: int, nursery: trio.Nursery) -> None:
        """Answer a complete request: at once when its reply needs no waiting (its frames join the
        reader's next write), else from a task of its own, so that a slow reply holds back nobody."""
        entry = self.pending.pop(stream_id, None)
        if entry is None:
            return
        raw_headers, chunks = entry
        pseudo = {bytes(k): bytes(v) for k, v in raw_headers if bytes(k).startswith(b":")}
        reply = self.server.reply_for(
            pseudo.get(b":method", b"").decode(),
            pseudo.get(b":path", b"/").decode("latin-1"),
            _headers_str(raw_headers),
            b"".join(chunks),
            "2",
        )
        if isinstance(reply, Reply) and self._queue_reply(stream_id, reply):
            return
        nursery.start_soon(self._respond, stream_id, reply)

    def _queue_reply(self, stream_id: int, reply: Reply) -> bool:
        """Queue the whole reply's frames; False when the flow-control windows cannot take the
        body now (``_respond`` then sends it as they open)."""
        body = reply.body
        window = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
        if reply.close or len(body) > window:
            return False
        try:
            self.conn.send_headers(stream_id, self._reply_headers(reply), end_stream=not body)
            if body:
                self.conn.send_data(stream_id, body, end_stream=True)
        except h2.exceptions.ProtocolError:
            pass  # the client reset the stream (or the connection is ending): nothing to answer
        return True

    @staticmethod
    def _reply_headers(reply: Reply) -> list[tuple[bytes, bytes]]:
        return [
            (b":status", str(reply.status).encode()),
            (b"content-type", reply.content_type),
            (b"content-length", str(len(reply.body)).encode()),
            *reply.headers,
        ]

    async def _respond(self, stream_id: int, reply: Reply | Callable[[], Awaitable[Reply]]) -> None:
        if not isinstance(reply, Reply):
            reply = await reply()
        if reply.close:
            # The nursery's scope covers the reader loop too: the whole connection ends.
            self.nursery.cancel_scope.cancel()
            return
        try:
            self.conn.send_headers(stream_id, self._reply_headers(reply), end_stream=not reply.body)
            await self._send_body(stream_id, reply.body)
        except h2.exceptions.ProtocolError:
            pass  # the client reset the stream (or the connection is ending): nothing to answer
        await self.flush()

    async def _send_body(self, stream_id: int, body: bytes) -> None:
        view = memoryview(body)
        with trio.fail_after(IO_TIMEOUT_SECONDS):
            while view:
                window = min(
                    self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size
                )
                if window <= 0:
                    # Take the event before flushing: a WINDOW_UPDATE may arrive during the flush.
                    changed = self.window_changed
                    await self.flush()
                    await changed.wait()
                    continue
                chunk, view = view[:window], view[window:]
                self.conn.send_data(stream_id, bytes(chunk), end_stream=not view)
                if view:
                    await self.flush()


async def _handle_connection(
    stream: trio.SocketStream, server: BackendServer, ctx: ssl.SSLContext | None
) -> None:
    server.connections += 1
    server.open_connections += 1
    conn_stream: trio.abc.Stream = stream
    try:
        alpn_h2 = False
        if ctx is not None:
            ssl_stream = trio.SSLStream(stream, ctx, server_side=True)
            conn_stream = ssl_stream
            with trio.fail_after(HANDSHAKE_TIMEOUT_SECONDS):
                await ssl_stream.do_handshake()
            alpn_h2 = ssl_stream.selected_alpn_protocol() == "h2"
        first = b""
        if not alpn_h2:
            # Sniff for the HTTP/2 prior-knowledge preface (h2c, and h2 over TLS without ALPN).
            while len(first) < len(_H2_PREFACE) and _H2_PREFACE.startswith(first[: len(_H2_PREFACE)]):
                data = await _receive(conn_stream, IDLE_TIMEOUT_SECONDS)
                if not data:
                    return
                first += data
            alpn_h2 = first.startswith(_H2_PREFACE)
        if alpn_h2:
            await _H2Session(conn_stream, server).run(first)
        else:
            await _serve_http11(conn_stream, server, first)
    except Exception:  # noqa: BLE001, S110
        # A bad or vanished client must never stop the server: timeouts, resets, TLS and protocol
        # errors all end just this connection.
        pass
    finally:
        server.open_connections -= 1
        with trio.move_on_after(1) as scope:
            scope.shield = True
            with contextlib.suppress(Exception):  # closing an already broken stream
                await conn_stream.aclose()


async def serve_backend(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    record_calls: bool = True,
    seed: int = 0,
    http1_only: bool = False,
    strict_http2: bool = True,
    task_status: trio.TaskStatus[BackendServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve sample backend webhooks until cancelled; ``nursery.start`` returns the ``BackendServer``.

    With ``ssl_context`` the server speaks TLS and sets its ALPN protocols to ``h2``, ``http/1.1``
    (only ``http/1.1`` with ``http1_only``: how backends behind a Service are called, TRN-08).
    ``record_calls=False`` keeps memory flat under load (``calls`` stays empty).
    ``strict_http2=False`` skips h2's header checks: the load tests' backend, which shares the
    machine's CPU with the gateway it measures and stands in for a compiled one.
    """
    if ssl_context is not None:
        ssl_context.set_alpn_protocols(["http/1.1"] if http1_only else ["h2", "http/1.1"])
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]
    server = BackendServer(
        host=host,
        port=bound_port,
        tls=ssl_context is not None,
        record_calls=record_calls,
        rng=random.Random(seed),  # noqa: S311  # deterministic simulation, not crypto
        strict_http2=strict_http2,
    )

    async def handler(stream: trio.SocketStream) -> None:
        await _handle_connection(stream, server, ssl_context)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        task_status.started(server)


# --------------------------------------------------------------------------------------------------
# CLI: ``python -m gateway.devtools.backends``


def _server_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    return server_context(certfile, keyfile)  # serve_backend sets the ALPN protocols


async def _main_async(args: argparse.Namespace, ready: Callable[[list[BackendServer]], None]) -> None:
    ctx = _server_context(args.certfile, args.keyfile) if args.certfile else None
    async with trio.open_nursery() as nursery:
        servers: list[BackendServer] = []
        for k in range(args.count):
            port = args.port + k if args.port else 0
            start = functools.partial(
                serve_backend,
                host=args.host,
                port=port,
                ssl_context=ctx,
                record_calls=False,
                seed=args.seed + k,
                http1_only=args.http1_only,
                strict_http2=not args.lenient_http2,
            )
            servers.append(await nursery.start(start))
        ready(servers)


def main(argv: list[str] | None = None) -> None:
    """Run ``--count`` backend listeners; print one JSON line ``{"scheme", "host", "ports"}`` when ready."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.devtools.backends", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="first port (0: ephemeral ports)")
    parser.add_argument("--count", type=int, default=1, help="number of listeners (one per backend)")
    parser.add_argument("--certfile", help="PEM certificate chain: serve TLS")
    parser.add_argument("--keyfile", help="PEM private key for --certfile")
    parser.add_argument("--seed", type=int, default=0, help="seed of the latency/error RNG")
    parser.add_argument(
        "--http1-only", action="store_true", help="TLS: offer only http/1.1 in ALPN (no HTTP/2)"
    )
    parser.add_argument(
        "--lenient-http2",
        action="store_true",
        help="skip h2's header checks (load tests: less CPU per call on a shared machine)",
    )
    args = parser.parse_args(argv)
    if bool(args.certfile) != bool(args.keyfile):
        parser.error("--certfile and --keyfile go together")

    def ready(servers: list[BackendServer]) -> None:
        line = {"scheme": servers[0].scheme, "host": args.host, "ports": [s.port for s in servers]}
        sys.stdout.write(msgspec.json.encode(line).decode() + "\n")
        sys.stdout.flush()

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(_main_async, args, ready)


if __name__ == "__main__":
    main()
