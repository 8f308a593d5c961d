"""Reads and follows every ``caFrom`` reference of the configuration in force into the ``TrustStore``.

For each object the references name (``gateway.config.trust.watch_plan``) one ``Reflector`` lists and
watches exactly that object — ``fieldSelector=metadata.name=<name>`` in its namespace, which is what
the RBAC of ``rbac_documents`` allows and nothing more. Every change of the object is read into the
bundle of each reference that names it (a Secret or ConfigMap key, a live webhook's ``caBundle``):

- a usable bundle (at least one certificate a TLS client can load) is put in force at once
  (``TrustStore.accept``); the targets of its backends are rebuilt, new calls verify against it;
- anything else — a missing key, no certificate, a deleted object, an empty ``caBundle`` — is refused:
  the last good bundle stays in force, and the reason is reported (``on_update``: logged and counted).

File references (``caFrom.file``) are read every ``file_interval`` seconds and on change the same way.
A reference is *synced* once its object has been listed (or its file read) once, whatever it held.
``ready`` is True once every reference of the configuration has been synced at start-up, so that a
gateway does not report ready before it knows its backends' CAs; it stays True afterwards. Only the
Reflector's store holds the objects (the Secret's other keys included, as the API serves them);
nothing here logs or repeats their data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Protocol

import msgspec
import structlog
import trio

from gateway.config.model import Snapshot
from gateway.config.trust import (
    CaReference,
    CaSourceError,
    WatchedObject,
    bundle_from_object,
    certificates,
    references,
    usable_bundle,
)
from gateway.sources.kube import KubeClient
from gateway.sources.reflector import Backoff, Change, Collection, ObjectMeta, Reflector

log = structlog.get_logger(__name__)

MAX_FILE_BYTES = 1 << 20  # a CA bundle file larger than 1 MiB is refused unread

OnUpdate = Callable[[CaReference, str, str], None]  # (reference, changed|unchanged|refused, detail)


class TrustSink(Protocol):
    """Where the bundles go (``gateway.transport.trust.TrustStore``; a port, so sources need not
    import the transport)."""

    def accept(self, reference: CaReference, pem: bytes) -> bool: ...
    def refuse(self, reference: CaReference, reason: str) -> None: ...
    def retain(self, references: Iterable[CaReference]) -> None: ...


class _ClientConfig(msgspec.Struct, rename="camel"):
    ca_bundle: str | None = None


class _Webhook(msgspec.Struct, rename="camel"):
    name: str = ""
    client_config: _ClientConfig | None = None


class CaObject(msgspec.Struct, rename="camel"):
    """What is kept of a watched object: what a reference can read (``repr`` omits the data)."""

    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    data: dict[str, str] | None = None
    binary_data: dict[str, str] | None = None
    webhooks: list[_Webhook] | None = None

    def __repr__(self) -> str:
        return (
            f"<CaObject {self.metadata.namespace}/{self.metadata.name} rv={self.metadata.resource_version}>"
        )


def collection(obj: WatchedObject) -> Collection:
    """The list/watch request for exactly ``obj``."""
    base = "/api/v1" if not obj.api_group else f"/apis/{obj.api_group}/{obj.version}"
    scope = f"/namespaces/{obj.namespace}" if obj.namespace else ""
    return Collection(f"{base}{scope}/{obj.resource}", field_selector=f"metadata.name={obj.name}")


def describe_bundle(pem: bytes) -> str:
    """A line naming a bundle's certificates and their expiry, for the log (no key material)."""
    parts = []
    for cert in certificates(pem):
        subject = cert.subject.rfc4514_string() or "(empty subject)"
        parts.append(f"{subject} until {cert.not_valid_after_utc:%Y-%m-%d}")
    return "; ".join(parts)


class CaSources:
    """The watches and file reads behind the ``TrustStore``; ``run`` in a nursery, then
    ``watch_snapshot`` with every configuration put in force (start-up and reloads)."""

    def __init__(
        self,
        trust: TrustSink,
        client: KubeClient | None,
        *,
        on_update: OnUpdate,
        file_interval: float = 2.0,
        backoff: Callable[[], Backoff] = Backoff,
    ) -> None:
        self.trust = trust
        self.client = client
        self._on_update = on_update
        self._file_interval = file_interval
        self._backoff = backoff
        self._references: tuple[CaReference, ...] = ()
        self._watches: dict[WatchedObject, tuple[Reflector[CaObject], trio.CancelScope]] = {}
        self._file_digests: dict[str, str] = {}
        self._files_read: set[str] = set()
        self._nursery: trio.Nursery | None = None
        self._pending: list[WatchedObject] = []
        self._wake_files = trio.Event()
        self._started = False

    def __repr__(self) -> str:
        watches = len(self._watches)
        return f"<CaSources references={len(self._references)} watches={watches} synced={self.synced}>"

    @property
    def watched(self) -> tuple[WatchedObject, ...]:
        """The objects being watched now."""
        return tuple(sorted(self._watches))

    @property
    def synced(self) -> bool:
        """Every reference of the configuration in force has been read once (its value may be bad)."""
        watched = all(reflector.ready for reflector, _ in self._watches.values()) and not self._pending
        files = {r.path for r in self._references if r.source == "file"}
        return watched and files <= self._files_read

    @property
    def ready(self) -> bool:
        """``synced`` until it first holds, then True for good: readiness waits for the references
        at start-up only. A reference added by a later reload that cannot be read (no RBAC yet) must
        not take every replica out of its Service, which would fail every review of the cluster under
        the gateway's own failurePolicy: it fails only its backends' calls, each saying why."""
        if not self._started:
            self._started = self.synced
        return self._started

    # --- what to watch ------------------------------------------------------------------------------

    def watch_snapshot(self, snapshot: Snapshot) -> None:
        """Watch exactly the references of ``snapshot``: start new watches, stop unused ones."""
        self._references = references(snapshot)
        self.trust.retain(self._references)
        wanted = {obj for r in self._references if (obj := r.watched) is not None}
        for obj in [o for o in self._watches if o not in wanted]:
            _reflector, scope = self._watches.pop(obj)
            scope.cancel()
        self._pending = [o for o in self._pending if o in wanted]
        for obj in sorted(wanted):
            if obj in self._watches or obj in self._pending:
                continue
            if self.client is None:
                for reference in self._reading(obj):
                    self._refuse(
                        reference, "the gateway runs without cluster access (--namespace-source config)"
                    )
                continue
            self._pending.append(obj)
        files = {r.path for r in self._references if r.source == "file"}
        self._files_read &= files
        self._file_digests = {p: d for p, d in self._file_digests.items() if p in files}
        self._start_pending()
        self._wake_files.set()

    def _reading(self, obj: WatchedObject) -> list[CaReference]:
        return [r for r in self._references if r.watched == obj]

    def _start_pending(self) -> None:
        if self._nursery is None or self.client is None:
            return
        for obj in self._pending:
            reflector: Reflector[CaObject] = Reflector(
                self.client,
                collection(obj),
                CaObject,
                on_change=partial(self._changed, obj),
                backoff=self._backoff(),
            )
            scope = trio.CancelScope()
            self._watches[obj] = (reflector, scope)
            self._nursery.start_soon(self._run_watch, reflector, scope)
        self._pending = []

    @staticmethod
    async def _run_watch(reflector: Reflector[CaObject], scope: trio.CancelScope) -> None:
        with scope:
            await reflector.run()

    # --- reading values -----------------------------------------------------------------------------

    def _changed(self, obj: WatchedObject, _changes: tuple[Change[CaObject], ...]) -> None:
        """After every list and watch event of ``obj``'s reflector: read what it holds now."""
        entry = self._watches.get(obj)
        if entry is None:
            return
        found = entry[0].store.get(f"{obj.namespace}/{obj.name}" if obj.namespace else obj.name)
        for reference in self._reading(obj):
            if found is None:
                self._refuse(reference, f"{reference.describe()}: the {obj.kind} does not exist")
                continue
            try:
                pem = bundle_from_object(reference, msgspec.to_builtins(found))
            except CaSourceError as exc:
                self._refuse(reference, str(exc))
                continue
            self._accept(reference, pem)

    def _accept(self, reference: CaReference, pem: bytes) -> None:
        if self.trust.accept(reference, pem):
            self._on_update(reference, "changed", describe_bundle(pem))
        else:
            self._on_update(reference, "unchanged", "")

    def _refuse(self, reference: CaReference, reason: str) -> None:
        self.trust.refuse(reference, reason)
        self._on_update(reference, "refused", reason)

    def read_files(self) -> None:
        """Read every file reference whose content changed (or that was never read)."""
        for reference in [r for r in self._references if r.source == "file"]:
            path = Path(reference.path)
            where = reference.describe()
            try:
                with path.open("rb") as f:
                    data = f.read(MAX_FILE_BYTES + 1)
            except OSError as exc:
                self._files_read.add(reference.path)
                if self._file_digests.get(reference.path) != "unreadable":
                    self._file_digests[reference.path] = "unreadable"
                    self._refuse(reference, f"{where}: cannot read: {exc.strerror or exc}")
                continue
            self._files_read.add(reference.path)
            digest = hashlib.sha256(data).hexdigest()
            if self._file_digests.get(reference.path) == digest:
                continue
            self._file_digests[reference.path] = digest
            if len(data) > MAX_FILE_BYTES:
                self._refuse(reference, f"{where}: larger than {MAX_FILE_BYTES} bytes")
                continue
            try:
                self._accept(reference, usable_bundle(data, where))
            except CaSourceError as exc:
                self._refuse(reference, str(exc))

    # --- the task -----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the watches and the file reads until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._start_pending()
            self.read_files()
            task_status.started()
            while True:
                with trio.move_on_after(self._file_interval):
                    await self._wake_files.wait()
                self._wake_files = trio.Event()
                self.read_files()
