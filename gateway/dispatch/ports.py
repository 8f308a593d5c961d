"""What dispatch needs from the outside world, as Protocols (implemented structurally elsewhere).

Dispatch never imports transport or sources; ``gateway.transport.caller.BackendCaller`` and the
namespace label sources satisfy these Protocols, and the server wires them together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gateway.config.model import Webhook


class BackendReply(Protocol):
    """An HTTP reply from a backend: status, content type and the whole (bounded) body."""

    @property
    def status(self) -> int: ...
    @property
    def content_type(self) -> str: ...
    @property
    def body(self) -> bytes: ...


class WebhookCaller(Protocol):
    """POSTs one AdmissionReview to a backend within ``timeout_seconds`` (the whole call, FPT-05).

    Raises ``gateway.errors.CallingWebhookError`` for transport failures (ERR-06 texts, including
    ``context deadline exceeded`` on expiry) and unusable client configuration (TRN-07). Any HTTP
    status is returned as a reply; classifying it is dispatch's job (REV-09, ERR-07). This bound is
    the call's only one: dispatch opens no cancel scope of its own around it.
    """

    async def call(self, hook: Webhook, body: bytes, *, timeout_seconds: float) -> BackendReply: ...

    def url(self, hook: Webhook, *, timeout_seconds: float) -> str:
        """The full URL a call would use (for messages when no call is made, FPT-06/08)."""
        ...


class NamespaceNotFoundError(Exception):
    """The namespace does not exist (MAT-16)."""


class NamespaceLabelSource(Protocol):
    """Labels of a namespace by name (GW-01). Raises NamespaceNotFoundError, or anything else for a
    failed lookup (MAT-17)."""

    async def labels(self, name: str) -> Mapping[str, str]: ...

    def labels_now(self, name: str) -> Mapping[str, str] | None:
        """The labels if known without waiting (a cache hit), else None: then ``labels`` is awaited.

        Raises NamespaceNotFoundError like ``labels`` when the answer known now is "no such
        namespace". Lets a review whose namespace is cached skip the deadline ``labels`` needs.
        """
        ...
