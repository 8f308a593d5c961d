"""The opt-in conversion cache: converted objects keyed by the exact bytes they were converted from.

Conversion webhooks are expected to be deterministic, and caching is the lever when
conversion becomes a bottleneck. A CRD opts in with the annotation
``webhook-gateway.io/conversion-cache: "true"``. The key is (CRD name, the entry's cache identity,
desired apiVersion, SHA-256 of the input object's exact bytes): never uid + resourceVersion, because
an update converts new content under the old resourceVersion. The identity changes with the CRD's
conversion entry and its ``webhook-gateway.io/conversion-cache-generation`` annotation, so after any
such change older conversions can never be served; they are also dropped at once to free memory.

Bounded three ways: a TTL, a maximum number of entries and a maximum number of bytes (least recently
used first). Pure: time comes from the ``clock`` given; one instance lives in the composition root.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from gateway.config.model import ConversionEntry

Key = tuple[str, str, str, bytes]
ENTRY_OVERHEAD_BYTES: Final = 160  # key, tuple and bookkeeping per entry, roughly


@dataclass(frozen=True, slots=True)
class CacheSettings:
    ttl_seconds: float = 300.0
    max_entries: int = 10_000
    max_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _Cached:
    value: bytes
    expires: float
    size: int


class ConversionCache:
    """Least-recently-used converted objects with a TTL; not thread-safe (the trio thread only)."""

    def __init__(self, settings: CacheSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self._clock = clock
        self._entries: OrderedDict[Key, _Cached] = OrderedDict()
        self._by_crd: dict[str, set[Key]] = {}
        self._identity: dict[str, str] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(entry: ConversionEntry, desired_api_version: str, obj: bytes) -> Key:
        return (entry.crd_name, entry.cache_identity, desired_api_version, hashlib.sha256(obj).digest())

    def _drop(self, key: Key) -> None:
        cached = self._entries.pop(key)
        self.bytes -= cached.size
        keys = self._by_crd.get(key[0])
        if keys is not None:
            keys.discard(key)

    def sync(self, entry: ConversionEntry) -> int:
        """Drop the CRD's entries if its conversion entry changed since they were stored; how many."""
        known = self._identity.get(entry.crd_name)
        if known == entry.cache_identity:
            return 0
        self._identity[entry.crd_name] = entry.cache_identity
        stale = list(self._by_crd.pop(entry.crd_name, ()))
        for key in stale:
            if key in self._entries:
                self._drop(key)
        return len(stale)

    def get_many(
        self, entry: ConversionEntry, desired_api_version: str, objects: Sequence[bytes]
    ) -> tuple[list[bytes | None], int]:
        """The cached conversion of each object (None for a miss) and how many expired entries went."""
        now = self._clock()
        found: list[bytes | None] = []
        expired = 0
        for obj in objects:
            key = self.key(entry, desired_api_version, obj)
            cached = self._entries.get(key)
            if cached is not None and cached.expires <= now:
                self._drop(key)
                expired += 1
                cached = None
            if cached is None:
                found.append(None)
                continue
            self._entries.move_to_end(key)
            found.append(cached.value)
        return found, expired

    def put_many(
        self, entry: ConversionEntry, desired_api_version: str, pairs: Sequence[tuple[bytes, bytes]]
    ) -> int:
        """Store (input, converted) pairs; returns how many entries were evicted to stay in bounds."""
        s = self.settings
        expires = self._clock() + s.ttl_seconds
        evicted = 0
        for obj, converted in pairs:
            size = len(converted) + ENTRY_OVERHEAD_BYTES
            if size > s.max_bytes or s.max_entries <= 0:
                continue
            key = self.key(entry, desired_api_version, obj)
            if key in self._entries:
                self._drop(key)
            self._entries[key] = _Cached(converted, expires, size)
            self._by_crd.setdefault(key[0], set()).add(key)
            self.bytes += size
            while len(self._entries) > s.max_entries or self.bytes > s.max_bytes:
                oldest = next(iter(self._entries))
                self._drop(oldest)
                evicted += 1
        return evicted
