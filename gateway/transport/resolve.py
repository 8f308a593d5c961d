"""Where and how to call a backend: ``ClientConfig`` → ``Target`` (TRN-01..08, FPT-06).

First step of the transport: the dispatcher hands over a backend's ``clientConfig``; this module
fixes the URL, the TLS server name, the TLS context, the credentials headers and the pool key
(``Origin``). ``resolve_target`` is pure: every call builds (and, for a bad caBundle or client
certificate, fails) anew. ``Targets`` is the table a backend caller owns: one entry per client
configuration of the current snapshot, built once; a failed entry keeps only its message and raises
a new ``ClientConfigError`` on every call, so nothing grows call after call.
"""

from __future__ import annotations

import ipaddress
import math
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from gateway.config.model import ClientConfig
from gateway.errors import ClientConfigError
from gateway.transport.credentials import CredentialStore, Header
from gateway.transport.tls import ClientCertificate, client_ssl_context, tls_identity
from gateway.transport.trust import TrustStore

Scheme = Literal["http", "https"]

_WIRE_TARGETS_KEPT = 64  # encoded request targets remembered per target (webhook timeouts are ≤ 30 s)


@dataclass(frozen=True, slots=True)
class Origin:
    """The pool key: connections are shared only between calls with equal origins (TRN-08)."""

    scheme: Scheme
    host: str
    port: int
    tls: str = ""  # digest of the TLS settings ("" for plain http)
    credentials: str = ""  # digest of the credentials ("" for none)

    def __str__(self) -> str:
        return f"{self.scheme}://{_hostport(self.host, self.port)}"


@dataclass(frozen=True, slots=True)
class Target:
    """A resolved backend endpoint: everything needed to open connections and send a call."""

    scheme: Scheme
    host: str  # lower-case, IPv6 without brackets: what is connected to
    port: int
    path: str  # TRN-03 normalised
    authority: str  # host[:port] as written in the URL: used in URLs and the Host header
    server_hostname: str | None  # TLS server name (TRN-06); None for plain http
    origin: Origin
    http2_allowed: bool
    ssl_context: ssl.SSLContext | None = field(default=None, compare=False, repr=False)
    auth_headers: tuple[Header, ...] = field(default=(), compare=False, repr=False)
    # The wire form of what every call to this target sends, encoded on first use and kept.
    _pseudo: tuple[Header, ...] | None = field(default=None, init=False, compare=False, repr=False)
    _host: Header | None = field(default=None, init=False, compare=False, repr=False)
    _wire_targets: dict[int, bytes] = field(default_factory=dict, init=False, compare=False, repr=False)

    def pseudo_headers(self) -> tuple[Header, ...]:
        """HTTP/2 ``:method``, ``:scheme`` and ``:authority`` (``:path`` varies with the timeout)."""
        pseudo = self._pseudo
        if pseudo is None:
            authority = self.authority.encode()
            pseudo = ((b":method", b"POST"), (b":scheme", self.scheme.encode()), (b":authority", authority))
            object.__setattr__(self, "_pseudo", pseudo)
        return pseudo

    def host_header(self) -> Header:
        """HTTP/1.1 ``Host``."""
        host = self._host
        if host is None:
            host = (b"host", self.authority.encode())
            object.__setattr__(self, "_host", host)
        return host

    def request_target(self, timeout_seconds: float) -> str:
        """Path and query sent on the wire: ``<path>?timeout=<d>`` (FPT-06, TRN-04)."""
        return f"{self.path}?timeout={go_duration(timeout_ceiling(timeout_seconds))}"

    def wire_request_target(self, timeout_seconds: float) -> bytes:
        """``request_target`` encoded, remembered per whole second (a few dozen values at most)."""
        seconds = timeout_ceiling(timeout_seconds)
        found = self._wire_targets.get(seconds)
        if found is None:
            found = self.request_target(seconds).encode()
            if len(self._wire_targets) < _WIRE_TARGETS_KEPT:
                self._wire_targets[seconds] = found
        return found

    def url_for(self, timeout_seconds: float) -> str:
        """The full URL of a call with this much time left, as printed in errors (ERR-06)."""
        return f"{self.scheme}://{self.authority}{self.request_target(timeout_seconds)}"


def timeout_ceiling(timeout_seconds: float) -> int:
    """Remaining time rounded up to whole seconds (FPT-06); never negative."""
    return max(0, math.ceil(timeout_seconds))


def go_duration(seconds: int) -> str:
    """Whole seconds in Go's ``time.Duration.String`` format: ``59s``, ``1m0s``, ``1h0m0s``."""
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}s"


def normalize_path(path: str) -> str:
    """POSIX path cleaning (TRN-03): leading ``/``, no ``//``, ``.``/``..`` resolved, no trailing ``/``."""
    # upstream: Go path.Join/Clean via rest.Config APIPath; ".." never climbs above the root.
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def is_loopback_host(host: str) -> bool:
    """``localhost`` (any case), 127.0.0.0/8 or ``::1``: the hosts that may speak HTTP/2 (TRN-08)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_target(
    client_config: ClientConfig,
    credentials: CredentialStore | None,
    contexts: TLSContexts | None = None,
    trust: TrustStore | None = None,
) -> Target:
    """The call target of a backend; ``ClientConfigError`` if its caBundle or credentials are unusable.

    Builds everything anew (an ``SSLContext`` costs milliseconds): callers keep the result, see
    ``Targets``. ``contexts`` shares one context between targets with equal TLS settings; ``trust``
    holds the bundles of ``caFrom`` references.
    """
    return _resolve(client_config, credentials, contexts if contexts is not None else TLSContexts(), trust)


@dataclass(frozen=True, slots=True)
class Unusable:
    """Why a client configuration cannot be called: kept instead of an exception object.

    A stored exception re-raised on every call would chain a new traceback onto itself each time.
    """

    message: str

    def error(self) -> ClientConfigError:
        return ClientConfigError(self.message)


TLSKey = tuple[bytes, ClientCertificate | None, bool]


class TLSContexts:
    """Client ``SSLContext``s by TLS settings (caBundle, client certificate, ALPN), built once each.

    ``previous``: a table whose contexts are taken over when asked for again (a new snapshot keeps
    the contexts it still uses, and only those).
    """

    def __init__(self, previous: TLSContexts | None = None) -> None:
        self._built: dict[TLSKey, ssl.SSLContext | Unusable] = {}
        self._previous = previous._built if previous is not None else {}

    def get(
        self, ca_bundle: bytes, client_cert: ClientCertificate | None, http2_allowed: bool
    ) -> ssl.SSLContext:
        key = (ca_bundle, client_cert, http2_allowed)
        built = self._built.get(key)
        if built is None:
            built = self._previous.get(key)
        if built is None:
            try:
                built = client_ssl_context(ca_bundle, client_cert, http2_allowed=http2_allowed)
            except ClientConfigError as exc:
                built = Unusable(str(exc))
        self._built[key] = built
        if isinstance(built, Unusable):
            raise built.error()
        return built

    def forget_previous(self) -> None:
        self._previous = {}


class Targets:
    """The resolved targets of one backend caller: one per client configuration, for one credential store.

    ``retain`` (called with each new configuration snapshot) resolves that snapshot's client
    configurations and forgets every other one (and every TLS context no longer used), so the table
    lives as long as the snapshot.
    A configuration not seen before (a review still holding the previous snapshot) is resolved on
    first use; ``MAX_ENTRIES`` bounds the table even if ``retain`` is never called.
    """

    MAX_ENTRIES = 4096

    def __init__(self, credentials: CredentialStore | None, trust: TrustStore | None = None) -> None:
        self.credentials = credentials
        self.trust = trust
        self._targets: dict[ClientConfig, Target | Unusable] = {}
        self._contexts = TLSContexts()

    def __repr__(self) -> str:
        return f"<Targets {len(self._targets)} credentials={self.credentials!r}>"

    def get(self, client_config: ClientConfig) -> Target:
        """The target for ``client_config``; a new ``ClientConfigError`` on each call if unusable."""
        found = self._targets.get(client_config)
        if found is None:
            found = self._resolve(client_config)
        if isinstance(found, Unusable):
            raise found.error()
        return found

    def client_configs(self) -> list[ClientConfig]:
        return list(self._targets)

    def retain(self, client_configs: Iterable[ClientConfig]) -> None:
        """Resolve exactly these client configurations now; forget every other target and context.

        Targets are cheap to rebuild; TLS contexts still in use are taken over, not rebuilt.
        """
        self._targets = {}
        self._contexts = TLSContexts(previous=self._contexts)
        for client_config in client_configs:
            if client_config not in self._targets:
                self._resolve(client_config)
        self._contexts.forget_previous()

    def _resolve(self, client_config: ClientConfig) -> Target | Unusable:
        result: Target | Unusable
        try:
            result = _resolve(client_config, self.credentials, self._contexts, self.trust)
        except ClientConfigError as exc:
            result = Unusable(str(exc))
        if len(self._targets) >= self.MAX_ENTRIES:
            self._targets.clear()
        self._targets[client_config] = result
        return result


def _ca_bundle(client_config: ClientConfig, trust: TrustStore | None) -> bytes:
    """The CA bundle a backend is verified against: its ``caFrom`` reference's, else its own."""
    reference = client_config.ca_from
    if reference is None:
        return client_config.ca_bundle
    if trust is None:
        raise ClientConfigError(
            f"no CA bundle from {reference.describe()}: this command does not read caFrom"
        )
    return trust.bundle(reference)


def _resolve(
    client_config: ClientConfig,
    credentials: CredentialStore | None,
    contexts: TLSContexts,
    trust: TrustStore | None = None,
) -> Target:
    scheme: Scheme
    if client_config.service is not None:
        service = client_config.service
        host = f"{service.name}.{service.namespace}.svc"
        scheme, port = "https", service.port
        authority = f"{host}:{port}"
        path = normalize_path(service.path or "/")
        server_hostname: str | None = host
        http2_allowed = False  # TRN-08: service names are never loopback
    elif client_config.url is not None:
        parts = urlsplit(client_config.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientConfigError(f"invalid url {client_config.url!r}")
        scheme = "https" if parts.scheme == "https" else "http"
        try:
            explicit_port = parts.port
        except ValueError as exc:
            raise ClientConfigError(f"invalid port in url {client_config.url!r}") from exc
        host = parts.hostname.lower()
        port = explicit_port or (443 if scheme == "https" else 80)
        authority = parts.netloc
        path = normalize_path(parts.path)
        server_hostname = host if scheme == "https" else None
        http2_allowed = is_loopback_host(host)
    else:
        raise ClientConfigError("exactly one of url or service is required")

    found = credentials.lookup(host, port) if credentials is not None else None
    client_cert = found.client_cert if found is not None else None
    context = None
    tls = ""
    if scheme == "https":
        ca_bundle = _ca_bundle(client_config, trust)
        context = contexts.get(ca_bundle, client_cert, http2_allowed)
        tls = tls_identity(ca_bundle, client_cert, http2_allowed=http2_allowed)
    origin = Origin(scheme, host, port, tls, found.identity if found is not None else "")
    return Target(
        scheme=scheme,
        host=host,
        port=port,
        path=path,
        authority=authority,
        server_hostname=server_hostname,
        origin=origin,
        http2_allowed=http2_allowed,
        ssl_context=context,
        auth_headers=found.headers if found is not None else (),
    )


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
