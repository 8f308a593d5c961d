"""The ready endpoints of the services that backends reference, from their EndpointSlices.

For each ``(namespace, service, port)`` referenced by a ``clientConfig.service``, the one
``Reflector`` (``gateway.sources.reflector``) lists and watches the ``discovery.k8s.io/v1``
EndpointSlices labelled ``kubernetes.io/service-name=<service>``. Every change hands the
service's endpoints to ``on_change`` (the transport's ``EndpointRouter.update``); a service no
longer referenced is handed ``None`` (back to DNS). RBAC: list and watch ``endpointslices`` in
``discovery.k8s.io``.

The port: EndpointSlices carry target ports named after the Service's ports, and the gateway does
not read Services. A slice with one port is used with it; with several, the one equal to the
service port of the ``clientConfig``; otherwise the slice is skipped (its endpoints reached by DNS).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import msgspec
import trio

from gateway.config.model import Snapshot
from gateway.sources.kube import KubeClient
from gateway.sources.reflector import Backoff, Change, Collection, ObjectMeta, Reflector

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
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    address_type: str = ""
    endpoints: list[_Endpoint] | None = None
    ports: list[_Port] | None = None


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
    """Endpoint data for the referenced services, one ``Reflector`` per service; ``run()`` is the
    long-lived task that starts and stops them as the configuration changes."""

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
        self._idle_timeout = idle_timeout
        self._backoff = backoff
        self._page_size = page_size
        self._wanted: frozenset[ServiceKey] = frozenset()
        self._wanted_changed = trio.Event()
        self._running: dict[ServiceKey, tuple[trio.CancelScope, Reflector[_EndpointSlice]]] = {}

    def __repr__(self) -> str:
        return f"<ClusterEndpointSlices {self._client.config.server} services={sorted(self._wanted)}>"

    @property
    def lists(self) -> int:
        """Successful lists of the reflectors running now (tests)."""
        return sum(reflector.lists for _scope, reflector in self._running.values())

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
                    self._running.pop(key)[0].cancel()
                    self._on_change(key, None)
                for key in wanted:
                    if key not in self._running:
                        reflector = self._reflector(key)
                        scope = trio.CancelScope()
                        self._running[key] = (scope, reflector)
                        nursery.start_soon(_run_in, scope, reflector)
                await self._wanted_changed.wait()

    def _reflector(self, key: ServiceKey) -> Reflector[_EndpointSlice]:
        namespace, service, _port = key
        collection = Collection(slices_path(namespace), label_selector=f"{SERVICE_NAME_LABEL}={service}")

        def publish(_changes: tuple[Change[_EndpointSlice], ...]) -> None:
            self._publish(key, reflector.store)

        reflector = Reflector(
            self._client,
            collection,
            _EndpointSlice,
            on_change=publish,
            watch_timeout_seconds=self._watch_timeout,
            idle_timeout=self._idle_timeout,
            backoff=self._backoff(),
            page_size=self._page_size,
        )
        return reflector

    def _publish(self, key: ServiceKey, slices: Mapping[str, _EndpointSlice]) -> None:
        merged: dict[tuple[str, int], ServiceEndpoint] = {}
        for name in sorted(slices):
            for e in _endpoints_of(slices[name], key[2]):
                known = merged.get((e.address, e.port))
                # The same address in two slices (a slice being replaced): a ready entry wins.
                if known is None or (e.ready and not e.terminating and not known.ready):
                    merged[(e.address, e.port)] = e
                if len(merged) >= MAX_ENDPOINTS_PER_SERVICE:
                    break
        self._on_change(key, tuple(merged.values()))


async def _run_in(scope: trio.CancelScope, reflector: Reflector[_EndpointSlice]) -> None:
    with scope:
        await reflector.run()


def referenced_services(snapshot: Snapshot) -> frozenset[ServiceKey]:
    """The ``(namespace, name, port)`` of every ``clientConfig.service`` of a configuration, the
    conversion backends of its CRDs included."""
    client_configs = (
        *(hook.client_config for hook in (*snapshot.validating, *snapshot.mutating)),
        *(entry.client_config for entry in snapshot.conversions.values()),
    )
    return frozenset((s.namespace, s.name, s.port) for c in client_configs if (s := c.service) is not None)
