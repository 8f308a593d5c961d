"""What the connection modules share: the reply value, the retry signal, and Go-like error texts.

Foreign exceptions (``OSError``, ``ssl``, trio stream errors) are mapped to ``TransportError``
causes here, once, so callers only ever see the gateway's hierarchy (ERR-06: the stable phrases
``connection refused``, ``no such host``, ``certificate``, ``context deadline exceeded``).
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
from dataclasses import dataclass, field

import trio

from gateway.errors import TransportError

Header = tuple[bytes, bytes]

_EAI_NO_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
_UNKNOWN_AUTHORITY = {2, 18, 19, 20, 21}  # OpenSSL X509_V_ERR_*: no issuer / self-signed / untrusted
_BAD_VALIDITY = {9, 10}
_HOSTNAME_MISMATCH = 62


@dataclass(frozen=True, slots=True)
class HTTPResponse:
    """A backend's complete reply; header names are lower-case bytes."""

    status: int
    headers: list[Header] = field(default_factory=list)
    body: bytes = b""
    http_version: str = "HTTP/1.1"

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (``name`` in lower case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


class RetryableError(TransportError):
    """The request provably never reached the backend's handler; the pool may resend it once.

    Raised only for HTTP/2 streams that never carried a byte (the connection was already closing or
    out of stream ids) or that the peer refused: REFUSED_STREAM, or a GOAWAY whose last stream id
    is below the stream's. An HTTP/1.1 request is never resent once its first byte was written:
    the backend may have read and processed it (FPT-10). Never escapes the pool.
    """


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _errno_text(code: int) -> str:
    return os.strerror(code).lower()


def dial_error(exc: OSError, host: str, port: int) -> str:
    """The cause for a failed name lookup or TCP connect, in Go's ``dial tcp`` form."""
    if isinstance(exc, socket.gaierror):
        if exc.errno in _EAI_NO_HOST:
            return f"dial tcp: lookup {host}: no such host"
        return f"dial tcp: lookup {host}: {(exc.strerror or str(exc)).lower()}"
    attempts: list[BaseException] = [exc]
    if isinstance(exc.__cause__, BaseExceptionGroup):
        attempts = list(exc.__cause__.exceptions)
    for attempt in attempts:
        if isinstance(attempt, OSError) and attempt.errno:
            return f"dial tcp {hostport(host, port)}: connect: {_errno_text(attempt.errno)}"
    return f"dial tcp {hostport(host, port)}: {exc}"


def tls_error(exc: BaseException, server_hostname: str | None) -> str:
    """The cause for a failed TLS handshake; certificate failures always contain ``certificate``."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(cause, ssl.SSLCertVerificationError):
        prefix = "tls: failed to verify certificate: x509:"
        if cause.verify_code == _HOSTNAME_MISMATCH:
            return f"{prefix} certificate is not valid for {server_hostname}"
        if cause.verify_code in _UNKNOWN_AUTHORITY:
            return f"{prefix} certificate signed by unknown authority"
        if cause.verify_code in _BAD_VALIDITY:
            return f"{prefix} certificate has expired or is not yet valid"
        return f"{prefix} {cause.verify_message}"
    return f"tls: handshake failed: {stream_error(exc, 'read', '')}"


def stream_error(exc: BaseException, op: str, peer: str) -> str:
    """The cause for a broken connection while reading or writing (``op``)."""
    if isinstance(exc, trio.ClosedResourceError):
        return "use of closed network connection"
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(cause, ssl.SSLCertVerificationError):
        return tls_error(cause, None)
    if isinstance(cause, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return "unexpected EOF"
    if isinstance(cause, ssl.SSLError):
        reason = (cause.reason or str(cause)).lower().replace("_", " ")
        return f"remote error: tls: {reason}"
    if isinstance(cause, OSError) and cause.errno:
        if cause.errno == errno.EPIPE:
            op = "write"
        return f"{op} tcp {peer}: {op}: {_errno_text(cause.errno)}"
    return "unexpected EOF"


def socket_peer(stream: trio.abc.Stream) -> str:
    """``local->remote`` addresses of a stream's socket, for error texts."""
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if not isinstance(inner, trio.SocketStream):
        return "?"
    try:
        local = inner.socket.getsockname()
        remote = inner.socket.getpeername()
    except OSError:
        return "?"
    return f"{hostport(local[0], local[1])}->{hostport(remote[0], remote[1])}"
