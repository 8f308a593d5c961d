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

Where ejection state lives: each endpoint's consecutive connection failures, ejection count and
ejection end are one ``EjectionWord`` in a ``Cell`` (``gateway.resilience.cells``). With
``--workers N`` the router gets a ``CellStore`` shared by every worker (``gateway.server
.shared_state``): failures from every worker count towards one ejection, and a pod ejected by one
worker gets no call from any. Calls outstanding (the load-balancing signal) stay per worker.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Final, NamedTuple, Protocol, TypedDict, Unpack

from gateway.resilience.cells import Cell, CellStore, LocalCell
from gateway.transport.resolve import Target

Clock = Callable[[], float]

ServiceKey = tuple[str, str, int]  # (namespace, name, service port)

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


class EjectionWord(NamedTuple):
    """An endpoint's outlier-detection state, as its cell stores it (replaced whole)."""

    connect_failures: int = 0  # consecutive, since the last call that connected
    ejections: int = 0  # times ejected so far (each ejection lasts longer)
    ejected_until: float = 0.0  # clock seconds


HEALTHY: Final = EjectionWord()


class EndpointState:
    """The picker's view of one endpoint: readiness from the slices, calls outstanding from this
    process, ejection state from its cell."""

    __slots__ = ("address", "cell", "outstanding", "port", "ready", "terminating")

    def __init__(
        self,
        address: str,
        port: int,
        ready: bool = True,
        terminating: bool = False,
        cell: Cell[EjectionWord] | None = None,
    ) -> None:
        self.address = address
        self.port = port
        self.ready = ready
        self.terminating = terminating
        self.outstanding = 0
        self.cell: Cell[EjectionWord] = cell if cell is not None else LocalCell(HEALTHY)

    @property
    def connect_failures(self) -> int:
        return self.cell.read().connect_failures

    @property
    def ejections(self) -> int:
        return self.cell.read().ejections

    @property
    def ejected_until(self) -> float:
        return self.cell.read().ejected_until

    @ejected_until.setter
    def ejected_until(self, until: float) -> None:
        self.cell.update(lambda word: (word._replace(ejected_until=until), None))

    def eligible(self, now: float) -> bool:
        return self.ready and not self.terminating and self.cell.read().ejected_until <= now


@dataclass(slots=True, eq=False)
class Lease:
    """One call routed to ``endpoint``; report its end with ``EndpointPicker.done`` exactly once."""

    endpoint: EndpointState
    target: Target
    finished: bool = field(default=False)


class EndpointPicker:
    """The endpoints of one service and the choice among them. Not thread-safe.

    ``cells`` and ``service``: where the ejection state of this service's endpoints is shared
    (under the key ``(*service, address, port)``); without them it is this process's own.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        rng: random.Random | None = None,
        eject_after: int = DEFAULT_EJECT_AFTER,
        eject_seconds: float = DEFAULT_EJECT_SECONDS,
        cells: CellStore[EjectionWord] | None = None,
        service: ServiceKey | None = None,
    ) -> None:
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - load balancing, not security
        self.eject_after = eject_after
        self.eject_seconds = eject_seconds
        self._cells = cells
        self._service: tuple[str | int, ...] = service or ()
        self.endpoints: dict[tuple[str, int], EndpointState] = {}

    def update(self, endpoints: Iterable[EndpointInfo]) -> None:
        """The service's endpoints now; known ones keep their counters and ejection."""
        fresh: dict[tuple[str, int], EndpointState] = {}
        for e in endpoints:
            key = (e.address, e.port)
            state = self.endpoints.get(key) or fresh.get(key)
            if state is None:
                cell = self._cells.attach((*self._service, *key)) if self._cells is not None else None
                state = EndpointState(e.address, e.port, cell=cell)
            state.ready = e.ready
            state.terminating = e.terminating
            fresh[key] = state
        gone = [key for key in self.endpoints if key not in fresh]
        self.endpoints = fresh
        self._release(gone)

    def close(self) -> None:
        """The service is no longer balanced here: release its endpoints' shared state."""
        gone, self.endpoints = list(self.endpoints), {}
        self._release(gone)

    def _release(self, keys: Iterable[tuple[str, int]]) -> None:
        if self._cells is not None:
            for key in keys:
                self._cells.release((*self._service, *key))

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
        if connect_failed:
            endpoint.cell.update(partial(self._connect_failed, self._clock()))
        elif endpoint.cell.read().connect_failures:  # the hot path: a read, no write
            endpoint.cell.update(_connected)

    def _connect_failed(self, now: float, word: EjectionWord) -> tuple[EjectionWord, None]:
        failures = word.connect_failures + 1
        if failures < self.eject_after:
            return word._replace(connect_failures=failures), None
        ejections = word.ejections + 1
        seconds = min(self.eject_seconds * ejections, MAX_EJECT_SECONDS)
        return EjectionWord(0, ejections, now + seconds), None


def _connected(word: EjectionWord) -> tuple[EjectionWord, None]:
    return word._replace(connect_failures=0), None


class PickerSettings(TypedDict, total=False):
    """How every service's picker chooses and ejects (``EndpointPicker``'s keywords); ``cells``:
    where the endpoints' ejection state is shared with other processes (``--workers``)."""

    rng: random.Random | None
    eject_after: int
    eject_seconds: float
    cells: CellStore[EjectionWord] | None


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
            gone = self.pickers.pop(key, None)
            if gone is not None:
                gone.close()
            return
        picker = self.pickers.get(key)
        if picker is None:
            picker = self.pickers[key] = self._new_picker(service=key)
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
