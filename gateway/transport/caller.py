"""The dispatch port ``WebhookCaller``, implemented on the client pool.

Maps every transport failure to a call error once, here, with upstream's message shapes
(ERR-03/06): ``failed to call webhook: Post "<url>": <cause>``, and an unusable client
configuration to ``could not get REST client: <error>`` (TRN-07). HTTP statuses are returned as
they are; dispatch classifies them (REV-09, ERR-07).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config.model import Snapshot, Webhook
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
from gateway.transport.resolve import Target, Targets


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    content_type: str
    body: bytes


class BackendCaller:
    """Calls backends through one shared ClientPool, with per-host credentials.

    Owns its ``Targets``: ``prepare`` resolves a new configuration snapshot's backends once; setting
    ``credentials`` (a reload) starts a new table, since every target may change with them.
    """

    def __init__(
        self,
        pool: ClientPool,
        credentials: CredentialStore | None = None,
        endpoints: EndpointRouter | None = None,
    ) -> None:
        self.pool = pool
        self._targets = Targets(credentials)
        self.endpoints = endpoints  # service backends balanced over their EndpointSlices when set

    @property
    def credentials(self) -> CredentialStore | None:
        return self._targets.credentials

    @credentials.setter
    def credentials(self, credentials: CredentialStore | None) -> None:
        previous, self._targets = self._targets, Targets(credentials)
        self._targets.retain(previous.client_configs())

    def prepare(self, snapshot: Snapshot) -> None:
        """Resolve the targets of ``snapshot``'s backends now, and forget those of older snapshots."""
        self._targets.retain(hook.client_config for hook in (*snapshot.validating, *snapshot.mutating))

    def _target(self, hook: Webhook) -> Target:
        try:
            return self._targets.get(hook.client_config)
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
            raise self._failed(target, timeout_seconds, exc, exc.kind) from None
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
