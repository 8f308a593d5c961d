"""Namespace labels for namespaceSelector matching (GW-01, MAT-13..17, MAT-33).

Two sources answer ``await source.labels(name)`` with the labels of a namespace or ``NOT_FOUND``:

* ``FileNamespaces``: the ``Namespace`` objects of the configuration directory; an unknown name is
  ``NOT_FOUND`` (``unknownNamespace: notFound``, the default) or has no labels (``emptyLabels``).
* ``ClusterNamespaces``: the namespaces' names and labels kept by the one ``Reflector``
  (``gateway.sources.reflector``: list, watch with bookmarks, re-list on 410, back off on errors).
  A name missing from it is fetched once with a live GET (upstream's namespace matcher does the
  same) and the answer is kept until the watch reports that name.

Any other failure raises ``NamespaceLookupError``; the dispatcher turns it into MAT-17's 500.
"""

from __future__ import annotations

import enum
import urllib.parse
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, Literal, Protocol

import msgspec
import trio

from gateway.config.model import Snapshot
from gateway.errors import NamespaceLookupError
from gateway.sources.configdir import ConfigStore
from gateway.sources.kube import KubeAPIError, KubeClient, KubeError
from gateway.sources.reflector import Backoff, Change, Collection, ObjectMeta, Reflector
from gateway.wire.kubeconfig import redact_url


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


# --- cluster mode ----------------------------------------------------------------------------------


class _Namespace(msgspec.Struct):
    """All the gateway keeps of a Namespace: its name and labels."""

    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)


_namespace_decoder: Final = msgspec.json.Decoder(_Namespace)

NAMESPACES: Final = Collection("/api/v1/namespaces")
MAX_FETCHED: Final = 10_000  # live-GET answers kept for names the watch has not (yet) reported


class ClusterNamespaces:
    """Namespace labels from a list+watch of the cluster (GW-01 watch mode), through ``Reflector``.

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
        self._on_event = on_event or (lambda _kind: None)
        self.reflector: Reflector[_Namespace] = Reflector(
            client,
            NAMESPACES,
            _Namespace,
            on_change=self._changed,
            on_event=self._on_event,
            watch_timeout_seconds=watch_timeout_seconds,
            idle_timeout=idle_timeout,
            backoff=backoff,
            page_size=page_size,
        )
        # Answers of live GETs for names the watch has not reported (yet): the watch's word wins.
        self._fetched: dict[str, Labels | NotFound] = {}
        self._inflight: dict[str, trio.Event] = {}

    def __repr__(self) -> str:
        server = redact_url(self._client.config.server)
        return (
            f"<ClusterNamespaces {server} ready={self.ready} namespaces={len(self.reflector.store)}"
            f" resourceVersion={self.resource_version!r} lists={self.lists}>"
        )

    @property
    def resource_version(self) -> str:
        return self.reflector.resource_version

    @property
    def lists(self) -> int:
        return self.reflector.lists

    @property
    def ready(self) -> bool:
        return self.reflector.ready

    async def wait_synced(self) -> None:
        await self.reflector.wait_synced()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """List and watch namespaces until cancelled; never returns, never raises KubeError."""
        await self.reflector.run(task_status=task_status)

    def _changed(self, changes: tuple[Change[_Namespace], ...]) -> None:
        for change in changes:
            self._fetched.pop(change.key, None)

    def labels_now(self, name: str) -> Labels | NotFound | None:
        found = self.reflector.store.get(name)
        if found is not None:
            return _labels_of(found)
        return self._fetched.get(name)

    async def labels(self, name: str) -> Labels | NotFound:
        cached = self.labels_now(name)
        if cached is not None:
            return cached
        pending = self._inflight.get(name)
        if pending is not None:
            # Another review is already fetching this name: share its answer. If it failed or was
            # cancelled, fall through and try once ourselves.
            await pending.wait()
            cached = self.labels_now(name)
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
        """One live GET for a cache miss; the answer is kept unless the watch got there first."""
        path = f"{NAMESPACES.path}/{urllib.parse.quote(name, safe='')}"
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
        self._on_event("get")
        known = self.labels_now(name)
        if known is not None:
            return known
        if len(self._fetched) >= MAX_FETCHED:
            self._fetched.clear()
        self._fetched[name] = result
        return result


def _labels_of(namespace: _Namespace) -> Labels:
    labels = namespace.metadata.labels
    return MappingProxyType(labels) if labels else EMPTY_LABELS
