"""One reflector for every watch of the cluster: list, watch, re-list on 410, back off on errors.

A ``Reflector`` keeps an in-memory copy of one collection (``/api/v1/namespaces``, the EndpointSlices
of one service, ...) the way client-go's reflector and informer store do:

1. **list** the collection in pages (``limit``/``continue``) with a consistent read, replacing the
   whole store, and remember the list's ``resourceVersion``;
2. **watch** from that resourceVersion with bookmarks (``allowWatchBookmarks``) and a server-side
   ``timeoutSeconds``; every event updates the store and the resourceVersion, so a watch that ends
   or breaks resumes where it stopped, without losing or repeating an event;
3. when the resourceVersion is too old — HTTP 410 to the watch request, or an ``ERROR`` event with
   code 410, after etcd compaction or an apiserver restart — **re-list** (step 1);
4. any other failure (connection, TLS, 5xx, an undecodable event, no data for ``idle_timeout``)
   waits a jittered exponential ``Backoff`` and retries the step that failed; so does a watch that
   ended without a single event or bookmark (a proxy closing idle connections must not make a hot
   loop).

The consumer declares what it keeps: ``item_type`` is a ``msgspec.Struct`` with a ``metadata`` field
(``ObjectMeta``, or any struct with ``name``/``namespace``/``resource_version``) and only the fields
it needs, so the store holds no more than that per object. ``on_change`` receives each batch of
changes as a tuple of ``Change``: one per watch event, or, after every (re-)list, the difference
between the old store and the new list (so a consumer sees deletions that happened while it was
not watching; an empty tuple when nothing differs). It runs in the reflector's task and must not block.

Interface (what a new watch needs, e.g. Secrets or webhook configurations)::

    reflector = Reflector(client, Collection("/api/v1/namespaces/ns/secrets",
                                             label_selector="app=x"), Secret, on_change=handle)
    nursery.start_soon(reflector.run)      # never returns; cancel its scope to stop
    await reflector.wait_synced()          # after the first list
    reflector.store["ns/name"]             # the current object (key: "namespace/name" or "name")

``lists``, ``resource_version`` and ``on_event`` (called with "list", "expired", "error", "added",
"modified", "deleted", "bookmark") are for metrics, ``repr`` and tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Literal, Protocol, TypeVar

import msgspec
import structlog
import trio

from gateway.sources.kube import (
    KubeAPIError,
    KubeClient,
    KubeError,
    ListMeta,
    WatchExpiredError,
    watch_error,
    watch_event_decoder,
)
from gateway.wire.kubeconfig import redact_url

log = structlog.get_logger(__name__)


class ObjectMeta(msgspec.Struct, rename="camel"):
    """The part of ``metadata`` the reflector reads; consumers add what they need (labels, ...)."""

    name: str = ""
    namespace: str = ""
    resource_version: str = ""
    labels: dict[str, str] | None = None


class _Meta(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def resource_version(self) -> str: ...


class KubeObject(Protocol):
    """What the reflector needs of an item: its metadata."""

    @property
    def metadata(self) -> _Meta: ...


T = TypeVar("T", bound=KubeObject)

ChangeType = Literal["ADDED", "MODIFIED", "DELETED"]


@dataclass(frozen=True, slots=True)
class Change(Generic[T]):
    """One object changed: ``old`` is None for ADDED, ``new`` is None for DELETED."""

    type: ChangeType
    key: str
    old: T | None
    new: T | None


@dataclass(frozen=True, slots=True)
class Collection:
    """What to list and watch: a collection path and its selectors."""

    path: str  # e.g. /api/v1/namespaces, /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices
    label_selector: str = ""
    field_selector: str = ""

    def query(self, **extra: str) -> dict[str, str]:
        query = {}
        if self.label_selector:
            query["labelSelector"] = self.label_selector
        if self.field_selector:
            query["fieldSelector"] = self.field_selector
        query.update(extra)
        return query

    def __str__(self) -> str:
        selectors = ",".join(s for s in (self.label_selector, self.field_selector) if s)
        return self.path + (f"?{selectors}" if selectors else "")


@dataclass(slots=True)
class Backoff:
    """Exponential back-off with jitter, bounded, as client-go's reflector uses.

    The n-th consecutive failure waits ``min(initial * factor**n, maximum)``, stretched by a random
    factor in [1, 1 + jitter) so that many gateway replicas do not retry in lockstep.
    """

    initial: float = 0.8
    maximum: float = 30.0
    factor: float = 2.0
    jitter: float = 1.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    def next_delay(self) -> float:
        # The exponent is capped: a float power overflows after ~1000 failures (an API server down
        # for a day), and the maximum is reached long before 64 doublings anyway.
        base = min(self.initial * self.factor ** min(self.failures, 64), self.maximum)
        self.failures += 1
        return min(base * (1 + self.jitter * self.rng.random()), self.maximum * (1 + self.jitter))

    def reset(self) -> None:
        self.failures = 0


def object_key(meta: _Meta) -> str:
    """client-go's MetaNamespaceKeyFunc: ``namespace/name``, or ``name`` for cluster-scoped objects."""
    return f"{meta.namespace}/{meta.name}" if meta.namespace else meta.name


def _ignore(_changes: tuple[Change[Any], ...]) -> None:
    return


def _ignore_event(_kind: str) -> None:
    return


class Reflector(Generic[T]):
    """A list+watch copy of one collection; see the module docstring."""

    def __init__(
        self,
        client: KubeClient,
        collection: Collection,
        item_type: type[T],
        *,
        on_change: Callable[[tuple[Change[T], ...]], None] = _ignore,
        on_event: Callable[[str], None] = _ignore_event,
        watch_timeout_seconds: int = 300,
        idle_timeout: float | None = None,
        backoff: Backoff | None = None,
        page_size: int = 500,
    ) -> None:
        self.client = client
        self.collection = collection
        self._on_change = on_change
        self._on_event = on_event
        self._watch_timeout = watch_timeout_seconds
        # The server ends a watch after timeoutSeconds; data or a bookmark arrives well before.
        self._idle_timeout = idle_timeout if idle_timeout is not None else watch_timeout_seconds + 30.0
        self._backoff = backoff or Backoff()
        self._page_size = page_size
        self._item = msgspec.json.Decoder(item_type)
        self._list: msgspec.json.Decoder[_ListOf[T]] = msgspec.json.Decoder(_ListOf[item_type])  # type: ignore[valid-type]
        self._store: dict[str, T] = {}
        self.store: Mapping[str, T] = MappingProxyType(self._store)
        self._synced = trio.Event()
        self.resource_version = ""
        self.lists = 0  # successful lists

    def __repr__(self) -> str:
        return (
            f"<Reflector {redact_url(self.client.config.server)}{self.collection} ready={self.ready}"
            f" objects={len(self._store)} resourceVersion={self.resource_version!r} lists={self.lists}>"
        )

    @property
    def ready(self) -> bool:
        """True once the first list has been stored."""
        return self._synced.is_set()

    async def wait_synced(self) -> None:
        await self._synced.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """List and watch until cancelled; never returns, never raises ``KubeError``."""
        task_status.started()
        relist = True
        while True:
            try:
                if relist:
                    await self._relist()
                    relist = False
                    self._backoff.reset()
                if await self._watch():
                    self._backoff.reset()
                    continue
                delay = self._backoff.next_delay()
                log.info(
                    "watch ended without events", collection=str(self.collection), retry_in=round(delay, 3)
                )
            except WatchExpiredError as exc:
                log.info("watch expired, re-listing", collection=str(self.collection), error=str(exc))
                self._on_event("expired")
                relist = True
                continue
            except KubeError as exc:
                # A broken watch resumes from the last resourceVersion seen (events are not lost);
                # only a failed list, or 410, needs a new list.
                delay = self._backoff.next_delay()
                self._on_event("error")
                log.warning(
                    "list/watch failed",
                    collection=str(self.collection), error=str(exc), relist=relist, retry_in=round(delay, 3),
                )  # fmt: skip
            await trio.sleep(delay)

    async def _relist(self) -> None:
        """A full, paginated list: the store becomes exactly the listed objects."""
        fresh: dict[str, T] = {}
        query = self.collection.query(limit=str(self._page_size))
        while True:
            body = await self.client.get(self.collection.path, query)
            try:
                page = self._list.decode(body)
            except msgspec.DecodeError as exc:
                raise KubeError(f'Get "{self.client.url(self.collection.path, query)}": {exc}') from exc
            for item in page.items:
                fresh[object_key(item.metadata)] = item
            if not page.metadata.continue_:
                break
            query = self.collection.query(limit=str(self._page_size), **{"continue": page.metadata.continue_})
        old = self._store
        changes: list[Change[T]] = [Change("DELETED", k, v, None) for k, v in old.items() if k not in fresh]
        for key, item in fresh.items():
            before = old.get(key)
            if before is None:
                changes.append(Change("ADDED", key, None, item))
            elif before.metadata.resource_version != item.metadata.resource_version:
                changes.append(Change("MODIFIED", key, before, item))
        self._store.clear()
        self._store.update(fresh)
        self.resource_version = page.metadata.resource_version
        self.lists += 1
        self._synced.set()
        self._on_event("list")
        self._on_change(tuple(changes))  # also when empty: the consumer learns it is in sync

    async def _watch(self) -> int:
        """Watch from ``resource_version`` until the server ends it; the number of events seen."""
        query = self.collection.query(
            watch="1",
            resourceVersion=self.resource_version,
            allowWatchBookmarks="true",
            timeoutSeconds=str(self._watch_timeout),
        )
        events = 0
        try:
            async with self.client.watch(
                self.collection.path, query, idle_timeout=self._idle_timeout
            ) as stream:
                url = self.client.url(self.collection.path, query)
                async for line in stream:
                    self._apply(line, url)
                    events += 1
        except KubeAPIError as exc:
            if exc.code == 410:  # the watch request itself answered 410 Gone
                raise WatchExpiredError(str(exc)) from exc
            raise
        return events

    def _apply(self, line: bytes, url: str) -> None:
        """Apply one watch event to the store and tell the consumer."""
        try:
            event = watch_event_decoder.decode(line)
            if event.type == "ERROR":
                raise watch_error(event)  # 410 becomes WatchExpiredError in the caller's hands
            item = self._item.decode(event.object)
        except msgspec.DecodeError as exc:
            raise KubeError(f'Get "{url}": undecodable watch event: {exc}') from exc
        meta = item.metadata
        key = object_key(meta)
        if event.type in ("ADDED", "MODIFIED"):
            before = self._store.get(key)
            self._store[key] = item
            self._on_change((Change("ADDED" if before is None else "MODIFIED", key, before, item),))
        elif event.type == "DELETED":
            before = self._store.pop(key, None)
            if before is not None:
                self._on_change((Change("DELETED", key, before, None),))
        elif event.type != "BOOKMARK":
            raise KubeError(f'Get "{url}": unknown watch event type "{event.type}"')
        self.resource_version = meta.resource_version or self.resource_version
        self._on_event(event.type.lower())


class _ListOf(msgspec.Struct, Generic[T]):
    metadata: ListMeta = msgspec.field(default_factory=ListMeta)
    items: list[T] = msgspec.field(default_factory=list)
