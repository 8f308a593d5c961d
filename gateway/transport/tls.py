"""TLS settings for backend calls: an ``SSLContext`` per (caBundle, client certificate, ALPN).

Sits under ``resolve`` (which picks the settings for a backend and keeps the contexts it built, one
per distinct setting) and above the connections (which wrap sockets with the context). Building one
costs milliseconds, so never per call (TRN-06).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import ssl
import tempfile
from dataclasses import dataclass

from gateway.errors import ClientConfigError

ALPN_HTTP2: tuple[str, ...] = ("h2", "http/1.1")
ALPN_HTTP11: tuple[str, ...] = ("http/1.1",)


@dataclass(frozen=True, slots=True, repr=False)
class ClientCertificate:
    """A PEM client certificate (chain) and its private key, for TLS client authentication (TRN-11).

    The key never appears in ``repr``/``str``; ``identity`` is a digest safe to log and to key pools.
    """

    cert_pem: bytes
    key_pem: bytes

    @property
    def identity(self) -> str:
        return hashlib.sha256(self.cert_pem + b"\0" + self.key_pem).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"<ClientCertificate {self.identity}>"

    __str__ = __repr__


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
    return _build_context(ca_bundle, client_cert, http2_allowed)


def _build_context(
    ca_bundle: bytes, client_cert: ClientCertificate | None, http2_allowed: bool
) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # Go's client default
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = True
    # TRN-06: subjectAltName only; a certificate naming the host only in its CN fails.
    context.hostname_checks_common_name = False
    if ca_bundle.strip():
        try:
            context.load_verify_locations(cadata=ca_bundle.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
            raise ClientConfigError(
                "unable to load root certificates: unable to parse bytes as PEM block"
            ) from exc
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if client_cert is not None:
        _load_client_certificate(context, client_cert)
    context.set_alpn_protocols(list(ALPN_HTTP2 if http2_allowed else ALPN_HTTP11))
    return context


def _load_client_certificate(context: ssl.SSLContext, client_cert: ClientCertificate) -> None:
    # ``ssl`` only loads certificate chains from files: write both PEMs to a file in a private
    # (0700) directory, load it, and remove it at once.
    directory = tempfile.mkdtemp(prefix="gateway-client-cert-")
    path = os.path.join(directory, "client.pem")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(client_cert.cert_pem.rstrip() + b"\n" + client_cert.key_pem.rstrip() + b"\n")
        context.load_cert_chain(path)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ClientConfigError(
            "tls: failed to find any PEM data in certificate or key input"
            if b"-----BEGIN" not in client_cert.cert_pem or b"-----BEGIN" not in client_cert.key_pem
            else "tls: private key does not match public key or cannot be parsed"
        ) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rmdir(directory)
