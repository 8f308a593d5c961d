"""The dispatch port ``WebhookCaller``, implemented on the client pool.

Maps every transport failure to a call error once, here, with upstream's message shapes
(ERR-03/06): ``failed to call webhook: Post "<url>": <cause>``, and an unusable client
configuration to ``could not get REST client: <error>`` (TRN-07). HTTP statuses are returned as
they are; dispatch classifies them (REV-09, ERR-07).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config.model import Webhook
from gateway.errors import (
    CallingWebhookError,
    ClientConfigError,
    ResponseTooLarge,
    TransportError,
    TransportTimeout,
)
from gateway.tracing import child_traceparent
from gateway.transport.credentials import CredentialStore
from gateway.transport.endpoints import EndpointRouter
from gateway.transport.pool import ClientPool
from gateway.transport.resolve import Target, resolve_target


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    content_type: str
    body: bytes


def _error_kind(cause: str) -> str:
    """A small, bounded vocabulary for the call-error metric's ``reason`` label."""
    lowered = cause.lower()
    if "certificate" in lowered or "tls" in lowered or "ssl" in lowered:
        return "tls"
    if "refused" in lowered or "no such host" in lowered or "dial tcp" in lowered or "unreachable" in lowered:
        return "connect"
    return "transport"


class BackendCaller:
    """Calls backends through one shared ClientPool, with per-host credentials."""

    def __init__(
        self,
        pool: ClientPool,
        credentials: CredentialStore | None = None,
        endpoints: EndpointRouter | None = None,
    ) -> None:
        self.pool = pool
        self.credentials = credentials
        self.endpoints = endpoints  # service backends balanced over their EndpointSlices when set

    def _target(self, hook: Webhook) -> Target:
        try:
            return resolve_target(hook.client_config, self.credentials)
        except ClientConfigError as exc:
            raise CallingWebhookError(
                f"could not get REST client: {exc}", status_code=500, kind="client_config"
            ) from None

    def url(self, hook: Webhook, *, timeout_seconds: float) -> str:
        return self._target(hook).url_for(timeout_seconds)

    async def call(self, hook: Webhook, body: bytes, *, timeout_seconds: float) -> Reply:
        target = self._target(hook)
        service = hook.client_config.service
        if self.endpoints is None or service is None:
            return await self._call(target, body, timeout_seconds)
        key = (service.namespace, service.name, service.port)
        lease = self.endpoints.route(key, target)
        if lease is None:
            return await self._call(target, body, timeout_seconds)  # no endpoint data: DNS
        connect_failed = False
        try:
            return await self._call(lease.target, body, timeout_seconds)
        except CallingWebhookError as exc:
            connect_failed = exc.kind == "connect"
            raise
        finally:
            self.endpoints.done(key, lease, connect_failed=connect_failed)

    async def _call(self, target: Target, body: bytes, timeout_seconds: float) -> Reply:
        trace = child_traceparent()
        headers = ((b"traceparent", trace.encode()),) if trace else ()
        try:
            response = await self.pool.post(
                target, body=body, headers=headers, timeout_seconds=timeout_seconds
            )
        except TransportTimeout as exc:
            raise self._failed(target, timeout_seconds, exc, "timeout") from None
        except ResponseTooLarge as exc:
            raise CallingWebhookError(
                f"failed to call webhook: {exc.cause}", status_code=503, kind="too_large"
            ) from None
        except TransportError as exc:
            raise self._failed(target, timeout_seconds, exc, _error_kind(exc.cause)) from None
        content_type = response.header(b"content-type") or b""
        return Reply(response.status, content_type.decode("latin-1"), response.body)

    @staticmethod
    def _failed(
        target: Target, timeout_seconds: float, exc: TransportError, kind: str
    ) -> CallingWebhookError:
        url = target.url_for(timeout_seconds)
        return CallingWebhookError(
            f'failed to call webhook: Post "{url}": {exc.cause}', status_code=503, kind=kind
        )
