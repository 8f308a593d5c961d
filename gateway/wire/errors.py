"""Foreign I/O errors (``OSError``, ``ssl``, trio streams) → ``TransportError`` with a kind, once.

Every client of the gateway (backend calls, the Kubernetes API client) maps what sockets and TLS
raise here, so callers only ever see the gateway's hierarchy, with Go-like texts (ERR-06: the stable
phrases ``connection refused``, ``no such host``, ``certificate``, ``context deadline exceeded``)
and a ``kind`` for metrics and logs that nobody has to recover by parsing the text.
"""

from __future__ import annotations

import errno
import os
import socket
import ssl

import trio

from gateway.errors import TransportError
from gateway.wire.tls_stream import stream_socket

_EAI_NO_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
_UNKNOWN_AUTHORITY = {2, 18, 19, 20, 21}  # OpenSSL X509_V_ERR_*: no issuer / self-signed / untrusted
_BAD_VALIDITY = {9, 10}
_HOSTNAME_MISMATCH = 62


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _errno_text(code: int) -> str:
    return os.strerror(code).lower()


def dial_error(exc: OSError, host: str, port: int) -> TransportError:
    """A failed name lookup or TCP connect, in Go's ``dial tcp`` form (kind ``connect``)."""
    if isinstance(exc, socket.gaierror):
        if exc.errno in _EAI_NO_HOST:
            return TransportError(f"dial tcp: lookup {host}: no such host", "connect")
        return TransportError(f"dial tcp: lookup {host}: {(exc.strerror or str(exc)).lower()}", "connect")
    attempts: list[BaseException] = [exc]
    if isinstance(exc.__cause__, BaseExceptionGroup):
        attempts = list(exc.__cause__.exceptions)
    for attempt in attempts:
        if isinstance(attempt, OSError) and attempt.errno:
            cause = f"dial tcp {hostport(host, port)}: connect: {_errno_text(attempt.errno)}"
            return TransportError(cause, "connect")
    return TransportError(f"dial tcp {hostport(host, port)}: {exc}", "connect")


def tls_error(exc: BaseException, server_hostname: str | None) -> TransportError:
    """A failed TLS handshake (kind ``tls``); certificate failures always contain ``certificate``."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(cause, ssl.SSLCertVerificationError):
        prefix = "tls: failed to verify certificate: x509:"
        if cause.verify_code == _HOSTNAME_MISMATCH:
            return TransportError(f"{prefix} certificate is not valid for {server_hostname}", "tls")
        if cause.verify_code in _UNKNOWN_AUTHORITY:
            return TransportError(f"{prefix} certificate signed by unknown authority", "tls")
        if cause.verify_code in _BAD_VALIDITY:
            return TransportError(f"{prefix} certificate has expired or is not yet valid", "tls")
        return TransportError(f"{prefix} {cause.verify_message}", "tls")
    return TransportError(f"tls: handshake failed: {stream_error(exc, 'read', '').cause}", "tls")


def stream_error(exc: BaseException, op: str, peer: str) -> TransportError:
    """A connection broken while reading or writing (``op``); kind ``tls`` for TLS alerts."""
    if isinstance(exc, trio.ClosedResourceError):
        return TransportError("use of closed network connection")
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(cause, ssl.SSLCertVerificationError):
        return tls_error(cause, None)
    if isinstance(cause, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return TransportError("unexpected EOF")
    if isinstance(cause, ssl.SSLError):
        reason = (cause.reason or str(cause)).lower().replace("_", " ")
        return TransportError(f"remote error: tls: {reason}", "tls")
    if isinstance(cause, OSError) and cause.errno:
        if cause.errno == errno.EPIPE:
            op = "write"
        return TransportError(f"{op} tcp {peer}: {op}: {_errno_text(cause.errno)}")
    return TransportError("unexpected EOF")


def socket_peer(stream: trio.abc.Stream) -> str:
    """``local->remote`` addresses of a stream's socket, for error texts."""
    sock = stream_socket(stream)
    if sock is None:
        return "?"
    try:
        local = sock.getsockname()
        remote = sock.getpeername()
    except OSError:
        return "?"
    return f"{hostport(local[0], local[1])}->{hostport(remote[0], remote[1])}"
