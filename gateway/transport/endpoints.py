"""Endpoint-aware load balancing for ``clientConfig.service`` backends.

A service backend is one DNS name; with keep-alive every call sticks to whichever pod the first
connection reached. When the gateway watches the service's EndpointSlices, ``EndpointRouter``
turns a service ``Target`` into a ``Target`` for one pod address instead: the connection goes to the
pod, TLS is still verified against the service DNS name (the name the backend's certificate is
issued for), and the pool keeps separate connections per pod (the pool key includes the address).

Per call the picker takes two random eligible endpoints and uses the one with fewer calls
outstanding (power of two choices). Terminating endpoints get no new calls (drain). An endpoint
with ``eject_after`` consecutive connection failures is ejected for ``eject_seconds`` (longer each
time it is ejected again), as Envoy's outlier detection does; if every ready endpoint is ejected,
all of them are used again (a panic mode: better a likely failure than a certain one). Without
endpoint data for a service (no cluster access, not yet synced, no ready endpoint) the target is
returned unchanged: today's DNS behaviour.

No I/O: fed by ``gateway.sources.endpointslices`` through ``update``; the clock is injected.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Final, Protocol, TypedDict, Unpack

from gateway.transport.resolve import Target

Clock = Callable[[], float]

DEFAULT_EJECT_AFTER: Final = 3
DEFAULT_EJECT_SECONDS: Final = 30.0
MAX_EJECT_SECONDS: Final = 300.0


class EndpointInfo(Protocol):
    """One endpoint as the EndpointSlice source reports it (structural: sources is a sibling)."""

    @property
    def address(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def ready(self) -> bool: ...
    @property
    def terminating(self) -> bool: ...


@dataclass(slots=True, eq=False)
class EndpointState:
    """The picker's view of one endpoint."""

    address: str
    port: int
    ready: bool = True
    terminating: bool = False
    outstanding: int = 0
    connect_failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0

    def eligible(self, now: float) -> bool:
        return self.ready and not self.terminating and self.ejected_until <= now


@dataclass(slots=True, eq=False)
class Lease:
    """One call routed to ``endpoint``; report its end with ``EndpointPicker.done`` exactly once."""

    endpoint: EndpointState
    target: Target
    finished: bool = field(default=False)


class EndpointPicker:
    """The endpoints of one service and the choice among them. Not thread-safe."""

    def __init__(
        self,
        clock: Clock,
        *,
        rng: random.Random | None = None,
        eject_after: int = DEFAULT_EJECT_AFTER,
        eject_seconds: float = DEFAULT_EJECT_SECONDS,
    ) -> None:
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - load balancing, not security
        self.eject_after = eject_after
        self.eject_seconds = eject_seconds
        self.endpoints: dict[tuple[str, int], EndpointState] = {}

    def update(self, endpoints: Iterable[EndpointInfo]) -> None:
        """The service's endpoints now; known ones keep their counters and ejection."""
        fresh: dict[tuple[str, int], EndpointState] = {}
        for e in endpoints:
            key = (e.address, e.port)
            state = self.endpoints.get(key) or fresh.get(key) or EndpointState(e.address, e.port)
            state.ready = e.ready
            state.terminating = e.terminating
            fresh[key] = state
        self.endpoints = fresh

    def pick(self) -> EndpointState | None:
        """An endpoint for the next call, or None when none is ready (use DNS)."""
        now = self._clock()
        candidates = [e for e in self.endpoints.values() if e.eligible(now)]
        if not candidates:
            # Panic mode: every ready endpoint is ejected; try them rather than refuse.
            candidates = [e for e in self.endpoints.values() if e.ready and not e.terminating]
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if a.outstanding <= b.outstanding else b

    def started(self, endpoint: EndpointState) -> None:
        endpoint.outstanding += 1

    def finished(self, endpoint: EndpointState, *, connect_failed: bool) -> None:
        """A call ended; ``connect_failed`` when no connection could be made to the endpoint."""
        endpoint.outstanding -= 1
        if not connect_failed:
            endpoint.connect_failures = 0
            return
        endpoint.connect_failures += 1
        if endpoint.connect_failures >= self.eject_after:
            endpoint.ejections += 1
            endpoint.connect_failures = 0
            seconds = min(self.eject_seconds * endpoint.ejections, MAX_EJECT_SECONDS)
            endpoint.ejected_until = self._clock() + seconds


ServiceKey = tuple[str, str, int]  # (namespace, name, service port)


class PickerSettings(TypedDict, total=False):
    """How every service's picker chooses and ejects (``EndpointPicker``'s keywords)."""

    rng: random.Random | None
    eject_after: int
    eject_seconds: float


class EndpointRouter:
    """Pickers per service, all made with the same ``PickerSettings``; ``route`` a resolved service
    ``Target`` to one of its pods."""

    def __init__(self, clock: Clock, **settings: Unpack[PickerSettings]) -> None:
        if settings.get("rng") is None:  # one generator for every picker
            settings["rng"] = random.Random()  # noqa: S311 - load balancing, not security
        self._new_picker = partial(EndpointPicker, clock, **settings)
        self.pickers: dict[ServiceKey, EndpointPicker] = {}

    def update(self, service: ServiceKey, endpoints: Iterable[EndpointInfo] | None) -> None:
        """New endpoint data for a service port; ``None`` forgets it (back to DNS)."""
        key = service
        if endpoints is None:
            self.pickers.pop(key, None)
            return
        picker = self.pickers.get(key)
        if picker is None:
            picker = self.pickers[key] = self._new_picker()
        picker.update(endpoints)

    def route(self, service: ServiceKey, target: Target) -> Lease | None:
        """A lease on one endpoint of ``service`` with ``target`` re-pointed at it, or None (use DNS).

        The new target dials the pod address and port; its TLS server name, ``Host``/``:authority``
        and URL stay the service's, so certificates are verified against the service DNS name.
        """
        picker = self.pickers.get(service)
        if picker is None:
            return None
        endpoint = picker.pick()
        if endpoint is None:
            return None
        picker.started(endpoint)
        routed = replace(
            target,
            host=endpoint.address,
            port=endpoint.port,
            origin=replace(target.origin, host=endpoint.address, port=endpoint.port),
        )
        return Lease(endpoint, routed)

    def done(self, service: ServiceKey, lease: Lease, *, connect_failed: bool = False) -> None:
        """The call of ``lease`` ended (any way); ``connect_failed`` when no connection was made."""
        if lease.finished:
            return
        lease.finished = True
        picker = self.pickers.get(service)
        if (
            picker is not None
            and picker.endpoints.get((lease.endpoint.address, lease.endpoint.port)) is lease.endpoint
        ):
            picker.finished(lease.endpoint, connect_failed=connect_failed)
        else:
            lease.endpoint.outstanding -= 1  # the endpoint is gone; keep its counter honest anyway
