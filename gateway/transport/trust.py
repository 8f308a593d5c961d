"""The CA bundles backends are trusted with when their configuration names where the CA is kept.

A backend whose ``clientConfig`` has a ``ca_from`` (the ``caFrom`` of the backend-policy annotation,
``gateway.config.trust``) is verified against the bundle this store holds for that reference, not
against its static ``caBundle``. The store is filled and kept fresh by the source that reads and
watches the referenced objects and files (``gateway.sources.ca``); ``Targets`` (``resolve``) reads
it when it builds a target, and ``BackendCaller`` rebuilds the targets of a reference when the
store says it changed.

Rules, each the answer to "what if the owner writes something we cannot use":

- **last good value**: ``refuse`` (a missing key, no certificate, a deleted object) keeps the bundle
  in force and only records why, for the next message; only ``accept`` of a *usable* bundle replaces
  it (the source checks usability before accepting);
- **never the system roots by accident**: a reference never read successfully has no bundle, and a
  call to its backend fails with ``ClientConfigError`` naming the reference and the reason, instead
  of silently trusting the machine's roots;
- **atomic swap**: a change is one assignment on the event loop; every target built after it uses the
  new bundle, none uses half of it.

Pure state, no I/O; listeners run synchronously on the event loop and must not block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gateway.config.trust import CaReference
from gateway.errors import ClientConfigError

Listener = Callable[[CaReference], None]


class TrustStore:
    """The bundle in force for each CA reference, and why the latest value was refused."""

    def __init__(self) -> None:
        self._bundles: dict[CaReference, bytes] = {}
        self._problems: dict[CaReference, str] = {}
        self._listeners: list[Listener] = []

    def __repr__(self) -> str:
        return f"<TrustStore {len(self._bundles)} bundles, {len(self._problems)} problems>"

    def subscribe(self, listener: Listener) -> None:
        """``listener(reference)`` after the bundle of ``reference`` changed (or was forgotten)."""
        self._listeners.append(listener)

    def bundle(self, reference: CaReference) -> bytes:
        """The bundle in force for ``reference``; ``ClientConfigError`` if there never was one."""
        found = self._bundles.get(reference)
        if found is not None:
            return found
        problem = self._problems.get(reference, "not read yet")
        raise ClientConfigError(f"no CA bundle from {reference.describe()}: {problem}")

    def current(self, reference: CaReference) -> bytes | None:
        return self._bundles.get(reference)

    def problem(self, reference: CaReference) -> str:
        """Why the latest value of ``reference`` was refused ("" when it was accepted)."""
        return self._problems.get(reference, "")

    def accept(self, reference: CaReference, pem: bytes) -> bool:
        """Put ``pem`` (a bundle checked usable) in force; True when that changed anything."""
        self._problems.pop(reference, None)
        if self._bundles.get(reference) == pem:
            return False
        self._bundles[reference] = pem
        self._notify(reference)
        return True

    def refuse(self, reference: CaReference, reason: str) -> None:
        """The latest value of ``reference`` cannot be used: keep the bundle in force, note why."""
        self._problems[reference] = reason

    def retain(self, references: Iterable[CaReference]) -> None:
        """Forget every reference not in ``references`` (no longer configured)."""
        keep = set(references)
        for reference in [r for r in self._bundles if r not in keep]:
            del self._bundles[reference]
            self._notify(reference)
        for reference in [r for r in self._problems if r not in keep]:
            del self._problems[reference]

    def bundles(self) -> dict[CaReference, bytes]:
        return dict(self._bundles)

    def _notify(self, reference: CaReference) -> None:
        for listener in self._listeners:
            listener(reference)
