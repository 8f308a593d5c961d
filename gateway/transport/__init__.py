"""Transport: bytes to a backend webhook and back — the gateway's only outbound I/O.

``resolve_target`` turns a backend's ``clientConfig`` into a ``Target`` (URL, TLS, credentials,
pool key); ``ClientPool.post`` makes the call over pooled HTTP/1.1 or HTTP/2 connections.
"""

from gateway.transport.credentials import Credentials, CredentialStore, lookup_order
from gateway.transport.pool import ClientPool
from gateway.transport.resolve import Origin, Target, Targets, go_duration, normalize_path, resolve_target
from gateway.transport.tls import ClientCertificate
from gateway.transport.wire import HTTPResponse

__all__ = [
    "ClientCertificate",
    "ClientPool",
    "CredentialStore",
    "Credentials",
    "HTTPResponse",
    "Origin",
    "Target",
    "Targets",
    "go_duration",
    "lookup_order",
    "normalize_path",
    "resolve_target",
]
