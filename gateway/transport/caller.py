"""The gateway's one outbound caller: every call to a backend, admission or conversion, goes here.

``BackendCaller.post`` takes a backend's ``clientConfig`` and a body and returns the HTTP reply. In
one place, for every caller:

- **where and how**: the ``Target`` (URL, TLS context, credentials headers, pool key) comes from the
  caller's ``Targets`` table (``gateway.transport.resolve``), built once per configuration snapshot
  and credential store, never per call: the one place backend trust and credentials are resolved;
- **which pod**: a ``clientConfig.service`` backend is balanced over its EndpointSlices when the
  gateway watches them (``gateway.transport.endpoints``);
- **the call**: pooled HTTP/1.1 or HTTP/2 (``gateway.transport.pool``), with the review's trace
  context, bounded by ``timeout_seconds`` as a whole (FPT-05);
- **what went wrong**: every failure is one ``CallingWebhookError`` carrying the full URL and the
  transport cause, with upstream's message shapes (ERR-03/06): ``failed to call webhook: Post
  "<url>": <cause>``; an unusable client configuration is ``could not get REST client: <error>``
  (TRN-07); a reply over the size limit ``failed to call webhook: response body exceeds <n> bytes``
  (TRN-12). HTTP statuses are returned as they are: classifying them is the caller's job (REV-09,
  ERR-07, CNV-13).

``call``/``url`` are the dispatch port ``WebhookCaller`` (``gateway.dispatch.ports``) over ``post``.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from gateway.config.model import ClientConfig, ServiceReference, Snapshot, Webhook
from gateway.config.trust import CaReference
from gateway.errors import (
    CallingWebhookError,
    ClientConfigError,
    ResponseTooLarge,
    TransportError,
)
from gateway.tracing import child_traceparent
from gateway.transport.credentials import CredentialStore
from gateway.transport.endpoints import EndpointRouter
from gateway.transport.pool import ClientPool
from gateway.transport.resolve import Target, Targets
from gateway.transport.trust import TrustStore


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    content_type: str
    body: bytes


class BackendCaller:
    """Calls backends through one shared ClientPool, with per-host credentials.

    Owns its ``Targets``: ``prepare`` resolves a new configuration snapshot's backends (admission
    and conversion) once; setting ``credentials`` (a reload) starts a new table, since every target
    may change with them.
    """

    def __init__(
        self,
        pool: ClientPool,
        credentials: CredentialStore | None = None,
        endpoints: EndpointRouter | None = None,
        trust: TrustStore | None = None,
    ) -> None:
        self.pool = pool
        self._targets = Targets(credentials, trust)
        self.endpoints = endpoints  # service backends balanced over their EndpointSlices when set
        if trust is not None:
            trust.subscribe(self._trust_changed)

    @property
    def credentials(self) -> CredentialStore | None:
        return self._targets.credentials

    @credentials.setter
    def credentials(self, credentials: CredentialStore | None) -> None:
        previous, self._targets = self._targets, Targets(credentials, self._targets.trust)
        self._targets.retain(previous.client_configs())

    def _trust_changed(self, _reference: CaReference) -> None:
        """A referenced CA bundle changed: rebuild the targets now, so that every call from here on
        verifies against the new bundle. Its TLS digest is part of the pool key, so new calls open
        new connections; those opened under the previous bundle finish their calls and close when
        idle (as the apiserver's own client does when a caBundle changes)."""
        self._targets.retain(self._targets.client_configs())

    def prepare(self, snapshot: Snapshot) -> None:
        """Resolve the targets of ``snapshot``'s backends now, and forget those of older snapshots."""
        self._targets.retain(
            (
                *(hook.client_config for hook in (*snapshot.validating, *snapshot.mutating)),
                *(entry.client_config for entry in snapshot.conversions.values()),
            )
        )

    # --- the dispatch port ---

    def call(self, hook: Webhook, body: bytes, *, timeout_seconds: float) -> Coroutine[Any, Any, Reply]:
        """``post`` to ``hook``'s backend; awaited like ``post`` (a plain function returning its
        coroutine: one coroutine layer fewer on every backend call)."""
        return self.post(hook.client_config, body, timeout_seconds=timeout_seconds)

    def url(self, hook: Webhook, *, timeout_seconds: float) -> str:
        return self.url_for(hook.client_config, timeout_seconds=timeout_seconds)

    # --- any backend ---

    def url_for(self, client_config: ClientConfig, *, timeout_seconds: float | None = None) -> str:
        """The URL a call would use (with ``?timeout=`` unless ``timeout_seconds`` is None), for
        messages and logs; the configured one as written when the configuration is unusable."""
        try:
            target = self._target(client_config)
        except CallingWebhookError:
            return client_config.url or ""
        if timeout_seconds is None:
            return f"{target.scheme}://{target.authority}{target.path}"
        return target.url_for(timeout_seconds)

    def post(
        self, client_config: ClientConfig, body: bytes, *, timeout_seconds: float
    ) -> Coroutine[Any, Any, Reply]:
        """POST ``body`` to the backend of ``client_config`` within ``timeout_seconds``: ``await`` it.

        Raises ``CallingWebhookError`` (with ``url`` and ``cause``) when no reply was read; an
        unusable client configuration (TRN-07) already when called. A plain function returning the
        call's coroutine (speed: one coroutine layer fewer, which every wake-up of the call also
        walks through).
        """
        target = self._target(client_config)
        service = client_config.service
        if self.endpoints is None or service is None:
            return self._post(target, body, timeout_seconds)
        return self._post_routed(target, service, body, timeout_seconds)

    async def _post_routed(
        self, target: Target, service: ServiceReference, body: bytes, timeout_seconds: float
    ) -> Reply:
        """A ``clientConfig.service`` backend, balanced over its EndpointSlices when they are known."""
        assert self.endpoints is not None
        key = (service.namespace, service.name, service.port)
        lease = self.endpoints.route(key, target)
        if lease is None:
            return await self._post(target, body, timeout_seconds)  # no endpoint data: DNS
        connect_failed = False
        try:
            return await self._post(lease.target, body, timeout_seconds)
        except CallingWebhookError as exc:
            connect_failed = exc.kind == "connect"
            raise
        finally:
            self.endpoints.done(key, lease, connect_failed=connect_failed)

    def _target(self, client_config: ClientConfig) -> Target:
        try:
            return self._targets.get(client_config)
        except ClientConfigError as exc:
            reason = f"could not get REST client: {exc}"
            raise CallingWebhookError(reason, status_code=500, kind="client_config", cause=reason) from None

    async def _post(self, target: Target, body: bytes, timeout_seconds: float) -> Reply:
        trace = child_traceparent()
        headers = ((b"traceparent", trace.encode()),) if trace else ()
        try:
            response = await self.pool.post(
                target, body=body, headers=headers, timeout_seconds=timeout_seconds
            )
        except TransportError as exc:
            raise _failed(target, timeout_seconds, exc) from None
        content_type = response.header(b"content-type") or b""
        return Reply(response.status, content_type.decode("latin-1"), response.body)


def _failed(target: Target, timeout_seconds: float, exc: TransportError) -> CallingWebhookError:
    url = target.url_for(timeout_seconds)
    if isinstance(exc, ResponseTooLarge):  # TRN-12's text names no URL
        reason = f"failed to call webhook: {exc.cause}"
    else:
        reason = f'failed to call webhook: Post "{url}": {exc.cause}'
    return CallingWebhookError(reason, status_code=503, kind=exc.kind, url=url, cause=exc.cause)
