"""The one TLS context builder: client contexts (backends, API server) and serving contexts.

Every ``ssl.SSLContext`` of the gateway comes from here, so the policy is set in one place: TLS 1.2
or newer, certificates verified against subjectAltName only (as Go does, TRN-06), an explicit CA
replacing the system roots, no compression. Building a context costs milliseconds: callers keep
what they build (never per call or per connection).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.errors import GatewayError

ALPN_HTTP2: tuple[str, ...] = ("h2", "http/1.1")
ALPN_HTTP11: tuple[str, ...] = ("http/1.1",)


class TLSMaterialError(GatewayError):
    """A CA bundle, certificate or key cannot be loaded; the text never contains key material."""


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


def client_context(
    *,
    ca_pem: bytes | None,
    client_cert: ClientCertificate | None = None,
    alpn: Sequence[str] = ALPN_HTTP11,
    insecure: bool = False,
) -> ssl.SSLContext:
    """A client context; ``TLSMaterialError`` if the CA bundle or client certificate is unusable.

    A non-empty ``ca_pem`` is the only trust source, else the system roots. ``insecure`` turns off
    verification (kubeconfig ``insecure-skip-tls-verify``, load-test tools).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # Go's client default
    context.options |= ssl.OP_NO_COMPRESSION
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.verify_mode = ssl.CERT_REQUIRED
        context.check_hostname = True
        # TRN-06: subjectAltName only; a certificate naming the host only in its CN fails.
        context.hostname_checks_common_name = False
        if ca_pem is not None and ca_pem.strip():
            try:
                context.load_verify_locations(cadata=ca_pem.decode("ascii"))
            except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
                raise TLSMaterialError(
                    "unable to load root certificates: unable to parse bytes as PEM block"
                ) from exc
        else:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if client_cert is not None:
        load_certificate(context, client_cert.cert_pem, client_cert.key_pem)
    context.set_alpn_protocols(list(alpn))
    return context


def server_context(
    certfile: str | os.PathLike[str],
    keyfile: str | os.PathLike[str],
    *,
    client_ca: str | os.PathLike[str] | None = None,
    alpn: Sequence[str] = ALPN_HTTP2,
) -> ssl.SSLContext:
    """A serving context for a certificate/key file pair; ``client_ca`` requires client certificates.

    Raises ``OSError``/``ssl.SSLError`` as ``ssl`` does when a file is missing or the pair does not
    load (the caller names the files).
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION
    context.set_alpn_protocols(list(alpn))
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED  # TRN-14: the caller must present a client certificate
    context.load_cert_chain(certfile, keyfile)
    # No TLS 1.3 session tickets: the kube-apiserver (client-go) keeps no session cache and never
    # resumes, so each ticket was an encryption and a record per new connection for nothing (~30 µs
    # of a ~280 µs handshake; benchmarks/bench_tls_handshake.py).
    context.num_tickets = 0
    return context


def load_certificate(context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """Load a PEM certificate (chain) and key held in memory; ``TLSMaterialError`` if unusable."""
    # ``ssl`` only loads certificate chains from files: write both PEMs to a file in a private
    # (0700) directory, load it, and remove it at once.
    directory = tempfile.mkdtemp(prefix="gateway-cert-")
    path = os.path.join(directory, "cert.pem")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(cert_pem.rstrip() + b"\n" + key_pem.rstrip() + b"\n")
        context.load_cert_chain(path)
    except (ssl.SSLError, OSError, ValueError):
        raise TLSMaterialError(
            "tls: failed to find any PEM data in certificate or key input"
            if b"-----BEGIN" not in cert_pem or b"-----BEGIN" not in key_pem
            else "tls: private key does not match public key or cannot be parsed"
        ) from None  # the ssl error may quote the file's contents
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rmdir(directory)
