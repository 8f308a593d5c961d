"""A minimal Kubernetes API client: how the gateway reads its own cluster (GW-01).

What the gateway's watches (``gateway.sources.reflector``) and writers need: GET (a list or one
object), JSON requests of any verb (``request_json``, ``get_object``) and a streaming watch, over
HTTP/1.1 on trio (the shared exchange loop, ``gateway.wire.http11``), TLS verified against the
cluster CA (``gateway.wire.tls``). Credentials come from the pod's service account (in-cluster) or
from a kubeconfig file (``gateway.wire.kubeconfig``). There is no connection reuse: a list or GET happens
at start-up, after a watch expires, or on a rare cache miss, and a watch holds its connection for
minutes, so a pool would buy nothing.

Every network await runs under a deadline: connecting (``connect_timeout``), a whole GET
(``request_timeout``), and the gap between two reads of a watch (``idle_timeout``).
"""

from __future__ import annotations

import base64
import ipaddress
import os
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import trio

from gateway import __version__
from gateway.errors import GatewayError, TransportError
from gateway.wire.errors import dial_error, tls_error
from gateway.wire.http11 import HTTP11Exchange
from gateway.wire.kubeconfig import Kubeconfig, KubeconfigError, redact_url
from gateway.wire.tls import TLSMaterialError, client_context

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
USER_AGENT: Final = f"webhook-gateway/{__version__}"


class KubeConfigError(GatewayError):
    """The in-cluster environment or the kubeconfig file cannot be used."""


class KubeError(GatewayError):
    """A request to the Kubernetes API failed; ``str()`` is a Go-like ``Get "<url>": <cause>``."""


class KubeTransportError(KubeError):
    """No answer: connecting, TLS, a broken or truncated stream, or a deadline."""


class KubeAPIError(KubeError):
    """The API server answered with a non-2xx status (or a watch ``ERROR`` event).

    ``code``/``reason``/``message`` come from the ``Status`` object in the body when there is one.
    """

    def __init__(self, text: str, *, code: int, reason: str = "", message: str = "") -> None:
        self.code = code
        self.reason = reason
        self.message = message
        super().__init__(text)


class APIStatus(msgspec.Struct, kw_only=True):
    """The ``meta/v1`` Status the API server sends as an error body and in ``ERROR`` watch events."""

    kind: str = ""
    status: str = ""
    message: str = ""
    reason: str = ""
    code: int = 0


_status_decoder: Final = msgspec.json.Decoder(APIStatus)


class ListMeta(msgspec.Struct, rename="camel"):
    """``metadata`` of a List: where a watch starts, and the next page's token."""

    resource_version: str = ""
    continue_: str = msgspec.field(name="continue", default="")


class WatchEvent(msgspec.Struct):
    """One line of a watch stream; ``object`` is decoded by the reflector that knows its kind."""

    type: str
    object: msgspec.Raw = msgspec.Raw(b"null")


watch_event_decoder: Final = msgspec.json.Decoder(WatchEvent)


class WatchExpiredError(KubeError):
    """The watch's resourceVersion is too old (410 Gone/Expired): only a re-list helps."""


def watch_error(event: WatchEvent) -> KubeAPIError:
    """The error an ``ERROR`` watch event carries; the watch loop turns code 410 into a re-list."""
    status = decode_status(bytes(event.object))
    code = status.code if status else 0
    text = status.message if status and status.message else bytes(event.object).decode(errors="replace")
    return KubeAPIError(text, code=code, reason=status.reason if status else "")


def decode_status(body: bytes) -> APIStatus | None:
    """The Status in ``body``, or ``None`` when the body is not one (a proxy's HTML page ...)."""
    try:
        status = _status_decoder.decode(body)
    except msgspec.DecodeError:
        return None
    return status if status.kind == "Status" else None


# --- credentials ---------------------------------------------------------------------------------


class TokenFile:
    """A bearer token file, re-read whenever it changes.

    Projected service-account tokens are rotated by the kubelet (about hourly) by replacing the file;
    checking (mtime, size, inode) on every request costs one stat and never sends an expired token
    longer than needed.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key: tuple[int, int, int] | None = None
        self._token = ""

    def read(self) -> str:
        try:
            st = self.path.stat()
            key = (st.st_mtime_ns, st.st_size, st.st_ino)
            if key != self._key:
                self._token = self.path.read_text(encoding="utf-8").strip()
                self._key = key
        except OSError as exc:
            raise KubeTransportError(f"reading token file {self.path}: {exc.strerror or exc}") from exc
        return self._token


@dataclass(frozen=True, slots=True)
class KubeConfig:
    """Where the API server is and how to authenticate to it."""

    server: str  # "https://host:port[/prefix]"
    ssl_context: ssl.SSLContext | None  # None only for a plain-http server (tests, kubectl proxy)
    tls_server_name: str | None = None
    token: str | None = None
    token_file: TokenFile | None = None
    basic_auth: tuple[str, str] | None = None
    namespace: str = "default"

    def authorization(self) -> str | None:
        """The ``Authorization`` header value for the next request, if any."""
        if self.token_file is not None:
            return f"Bearer {self.token_file.read()}"
        if self.token:
            return f"Bearer {self.token}"
        if self.basic_auth is not None:
            raw = f"{self.basic_auth[0]}:{self.basic_auth[1]}".encode()
            return f"Basic {base64.b64encode(raw).decode()}"
        return None


def in_cluster_config(
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeConfig:
    """The pod's own API access: ``KUBERNETES_SERVICE_HOST/PORT``, its token and CA files."""
    env = os.environ if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeConfigError(
            "not running in a cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be set"
        )
    token = service_account_dir / "token"
    ca = service_account_dir / "ca.crt"
    try:
        ca_pem = ca.read_bytes()
        namespace_file = service_account_dir / "namespace"
        namespace = namespace_file.read_text().strip() if namespace_file.exists() else "default"
        if not token.exists():
            raise KubeConfigError(f"service account token file {token} does not exist")
        ctx = client_context(ca_pem=ca_pem)
    except TLSMaterialError as exc:
        raise KubeConfigError(f"in-cluster configuration: {ca}: {exc}") from None
    except OSError as exc:
        raise KubeConfigError(f"in-cluster configuration: {exc}") from exc
    return KubeConfig(
        server=f"https://{_join_host_port(host, int(port))}",
        ssl_context=ctx,
        token_file=TokenFile(token),
        namespace=namespace,
    )


def load_kubeconfig(path: Path, *, context: str | None = None) -> KubeConfig:
    """The cluster and user of ``context`` (default: current-context) in a kubeconfig file.

    Parsed by the one kubeconfig parser (``gateway.wire.kubeconfig``, the same rules as backend
    credentials): ``token``, ``tokenFile`` (re-read when rotated), ``client-certificate(-data)`` with
    ``client-key(-data)``, ``username``/``password``; ``exec``, ``auth-provider`` and impersonation
    are refused. Relative file names are relative to the kubeconfig file, as in kubectl.
    """
    try:
        chosen = Kubeconfig.load(path).context(context)
        cluster, user = chosen.cluster, chosen.user
        ssl_context = None
        if urllib.parse.urlsplit(cluster.server).scheme == "https":
            ssl_context = client_context(
                ca_pem=cluster.ca_pem,
                client_cert=user.client_cert if user is not None else None,
                insecure=cluster.insecure,
            )
    except (KubeconfigError, TLSMaterialError) as exc:
        raise KubeConfigError(f"{exc}" if isinstance(exc, KubeconfigError) else f"{path}: {exc}") from None
    return KubeConfig(
        server=cluster.server,
        ssl_context=ssl_context,
        tls_server_name=cluster.tls_server_name,
        token=user.token if user is not None and user.token_file is None else None,
        token_file=TokenFile(user.token_file) if user is not None and user.token_file is not None else None,
        basic_auth=(user.username or "", user.password or "")
        if user is not None and (user.username is not None or user.password is not None)
        else None,
        namespace=chosen.namespace,
    )


def _join_host_port(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


# --- the client ----------------------------------------------------------------------------------


class WatchStream:
    """The lines of a watch response: one JSON-encoded ``WatchEvent`` per line.

    ``receive_line()`` returns ``None`` when the server ends the watch (``timeoutSeconds`` passed);
    a broken connection, a truncated chunk or ``idle_timeout`` seconds without data raise
    ``KubeTransportError``.
    """

    def __init__(
        self, exchange: HTTP11Exchange, url: str, *, idle_timeout: float, max_line_bytes: int
    ) -> None:
        self._exchange = exchange
        self._url = url
        self._idle_timeout = idle_timeout
        self._max_line_bytes = max_line_bytes
        self._buffer = bytearray()
        self._ended = False

    async def receive_line(self) -> bytes | None:
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[:newline]).strip()
                del self._buffer[: newline + 1]
                if line:
                    return line
                continue
            if self._ended:
                line = bytes(self._buffer).strip()
                self._buffer.clear()
                return line or None
            if len(self._buffer) > self._max_line_bytes:
                limit = self._max_line_bytes
                raise KubeTransportError(f'Get "{self._url}": watch event exceeds {limit} bytes')
            with _mapped_errors("Get", self._url), trio.fail_after(self._idle_timeout):
                data = await self._exchange.receive_data()
            if data is None:
                self._ended = True
            else:
                self._buffer += data

    def __aiter__(self) -> WatchStream:
        return self

    async def __anext__(self) -> bytes:
        line = await self.receive_line()
        if line is None:
            raise StopAsyncIteration
        return line


@contextmanager
def _mapped_errors(method: str, url: str) -> Iterator[None]:
    """Map transport failures to ``KubeTransportError`` once, at the boundary.

    The exchange (``gateway.wire.http11``) already maps socket, TLS and protocol errors to typed
    ``TransportError``s; connecting and deadlines are mapped here.
    """
    try:
        yield
    except trio.TooSlowError as exc:
        raise KubeTransportError(f'{method} "{url}": context deadline exceeded') from exc
    except TransportError as exc:
        raise KubeTransportError(f'{method} "{url}": {exc.cause}') from exc


class KubeClient:
    """GET and watch requests to one API server; stateless apart from the configuration."""

    def __init__(
        self,
        config: KubeConfig,
        *,
        connect_timeout: float = 10.0,
        request_timeout: float = 30.0,
        max_body_bytes: int = 64 << 20,
    ) -> None:
        self.config = config
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.max_body_bytes = max_body_bytes
        parts = urllib.parse.urlsplit(config.server)
        self._scheme = parts.scheme
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path.rstrip("/")
        default_port = 443 if parts.scheme == "https" else 80
        if self._port != default_port:
            self._host_header = _join_host_port(self._host, self._port)
        else:
            self._host_header = f"[{self._host}]" if ":" in self._host else self._host

    def __repr__(self) -> str:
        return f"<KubeClient {redact_url(self.config.server)}>"

    def url(self, path: str, query: Mapping[str, str] | None = None) -> str:
        """The full URL of ``path`` (``/api/v1/...``) with its query string."""
        target = self._target(path, query)
        return f"{self._scheme}://{self._host_header}{target}"

    def _target(self, path: str, query: Mapping[str, str] | None) -> str:
        target = self._prefix + path
        if query:
            target += "?" + urllib.parse.urlencode(query)
        return target

    def _headers(self) -> list[tuple[bytes, bytes]]:
        headers = [
            (b"host", self._host_header.encode()),
            (b"accept", b"application/json"),
            (b"user-agent", USER_AGENT.encode()),
        ]
        authorization = self.config.authorization()
        if authorization:
            headers.append((b"authorization", authorization.encode()))
        return headers

    async def _connect(self) -> trio.abc.Stream:
        with trio.fail_after(self.connect_timeout):
            try:
                tcp = await trio.open_tcp_stream(self._host, self._port)
            except OSError as exc:
                raise dial_error(exc, self._host, self._port) from exc
            if self.config.ssl_context is None:
                return tcp
            server_hostname = self.config.tls_server_name or self._host
            tls = trio.SSLStream(
                tcp, self.config.ssl_context, server_hostname=server_hostname, https_compatible=True
            )
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                await trio.aclose_forcefully(tls)
                raise tls_error(exc, server_hostname) from exc
            except BaseException:
                await trio.aclose_forcefully(tls)
                raise
            return tls

    async def _open(
        self,
        url: str,
        path: str,
        query: Mapping[str, str] | None,
        *,
        method: str = "GET",
        body: bytes = b"",
        content_type: str = "application/json",
    ) -> HTTP11Exchange:
        """Connect, send the request and read the response head; a non-2xx status raises."""
        verb = method.capitalize()
        with _mapped_errors(verb, url):
            stream = await self._connect()
        try:
            exchange = HTTP11Exchange(stream)
            headers = self._headers()
            if body or method in ("POST", "PUT", "PATCH"):
                headers += [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                ]
            with _mapped_errors(verb, url):
                await exchange.send(method.encode(), self._target(path, query).encode(), headers, body)
                status, _headers = await exchange.receive_head()
                ok = 200 <= status < 300
                error_body = b"" if ok else await exchange.receive_body(self.max_body_bytes)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        if not ok:
            await trio.aclose_forcefully(stream)
            raise _api_error(url, status, error_body, verb=verb)
        return exchange

    async def request(
        self, method: str, path: str, body: bytes = b"", *, content_type: str = "application/json"
    ) -> bytes:
        """The body of a 2xx reply to ``METHOD path``; ``KubeAPIError`` (with ``code``) otherwise.

        Writes (POST, PUT, PATCH, DELETE) go through the same connection code as reads.
        """
        url = self.url(path)
        verb = method.capitalize()
        with trio.move_on_after(self.request_timeout):
            exchange = await self._open(url, path, None, method=method, body=body, content_type=content_type)
            try:
                with _mapped_errors(verb, url):
                    return await exchange.receive_body(self.max_body_bytes)
            finally:
                await exchange.aclose()
        raise KubeTransportError(f'{verb} "{url}": context deadline exceeded')

    async def request_json(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """The decoded 2xx reply to ``METHOD path`` with ``body`` as JSON; ``KubeAPIError`` otherwise."""
        data = msgspec.json.encode(body) if body is not None else b""
        reply = await self.request(method, path, data, content_type=content_type)
        try:
            decoded = msgspec.json.decode(reply) if reply else {}
        except msgspec.DecodeError as exc:
            raise KubeError(f'{method.capitalize()} "{self.url(path)}": {exc}') from exc
        return decoded if isinstance(decoded, dict) else {}

    async def get_object(self, path: str) -> dict[str, Any] | None:
        """The object at ``path`` as JSON, or None when it does not exist (404)."""
        try:
            return await self.request_json("GET", path)
        except KubeAPIError as exc:
            if exc.code == 404:
                return None
            raise

    async def get(self, path: str, query: Mapping[str, str] | None = None) -> bytes:
        """The body of a 2xx reply to ``GET path?query``; ``KubeAPIError`` for any other status."""
        url = self.url(path, query)
        with trio.move_on_after(self.request_timeout):
            exchange = await self._open(url, path, query)
            try:
                with _mapped_errors("Get", url):
                    return await exchange.receive_body(self.max_body_bytes)
            finally:
                await exchange.aclose()
        raise KubeTransportError(f'Get "{url}": context deadline exceeded')

    @asynccontextmanager
    async def watch(
        self, path: str, query: Mapping[str, str], *, idle_timeout: float
    ) -> AsyncIterator[WatchStream]:
        """Open a watch (``query`` should hold ``watch=1``); the stream's lines are watch events.

        Opening is bounded by ``request_timeout``; afterwards each read by ``idle_timeout``.
        A non-2xx status (e.g. 410 Gone) raises ``KubeAPIError`` before anything is yielded.
        """
        url = self.url(path, query)
        exchange: HTTP11Exchange | None = None
        with trio.move_on_after(self.request_timeout):
            exchange = await self._open(url, path, query)
        if exchange is None:
            raise KubeTransportError(f'Get "{url}": context deadline exceeded')
        try:
            yield WatchStream(exchange, url, idle_timeout=idle_timeout, max_line_bytes=self.max_body_bytes)
        finally:
            await exchange.aclose()


def _api_error(url: str, code: int, body: bytes, *, verb: str = "Get") -> KubeAPIError:
    status = decode_status(body)
    if status is not None and status.message:
        return KubeAPIError(status.message, code=code, reason=status.reason, message=status.message)
    text = body.decode("utf-8", "replace").strip()[:200]
    message = f"the server responded with status {code}" + (f": {text}" if text else "")
    return KubeAPIError(f'{verb} "{url}": {message}', code=code, reason=status.reason if status else "")
