"""The seam between the gateway's HTTP server and its application: one ASGI scope extension.

The application (``gateway.server.app``) is a plain ASGI callable and imports nothing of the
server that runs it. The gateway's own server (``gateway.server.hypercorn``) adds one entry to the
``extensions`` of every HTTP request's scope (ASGI's place for what a server offers beyond the
specification)::

    scope["extensions"]["webhook-gateway.disconnect"]  ->  a DisconnectSignal

It tells the application that the request's caller went away (the connection closed or the HTTP/2
stream was reset) at the moment the server learns it, also while the application is not reading
``receive``; a body that misses its deadline is reported where the application waits for it
(``receive`` returns ``http.disconnect``, and ``disconnected`` is true). A review uses it to cancel its
backend calls through a callback, instead of a nursery and a task reading ``receive`` per review
(about 50 µs per review: docs/performance.md). Under a server without the extension the
application falls back to that task; behaviour is the same, only slower.

This module is the whole interface: the server sets it, the application reads it, and neither
imports the other (import-linter enforces it: pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

__all__ = ["DISCONNECT", "DisconnectSignal", "disconnect_signal"]

DISCONNECT: Final = "webhook-gateway.disconnect"


class DisconnectSignal(Protocol):
    """The caller of one request going away, as the server sees it.

    ``disconnected`` turns true, once and for good, when the caller is gone; ``receive`` then
    returns ``http.disconnect``. ``on_disconnect``, when the application has set it, is called when
    the connection closes or the stream is reset, once, synchronously in a task of the server: it
    must be cheap and must not raise (a cancel scope's ``cancel`` is what the gateway's application
    sets). The application sets it back to None when it no longer wants it.
    """

    disconnected: bool
    on_disconnect: Callable[[], object] | None


def disconnect_signal(scope: Mapping[str, Any]) -> DisconnectSignal | None:
    """The request's disconnect signal, or None when the server does not offer one."""
    extensions = scope.get("extensions")
    if not extensions:
        return None
    signal: DisconnectSignal | None = extensions.get(DISCONNECT)
    return signal
