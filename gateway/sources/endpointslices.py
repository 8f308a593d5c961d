"""The ready endpoints of the services that backends reference, from their EndpointSlices.

For each ``(namespace, service, port)`` referenced by a ``clientConfig.service``, a reflector like
the namespace watch's: list ``discovery.k8s.io/v1`` EndpointSlices labelled
``kubernetes.io/service-name=<service>``, then watch from the list's resourceVersion with
bookmarks, re-list on 410, back off on errors. Every change hands the service's endpoints to
``on_change`` (the transport's ``EndpointRouter.update``); a service no longer referenced is
handed ``None`` (back to DNS). RBAC: list and watch ``endpointslices`` in ``discovery.k8s.io``.

The port: EndpointSlices carry target ports named after the Service's ports, and the gateway does
not read Services. A slice with one port is used with it; with several, the one equal to the
service port of the ``clientConfig``; otherwise the slice is skipped (its endpoints reached by DNS).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

import msgspec
import structlog
import trio

from gateway.config.model import Snapshot
from gateway.sources.kube import (
    KubeAPIError,
    KubeClient,
    KubeError,
    ListMeta,
    WatchExpiredError,
    watch_error,
    watch_event_decoder,
)
from gateway.sources.namespaces import Backoff

log = structlog.get_logger(__name__)

SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"
MAX_ENDPOINTS_PER_SERVICE: Final = 5000  # bounds memory whatever the cluster holds

ServiceKey = tuple[str, str, int]  # (namespace, service name, service port)


@dataclass(frozen=True, slots=True)
class ServiceEndpoint:
    """One pod address of a service: what the transport's picker needs."""

    address: str
    port: int
    ready: bool
    terminating: bool


EndpointsListener = Callable[[ServiceKey, "tuple[ServiceEndpoint, ...] | None"], None]


# --- wire types --------------------------------------------------------------------------------


class _Meta(msgspec.Struct, rename="camel"):
    name: str = ""
    resource_version: str = ""


class _Conditions(msgspec.Struct):
    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


class _Endpoint(msgspec.Struct):
    addresses: list[str] = msgspec.field(default_factory=list)
    conditions: _Conditions = msgspec.field(default_factory=_Conditions)


class _Port(msgspec.Struct):
    name: str | None = None
    port: int | None = None
    protocol: str | None = None


class _EndpointSlice(msgspec.Struct, rename="camel"):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    address_type: str = ""
    endpoints: list[_Endpoint] | None = None
    ports: list[_Port] | None = None


class _EndpointSliceList(msgspec.Struct):
    metadata: ListMeta = msgspec.field(default_factory=ListMeta)
    items: list[_EndpointSlice] = msgspec.field(default_factory=list)


_slice_decoder: Final = msgspec.json.Decoder(_EndpointSlice)
_list_decoder: Final = msgspec.json.Decoder(_EndpointSliceList)


def slices_path(namespace: str) -> str:
    return f"/apis/discovery.k8s.io/v1/namespaces/{urllib.parse.quote(namespace, safe='')}/endpointslices"


def _slice_port(item: _EndpointSlice, service_port: int) -> int | None:
    ports = [p.port for p in item.ports or () if p.port is not None and (p.protocol or "TCP") == "TCP"]
    if len(ports) == 1:
        return ports[0]
    return service_port if service_port in ports else None


def _endpoints_of(item: _EndpointSlice, service_port: int) -> list[ServiceEndpoint]:
    if item.address_type not in ("IPv4", "IPv6"):
        return []  # FQDN slices: nothing to dial that DNS would not
    port = _slice_port(item, service_port)
    if port is None:
        return []
    out = []
    for e in item.endpoints or ():
        if not e.addresses:
            continue
        c = e.conditions
        # upstream: a nil ready condition means ready; nil terminating means not terminating.
        out.append(ServiceEndpoint(e.addresses[0], port, c.ready is not False, c.terminating is True))
    return out


# --- the reflectors ------------------------------------------------------------------------------


class ClusterEndpointSlices:
    """Endpoint data for the referenced services; ``run()`` is the long-lived task."""

    def __init__(
        self,
        client: KubeClient,
        on_change: EndpointsListener,
        *,
        watch_timeout_seconds: int = 300,
        idle_timeout: float | None = None,
        backoff: Callable[[], Backoff] = Backoff,
        page_size: int = 500,
    ) -> None:
        self._client = client
        self._on_change = on_change
        self._watch_timeout = watch_timeout_seconds
        self._idle_timeout = idle_timeout if idle_timeout is not None else watch_timeout_seconds + 30.0
        self._backoff = backoff
        self._page_size = page_size
        self._wanted: frozenset[ServiceKey] = frozenset()
        self._wanted_changed = trio.Event()
        self._running: dict[ServiceKey, trio.CancelScope] = {}
        self.lists = 0  # successful lists, for tests

    def __repr__(self) -> str:
        return f"<ClusterEndpointSlices {self._client.config.server} services={sorted(self._wanted)}>"

    def watch_services(self, services: Iterable[ServiceKey]) -> None:
        """The services referenced by the configuration now (call at start and after each reload)."""
        wanted = frozenset(services)
        if wanted != self._wanted:
            self._wanted = wanted
            self._wanted_changed.set()

    def watch_snapshot(self, snapshot: Snapshot) -> None:
        """Watch the services the backends of ``snapshot`` reference."""
        self.watch_services(referenced_services(snapshot))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start and stop one reflector per referenced service until cancelled."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                self._wanted_changed = trio.Event()
                wanted = self._wanted
                for key in [k for k in self._running if k not in wanted]:
                    self._running.pop(key).cancel()
                    self._on_change(key, None)
                for key in wanted:
                    if key not in self._running:
                        scope = self._running[key] = trio.CancelScope()
                        nursery.start_soon(self._reflect, key, scope)
                await self._wanted_changed.wait()

    async def _reflect(self, key: ServiceKey, scope: trio.CancelScope) -> None:
        backoff = self._backoff()
        slices: dict[str, list[ServiceEndpoint]] = {}
        resource_version = ""
        relist = True
        with scope:
            while True:
                try:
                    if relist:
                        slices, resource_version = await self._list(key)
                        self._publish(key, slices)
                        relist = False
                        backoff.reset()
                    resource_version, events = await self._watch(key, slices, resource_version)
                    if events:
                        backoff.reset()
                        continue
                    delay = backoff.next_delay()
                except WatchExpiredError as exc:
                    log.info("endpointslice watch expired, re-listing", service=_label(key), error=str(exc))
                    relist = True
                    continue
                except KubeError as exc:
                    delay = backoff.next_delay()
                    log.warning(
                        "endpointslice list/watch failed",
                        service=_label(key), error=str(exc), relist=relist, retry_in=round(delay, 3),
                    )  # fmt: skip
                await trio.sleep(delay)

    def _query(self, key: ServiceKey) -> dict[str, str]:
        return {"labelSelector": f"{SERVICE_NAME_LABEL}={key[1]}"}

    async def _list(self, key: ServiceKey) -> tuple[dict[str, list[ServiceEndpoint]], str]:
        path = slices_path(key[0])
        fresh: dict[str, list[ServiceEndpoint]] = {}
        query = {**self._query(key), "limit": str(self._page_size)}
        while True:
            body = await self._client.get(path, query)
            try:
                page = _list_decoder.decode(body)
            except msgspec.DecodeError as exc:
                raise KubeError(f'Get "{self._client.url(path, query)}": {exc}') from exc
            for item in page.items:
                fresh[item.metadata.name] = _endpoints_of(item, key[2])
            if not page.metadata.continue_:
                break
            query = {**self._query(key), "limit": str(self._page_size), "continue": page.metadata.continue_}
        self.lists += 1
        return fresh, page.metadata.resource_version

    async def _watch(
        self, key: ServiceKey, slices: dict[str, list[ServiceEndpoint]], resource_version: str
    ) -> tuple[str, int]:
        """Watch until the server ends it; returns the last resourceVersion and the event count."""
        path = slices_path(key[0])
        query = {
            **self._query(key),
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._watch_timeout),
        }
        url = self._client.url(path, query)
        events = 0
        try:
            async with self._client.watch(path, query, idle_timeout=self._idle_timeout) as stream:
                async for line in stream:
                    rv, changed = self._apply(key, slices, line, url)
                    resource_version = rv or resource_version
                    events += 1
                    if changed:
                        self._publish(key, slices)
        except KubeAPIError as exc:
            if exc.code == 410:
                raise WatchExpiredError(str(exc)) from exc
            raise
        return resource_version, events

    def _apply(
        self, key: ServiceKey, slices: dict[str, list[ServiceEndpoint]], line: bytes, url: str
    ) -> tuple[str, bool]:
        try:
            event = watch_event_decoder.decode(line)
            if event.type == "ERROR":
                raise watch_error(event)
            item = _slice_decoder.decode(event.object)
        except msgspec.DecodeError as exc:
            raise KubeError(f'Get "{url}": undecodable watch event: {exc}') from exc
        name = item.metadata.name
        if event.type in ("ADDED", "MODIFIED"):
            slices[name] = _endpoints_of(item, key[2])
        elif event.type == "DELETED":
            slices.pop(name, None)
        elif event.type != "BOOKMARK":
            raise KubeError(f'Get "{url}": unknown watch event type "{event.type}"')
        return item.metadata.resource_version, event.type != "BOOKMARK"

    def _publish(self, key: ServiceKey, slices: dict[str, list[ServiceEndpoint]]) -> None:
        merged: dict[tuple[str, int], ServiceEndpoint] = {}
        for name in sorted(slices):
            for e in slices[name]:
                known = merged.get((e.address, e.port))
                # The same address in two slices (a slice being replaced): a ready entry wins.
                if known is None or (e.ready and not e.terminating and not known.ready):
                    merged[(e.address, e.port)] = e
                if len(merged) >= MAX_ENDPOINTS_PER_SERVICE:
                    break
        self._on_change(key, tuple(merged.values()))


def _label(key: ServiceKey) -> str:
    return f"{key[0]}/{key[1]}:{key[2]}"


def referenced_services(snapshot: Snapshot) -> frozenset[ServiceKey]:
    """The ``(namespace, name, port)`` of every ``clientConfig.service`` of a configuration, the
    conversion backends of its CRDs included."""
    client_configs = (
        *(hook.client_config for hook in (*snapshot.validating, *snapshot.mutating)),
        *(entry.client_config for entry in snapshot.conversions.values()),
    )
    return frozenset((s.namespace, s.name, s.port) for c in client_configs if (s := c.service) is not None)
