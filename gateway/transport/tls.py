"""TLS settings for backend calls: an ``SSLContext`` per (caBundle, client certificate, ALPN).

Sits under ``resolve`` (which picks the settings for a backend and keeps the contexts it built, one
per distinct setting) and above the connections (which wrap sockets with the context). Contexts
come from the one builder, ``gateway.wire.tls``; building one costs milliseconds, so never per call
(TRN-06).
"""

from __future__ import annotations

import hashlib
import ssl

from gateway.errors import ClientConfigError
from gateway.wire.tls import ALPN_HTTP2, ALPN_HTTP11, ClientCertificate, TLSMaterialError, client_context

__all__ = ["ALPN_HTTP2", "ALPN_HTTP11", "ClientCertificate", "client_ssl_context", "tls_identity"]


def tls_identity(ca_bundle: bytes, client_cert: ClientCertificate | None, *, http2_allowed: bool) -> str:
    """A short digest naming TLS settings, part of a pool origin key (TRN-08)."""
    digest = hashlib.sha256(ca_bundle)
    digest.update(b"\0" + (client_cert.identity.encode() if client_cert else b"-"))
    digest.update(b"\0h2" if http2_allowed else b"\0h1")
    return digest.hexdigest()[:16]


def client_ssl_context(
    ca_bundle: bytes, client_cert: ClientCertificate | None, *, http2_allowed: bool
) -> ssl.SSLContext:
    """A new client context for these settings; raises ``ClientConfigError`` if unusable (TRN-07).

    A non-empty ``ca_bundle`` is the only trust source, else the system roots; hostnames are checked
    against subjectAltName only; ALPN offers ``h2`` only when ``http2_allowed`` (TRN-08).
    """
    try:
        return client_context(
            ca_pem=ca_bundle, client_cert=client_cert, alpn=ALPN_HTTP2 if http2_allowed else ALPN_HTTP11
        )
    except TLSMaterialError as exc:
        raise ClientConfigError(str(exc)) from None
