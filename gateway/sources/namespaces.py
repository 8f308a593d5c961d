"""Namespace labels for namespaceSelector matching (GW-01, MAT-13..17, MAT-33).

Two sources answer ``await source.labels(name)`` with the labels of a namespace or ``NOT_FOUND``:

* ``FileNamespaces``: the ``Namespace`` objects of the configuration directory; an unknown name is
  ``NOT_FOUND`` (``unknownNamespace: notFound``, the default) or has no labels (``emptyLabels``).
* ``ClusterNamespaces``: a reflector like client-go's: list, then watch from the list's
  resourceVersion with bookmarks, re-list when the watch expires (410), back off on errors, and
  keep only the labels in memory. A name missing from the cache is fetched once with a live GET
  (upstream's namespace matcher does the same) and the answer is cached.

Any other failure raises ``NamespaceLookupError``; the dispatcher turns it into MAT-17's 500.
"""

from __future__ import annotations

import enum
import random
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal, Protocol

import msgspec
import structlog
import trio

from gateway.config.model import Snapshot
from gateway.errors import NamespaceLookupError
from gateway.sources.configdir import ConfigStore
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


class NotFound(enum.Enum):
    """The namespace does not exist (MAT-16: 404 ``namespaces "<ns>" not found``)."""

    NOT_FOUND = "NotFound"


NOT_FOUND: Final = NotFound.NOT_FOUND

Labels = Mapping[str, str]
UnknownNamespace = Literal["notFound", "emptyLabels"]
EMPTY_LABELS: Final[Labels] = MappingProxyType({})


class NamespaceLabelSource(Protocol):
    """What the dispatcher needs to evaluate namespaceSelectors."""

    @property
    def ready(self) -> bool:
        """True once the source can answer from its own state (MAT-33 readiness)."""
        ...

    async def wait_synced(self) -> None:
        """Return once ``ready`` is true."""
        ...

    async def labels(self, name: str) -> Labels | NotFound:
        """The labels of namespace ``name``; raises ``NamespaceLookupError`` when unobtainable."""
        ...

    def labels_now(self, name: str) -> Labels | NotFound | None:
        """The answer if it is known without waiting (cached), else None."""
        ...


# --- file mode -----------------------------------------------------------------------------------


class FileNamespaces:
    """Labels of the ``Namespace`` objects in the configuration (GW-01 file mode).

    Given a ``Snapshot``, answers from it; given a ``ConfigStore``, from whatever snapshot is current
    (a review that must see one consistent snapshot passes its own, ORD-04).
    """

    def __init__(self, source: Snapshot | ConfigStore, *, unknown_namespace: UnknownNamespace = "notFound"):
        self._source = source
        self._unknown: Labels | NotFound = NOT_FOUND if unknown_namespace == "notFound" else EMPTY_LABELS

    @property
    def ready(self) -> bool:
        return True

    async def wait_synced(self) -> None:
        return

    async def labels(self, name: str) -> Labels | NotFound:
        return self.labels_now(name)

    def labels_now(self, name: str) -> Labels | NotFound:
        snapshot = self._source.snapshot if isinstance(self._source, ConfigStore) else self._source
        found = snapshot.namespaces.get(name)
        return self._unknown if found is None else found

    def __repr__(self) -> str:
        unknown = "notFound" if self._unknown is NOT_FOUND else "emptyLabels"
        return f"<FileNamespaces unknownNamespace={unknown}>"


# --- cluster mode: wire types ----------------------------------------------------------------------


class _ObjectMeta(msgspec.Struct, rename="camel"):
    name: str = ""
    resource_version: str = ""
    labels: dict[str, str] | None = None


class _Namespace(msgspec.Struct):
    metadata: _ObjectMeta = msgspec.field(default_factory=_ObjectMeta)


class _NamespaceList(msgspec.Struct):
    metadata: ListMeta = msgspec.field(default_factory=ListMeta)
    items: list[_Namespace] = msgspec.field(default_factory=list)


_namespace_decoder: Final = msgspec.json.Decoder(_Namespace)
_list_decoder: Final = msgspec.json.Decoder(_NamespaceList)

NAMESPACES_PATH: Final = "/api/v1/namespaces"


# --- cluster mode: back-off ------------------------------------------------------------------------


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


# --- cluster mode: the reflector -------------------------------------------------------------------


class ClusterNamespaces:
    """Namespace labels from a list+watch of the cluster (GW-01 watch mode).

    ``run()`` is the long-lived reflector task (start it in a nursery); ``labels()`` may be called
    from any task at any time. Readiness is reached after the first successful list.
    """

    def __init__(
        self,
        client: KubeClient,
        *,
        watch_timeout_seconds: int = 300,
        idle_timeout: float | None = None,
        backoff: Backoff | None = None,
        page_size: int = 500,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self._client = client
        self._watch_timeout = watch_timeout_seconds
        # The server ends a watch after timeoutSeconds; data or a bookmark arrives well before.
        self._idle_timeout = idle_timeout if idle_timeout is not None else watch_timeout_seconds + 30.0
        self._backoff = backoff or Backoff()
        self._page_size = page_size
        self._on_event = on_event or (lambda _kind: None)
        self._cache: dict[str, Labels | NotFound] = {}
        self._synced = trio.Event()
        self._inflight: dict[str, trio.Event] = {}
        self.resource_version = ""
        self.lists = 0  # successful lists, for __repr__ and tests

    def __repr__(self) -> str:
        known = sum(1 for v in self._cache.values() if v is not NOT_FOUND)
        server = redact_url(self._client.config.server)
        return (
            f"<ClusterNamespaces {server} ready={self.ready} namespaces={known}"
            f" resourceVersion={self.resource_version!r} lists={self.lists}>"
        )

    @property
    def ready(self) -> bool:
        return self._synced.is_set()

    async def wait_synced(self) -> None:
        await self._synced.wait()

    def labels_now(self, name: str) -> Labels | NotFound | None:
        return self._cache.get(name)

    async def labels(self, name: str) -> Labels | NotFound:
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        pending = self._inflight.get(name)
        if pending is not None:
            # Another review is already fetching this name: share its answer. If it failed or was
            # cancelled, fall through and try once ourselves.
            await pending.wait()
            cached = self._cache.get(name)
            if cached is not None:
                return cached
        done = self._inflight[name] = trio.Event()
        try:
            return await self._fetch(name)
        finally:
            if self._inflight.get(name) is done:
                del self._inflight[name]
            done.set()

    async def _fetch(self, name: str) -> Labels | NotFound:
        """One live GET for a cache miss; the answer is cached unless the watch got there first."""
        path = f"{NAMESPACES_PATH}/{urllib.parse.quote(name, safe='')}"
        try:
            body = await self._client.get(path)
            result: Labels | NotFound = _labels_of(_namespace_decoder.decode(body))
        except KubeAPIError as exc:
            if exc.code != 404:
                raise NamespaceLookupError(str(exc)) from exc
            result = NOT_FOUND
        except KubeError as exc:
            raise NamespaceLookupError(str(exc)) from exc
        except msgspec.DecodeError as exc:
            raise NamespaceLookupError(f'Get "{self._client.url(path)}": {exc}') from exc
        self._cache.setdefault(name, result)
        self._on_event("get")
        return self._cache[name]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """List and watch namespaces until cancelled; never returns, never raises KubeError."""
        task_status.started()
        relist = True
        while True:
            try:
                if relist:
                    await self._list()
                    relist = False
                    self._backoff.reset()
                if await self._watch(self.resource_version):
                    self._backoff.reset()
                    continue
                # A watch that ended without delivering anything (not even a bookmark) is
                # suspicious (a proxy closing idle connections?): don't reconnect in a hot loop.
                delay = self._backoff.next_delay()
                log.info("namespace watch ended without events", retry_in=round(delay, 3))
            except WatchExpiredError as exc:
                log.info("namespace watch expired, re-listing", error=str(exc))
                self._on_event("expired")
                relist = True
                continue
            except KubeError as exc:
                # A broken watch resumes from the last resourceVersion seen (events are not lost);
                # only a failed list, or 410, needs a new list.
                delay = self._backoff.next_delay()
                self._on_event("error")
                log.warning(
                    "namespace list/watch failed", error=str(exc), relist=relist, retry_in=round(delay, 3)
                )
            await trio.sleep(delay)

    async def _list(self) -> None:
        """A full, paginated list; replaces the cache whole and records its resourceVersion."""
        fresh: dict[str, Labels | NotFound] = {}
        query: dict[str, str] = {"limit": str(self._page_size)}
        while True:
            body = await self._client.get(NAMESPACES_PATH, query)
            try:
                page = _list_decoder.decode(body)
            except msgspec.DecodeError as exc:
                raise KubeError(f'Get "{self._client.url(NAMESPACES_PATH, query)}": {exc}') from exc
            for item in page.items:
                fresh[item.metadata.name] = _labels_of(item)
            if not page.metadata.continue_:
                break
            query = {"limit": str(self._page_size), "continue": page.metadata.continue_}
        self._cache = fresh
        self.resource_version = page.metadata.resource_version
        self.lists += 1
        self._synced.set()
        self._on_event("list")

    async def _watch(self, resource_version: str) -> int:
        """Watch from ``resource_version`` until the server ends it; returns the number of events."""
        query = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._watch_timeout),
        }
        events = 0
        try:
            async with self._client.watch(NAMESPACES_PATH, query, idle_timeout=self._idle_timeout) as stream:
                async for line in stream:
                    self.resource_version = self._apply(line, self._client.url(NAMESPACES_PATH, query))
                    events += 1
        except KubeAPIError as exc:
            if exc.code == 410:  # the watch request itself answered 410 Gone
                raise WatchExpiredError(str(exc)) from exc
            raise
        return events

    def _apply(self, line: bytes, url: str) -> str:
        """Apply one watch event to the cache; returns the resourceVersion it carries."""
        try:
            event = watch_event_decoder.decode(line)
            if event.type == "ERROR":
                raise watch_error(event)
            namespace = _namespace_decoder.decode(event.object)
        except msgspec.DecodeError as exc:
            raise KubeError(f'Get "{url}": undecodable watch event: {exc}') from exc
        meta = namespace.metadata
        if event.type in ("ADDED", "MODIFIED"):
            self._cache[meta.name] = _labels_of(namespace)
        elif event.type == "DELETED":
            self._cache.pop(meta.name, None)
        elif event.type != "BOOKMARK":
            raise KubeError(f'Get "{url}": unknown watch event type "{event.type}"')
        self._on_event(event.type.lower())
        return meta.resource_version or self.resource_version


def _labels_of(namespace: _Namespace) -> Labels:
    labels = namespace.metadata.labels
    return MappingProxyType(labels) if labels else EMPTY_LABELS
