"""One state per backend across workers (``--workers N``): circuits, calls in flight and endpoint
ejections in shared memory.

Each worker is a whole gateway with its own circuit breakers (``gateway.resilience``) and endpoint
pickers (``gateway.transport.endpoints``). Their *state* must be one per backend, as Envoy keeps
circuit-breaker and outlier-ejection state per cluster for all its worker threads: otherwise a
backend that times out needs up to N × ``consecutiveFailures`` failures before every worker stops
waiting for it. The machines keep their state in cells (``gateway.resilience.cells``); this module
gives them cells whose words live in a table that every worker maps.

Why shared memory and not the supervisor: the breaker reads its state before every call, so the
truth must be readable at call time without a message round trip. A table in memory is read in
well under a microsecond (``benchmarks/bench_shared_state.py``), and a write is visible to the very
next read in every worker: there is no propagation delay to bound beyond the write itself. Through
the supervisor each worker would act on a copy until the supervisor's message arrives.

A table is a file in the supervisor's run directory (memory-backed ``/dev/shm`` where available),
created by the first worker that needs it and mapped by all:

    header (64 bytes): magic, record size, payload size, capacity, holder bytes, used, refused
    ``capacity`` records:
        0   seq      u64  even when the record is whole; odd while a write is in progress
        8   crc      u32  CRC-32 of seq and of bytes 12..end
        12  flags    u32  0 empty, 1 used, 2 deleted (a tombstone that keeps probe chains whole)
        16  tag      16 B BLAKE2b digest of the key (the backend or the endpoint)
        32  holders  one bit per worker that uses the record
        ..  payload  the word, packed by the table's ``Codec``

Reading (the hot path): an 8-byte load of ``seq``; unchanged since this worker's last read → the
word it decoded then. Otherwise the record is copied and accepted only with an even ``seq`` and a
matching CRC: a copy that mixes two writes is rejected whatever order the CPU made the loads and
stores visible in (x86-64 and arm64 alike), and re-read; after three attempts the reader waits for
the lock. Readers never see a torn word.

Writing: under an exclusive ``flock`` of the table file, held for the few microseconds of a pure
change (no I/O, no await). Writes happen only when state changes: a call error, a transition, the
first answer after errors; a healthy backend's calls only read. The kernel releases the lock of a
worker that dies; a record it left half-written (``seq`` odd) is repaired by the next one to lock
it: the key keeps its record, its state starts again (closed, no failures).

Counters (a bulkhead's calls in flight, ``SharedCounters``) change on every call, so they are not
words behind the lock: a record's payload is one signed 32-bit column per worker, each written only
by its worker with one aligned store, and read all together (the CRC covers the record's other
bytes only). Two workers checking the sum at the same instant may both pass a limit by one.

Bounds: the capacity is fixed when the table is created, from the configuration the first worker
loaded (``circuit_slots``, ``endpoint_slots``). A key that finds no free record keeps a cell of its
own in that worker, as without sharing: logged, and counted in
``webhook_gateway_shared_state_refused_total``. Records are reclaimed when the last worker using a
key releases it (a reload that removes a backend, an endpoint gone from its slices); a worker that
starts clears the marks its predecessor in the same slot left, and picks up the state of the keys
it attaches.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Generic, Protocol, TypeVar

import structlog

from gateway.config.model import Snapshot
from gateway.resilience.breaker import CLOSED_WORD, CircuitState, CircuitWord
from gateway.resilience.cells import StateKey
from gateway.transport.endpoints import HEALTHY, EjectionWord

log = structlog.get_logger("gateway.shared_state")

W = TypeVar("W")
R = TypeVar("R")
T = TypeVar("T")

MAGIC: Final = b"WGSTATE1"
_HEADER: Final = struct.Struct("<8sIIIIQQ")  # magic, record, payload, capacity, holder bytes, used, refused
HEADER_SIZE: Final = 64
_USED_AT: Final = 24
_REFUSED_AT: Final = 32
_U64: Final = struct.Struct("<Q")
_U32: Final = struct.Struct("<I")
_I32: Final = struct.Struct("<i")
_seq_at: Final = _U64.unpack_from  # the hot path's one load
EMPTY, USED, DELETED = 0, 1, 2
_TAG_AT: Final = 16
_HOLDERS_AT: Final = 32
READ_ATTEMPTS: Final = 3

MIN_CIRCUIT_SLOTS: Final = 256
MIN_ENDPOINT_SLOTS: Final = 1024
ERROR_BYTES: Final = 256  # the last error's text in a circuit record (UTF-8, cut at a character)


def circuit_slots(snapshot: Snapshot) -> int:
    """Room for every backend of the configuration four times over (reloads add), at least 256."""
    return max(MIN_CIRCUIT_SLOTS, 4 * (len(snapshot.validating) + len(snapshot.mutating)))


def endpoint_slots(snapshot: Snapshot) -> int:
    """64 endpoints per referenced service (replicas, doubled during a rollout), at least 1024."""
    services = {
        (s.namespace, s.name, s.port)
        for hook in (*snapshot.validating, *snapshot.mutating)
        if (s := hook.client_config.service) is not None
    }
    return max(MIN_ENDPOINT_SLOTS, 64 * len(services))


class SharedStateError(Exception):
    """A table file that cannot be used (another layout, too small)."""


# --- codecs: a word <-> its fixed-size payload ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Codec(Generic[W]):
    name: str  # the table's name (file name, metric label)
    size: int
    initial: W  # the word of a new key
    pack: Callable[[W], bytes]
    unpack: Callable[[bytes], W]


_CIRCUIT: Final = struct.Struct(f"<BQIddH{ERROR_BYTES}s")


def _pack_circuit(word: CircuitWord) -> bytes:
    error = word.last_error.encode("utf-8")
    if len(error) > ERROR_BYTES:
        error = error[:ERROR_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return _CIRCUIT.pack(
        int(word.state), word.epoch, min(word.failures, 0xFFFFFFFF), word.opened_at, word.probe_until,
        len(error), error,
    )  # fmt: skip


def _unpack_circuit(data: bytes) -> CircuitWord:
    state, epoch, failures, opened_at, probe_until, length, error = _CIRCUIT.unpack(data)
    return CircuitWord(
        CircuitState(state),
        epoch,
        failures,
        opened_at,
        probe_until,
        error[:length].decode("utf-8", "replace"),
    )


CIRCUITS: Final = Codec("circuits", _CIRCUIT.size, CLOSED_WORD, _pack_circuit, _unpack_circuit)

_EJECTION: Final = struct.Struct("<IId")


def _pack_ejection(word: EjectionWord) -> bytes:
    return _EJECTION.pack(
        min(word.connect_failures, 0xFFFFFFFF), min(word.ejections, 0xFFFFFFFF), word.ejected_until
    )


def _unpack_ejection(data: bytes) -> EjectionWord:
    return EjectionWord(*_EJECTION.unpack(data))


EJECTIONS: Final = Codec("endpoints", _EJECTION.size, HEALTHY, _pack_ejection, _unpack_ejection)


def tag_of(key: StateKey) -> bytes:
    """16 bytes naming ``key`` in a table (the same in every worker: repr of str/int tuples)."""
    return hashlib.blake2b(repr(key).encode("utf-8"), digest_size=16).digest()


# --- the table ---------------------------------------------------------------------------------------


class SharedCell(Generic[W]):
    """The cell of one key in a ``SharedTable`` (``gateway.resilience.cells.Cell``): a word behind a
    sequence number and a CRC, written under the table's lock."""

    __slots__ = ("_map", "_offset", "_seq", "_table", "_word", "tag")

    def __init__(self, table: SharedTable[W], offset: int, tag: bytes) -> None:
        self._table: SharedTable[W] | None = table
        self._map: mmap.mmap | bytearray = table.map
        self._offset = offset
        self.tag = tag
        self._seq = -1  # never a record's: the first read decodes
        self._word: W = table.codec.initial

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def attached(self) -> bool:
        return self._table is not None

    @property
    def seq(self) -> int:
        return self._seq

    def read(self) -> W:
        if _seq_at(self._map, self._offset)[0] == self._seq:
            return self._word  # nothing written since this worker last decoded it
        return self._refresh()

    def update(self, change: Callable[[W], tuple[W, R]]) -> R:
        table = self._table
        if table is None:  # released: what is left of a call in flight settles here, harmlessly
            self._word, result = change(self._word)
            return result
        with table.locked():
            word = table.load_locked(self)
            if self._table is None:
                self._word, result = change(self._word)
                return result
            new, result = change(word)
            if new is not word:
                table.write_payload(self, new)
            return result

    def _refresh(self) -> W:
        table = self._table
        if table is None:
            return self._word
        for _ in range(READ_ATTEMPTS):
            word = table.try_load(self)
            if word is not None:
                return word
            if _seq_at(self._map, self._offset)[0] == self._seq + 1:
                return self._word  # a write began after the last one this worker read: that is current
        with table.locked():  # a writer is at work (or died at it): wait for it, or repair
            return table.load_locked(self)

    def loaded(self, seq: int, word: W) -> W:
        self._seq = seq
        self._word = word
        return word

    def detach(self) -> None:
        """Stop reading the table: the word read last stays this cell's, in this process only."""
        self._table = None
        self._map = bytearray(_U64.pack(self._seq if self._seq >= 0 else 0))
        self._offset = 0
        self._seq = _seq_at(self._map, 0)[0]


class SharedCounter:
    """The ``Counter`` of one key in a ``SharedCounters`` table (``gateway.resilience.cells``).

    One signed 32-bit column per worker: a worker writes only its own (no lock: one aligned
    store, and nobody else writes it), and ``total`` sums the columns of all workers.
    """

    __slots__ = ("_all", "_at", "_map", "_mine", "_own", "offset", "tag")

    def __init__(self, table: SharedCounters, offset: int, tag: bytes) -> None:
        self._map: mmap.mmap | bytearray = table.map
        self._all = table.columns.unpack_from
        self._at = offset + table.payload_at
        self._mine = self._at + 4 * table.worker
        self._own = 0  # this worker's column (zeroed when it joined or released the key)
        self.offset = offset
        self.tag = tag

    def total(self) -> int:
        return sum(self._all(self._map, self._at))

    def add(self, delta: int) -> None:
        self._own += delta
        _I32.pack_into(self._map, self._mine, self._own)

    def detach(self) -> None:
        """Stop counting in the table: this worker's own count goes on in a private buffer."""
        mine = self._mine - self._at
        self._map = bytearray(mine + 4)
        self._at = 0
        self._mine = mine
        self._all = struct.Struct(f"<{mine // 4 + 1}i").unpack_from
        _I32.pack_into(self._map, mine, self._own)


class _Attached(Protocol):
    @property
    def offset(self) -> int: ...

    @property
    def tag(self) -> bytes: ...

    def detach(self) -> None: ...


C = TypeVar("C", bound=_Attached)


class _Records(Generic[C]):
    """Fixed-size records by key in a file every worker maps: claiming, holders, reclaiming, repair
    (see the module docstring). ``whole``: the payload is written under the lock and covered by the
    CRC (words); otherwise each worker writes its own part of it without the lock (counters)."""

    def __init__(
        self,
        path: Path,
        name: str,
        payload_size: int,
        *,
        whole: bool,
        capacity: int,
        workers: int,
        worker: int,
    ) -> None:
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} of {workers}")
        self.path = path
        self.name = name
        self.worker = worker
        self.workers = workers
        self.payload_size = payload_size
        self.holder_bytes = max(8, -(-workers // 64) * 8)
        self.payload_at = _HOLDERS_AT + self.holder_bytes
        self.record_size = -(-(self.payload_at + payload_size) // 8) * 8
        self._checked_end = self.record_size if whole else self.payload_at
        self._whole = whole
        self._fd = _open_or_create(path, self._header(capacity), HEADER_SIZE + capacity * self.record_size)
        try:
            self.capacity = self._check_header()
            self.map = mmap.mmap(self._fd, HEADER_SIZE + self.capacity * self.record_size)
        except BaseException:
            os.close(self._fd)
            raise
        self._held: dict[bytes, C] = {}
        self._join()

    def _header(self, capacity: int) -> bytes:
        return _HEADER.pack(MAGIC, self.record_size, self.payload_size, capacity, self.holder_bytes, 0, 0)

    def _check_header(self) -> int:
        magic, record, payload, capacity, holders, _, _ = _HEADER.unpack(os.pread(self._fd, _HEADER.size, 0))
        expected = (MAGIC, self.record_size, self.payload_size, self.holder_bytes)
        if (magic, record, payload, holders) != expected or capacity < 1:
            raise SharedStateError(
                f"{self.path}: another layout ({magic!r}, record {record}, payload {payload})"
            )
        if os.fstat(self._fd).st_size < HEADER_SIZE + capacity * record:
            raise SharedStateError(f"{self.path}: shorter than its {capacity} records")
        return int(capacity)

    def close(self) -> None:
        for cell in self._held.values():
            cell.detach()
        self._held.clear()
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self._fd)

    # --- what a new record holds, what a worker's part of one is (overridden) ---

    def _initial_payload(self) -> bytes:
        return bytes(self.payload_size)

    def _new_cell(self, offset: int, tag: bytes) -> C:
        raise NotImplementedError

    def _leave(self, offset: int) -> None:
        """This worker no longer uses the record at ``offset`` (released, or its predecessor's)."""

    # --- counters (read without the lock: a scrape may be one write behind) ---

    @property
    def used(self) -> int:
        return int(_seq_at(self.map, _USED_AT)[0])

    @property
    def refused(self) -> int:
        return int(_seq_at(self.map, _REFUSED_AT)[0])

    # --- the store protocol ---

    def attach(self, key: StateKey) -> C | None:
        tag = tag_of(key)
        cell = self._held.get(tag)
        if cell is not None:
            return cell
        with self.locked():
            offset = self._find_or_claim(tag)
        if offset is None:
            log.warning(
                "shared state table full; this key keeps a state of its own in this worker",
                table=self.name, capacity=self.capacity, key=list(key),
            )  # fmt: skip
            return None
        cell = self._held[tag] = self._new_cell(offset, tag)
        return cell

    def release(self, key: StateKey) -> None:
        cell = self._held.pop(tag_of(key), None)
        if cell is None:
            return
        offset = cell.offset
        cell.detach()  # first: what is left of its calls in flight settles in this process only
        with self.locked():
            self._repair_if_torn(offset)
            if self._flags(offset) == USED and self.map[offset + _TAG_AT : offset + _HOLDERS_AT] == cell.tag:
                self._leave(offset)
                holders = self._holders(offset) & ~(1 << self.worker)
                if holders:
                    self._write(offset, holders=holders)
                else:
                    self._delete(offset)

    # --- under the lock ---

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _write(
        self,
        offset: int,
        *,
        flags: int | None = None,
        tag: bytes | None = None,
        holders: int | None = None,
        payload: bytes | None = None,
    ) -> int:
        """Rewrite parts of a record as one write readers see whole or not at all; its new seq."""
        m = self.map
        seq = _seq_at(m, offset)[0]
        writing = seq + 1 if seq % 2 == 0 else seq  # odd: readers retry until the end
        _U64.pack_into(m, offset, writing)
        if tag is not None:
            m[offset + _TAG_AT : offset + _HOLDERS_AT] = tag
        if holders is not None:
            m[offset + _HOLDERS_AT : offset + self.payload_at] = holders.to_bytes(self.holder_bytes, "little")
        if payload is not None:
            m[offset + self.payload_at : offset + self.payload_at + len(payload)] = payload
        if flags is not None:  # last: a claim cut short leaves a record that is still not in use
            _U32.pack_into(m, offset + 12, flags)
        done = writing + 1
        crc = zlib.crc32(m[offset + 12 : offset + self._checked_end], zlib.crc32(_U64.pack(done)))
        _U32.pack_into(m, offset + 8, crc)
        _U64.pack_into(m, offset, done)
        return int(done)

    def _whole_at(self, offset: int) -> bool:
        raw = self.map[offset : offset + self._checked_end]
        seq = int.from_bytes(raw[:8], "little")
        return seq % 2 == 0 and zlib.crc32(raw[12:], zlib.crc32(raw[:8])) == int.from_bytes(
            raw[8:12], "little"
        )

    def _repair_if_torn(self, offset: int) -> None:
        """A record whose writer died mid-write (we hold the lock, so nobody is writing it now)."""
        if self._whole_at(offset):
            return
        if not any(self.map[offset : offset + self.record_size]):
            return  # never written
        log.warning("repairing a shared state record left half-written", table=self.name)
        self._write(offset, payload=self._initial_payload() if self._whole else None)

    def _offset(self, index: int) -> int:
        return HEADER_SIZE + index * self.record_size

    def _flags(self, offset: int) -> int:
        return int(_U32.unpack_from(self.map, offset + 12)[0])

    def _holders(self, offset: int) -> int:
        return int.from_bytes(self.map[offset + _HOLDERS_AT : offset + self.payload_at], "little")

    def _count(self, at: int, delta: int) -> None:
        _U64.pack_into(self.map, at, _seq_at(self.map, at)[0] + delta)

    def _find_or_claim(self, tag: bytes) -> int | None:
        """Linear probing from the tag's home: its record, else a free one claimed for it."""
        capacity = self.capacity
        home = int.from_bytes(tag[:8], "little") % capacity
        free = None
        mine = 1 << self.worker
        for step in range(capacity):
            offset = self._offset((home + step) % capacity)
            self._repair_if_torn(offset)
            flags = self._flags(offset)
            if flags == USED:
                if self.map[offset + _TAG_AT : offset + _HOLDERS_AT] == tag:
                    holders = self._holders(offset)
                    if not holders & mine:
                        self._write(offset, holders=holders | mine)
                    return offset
            elif flags == DELETED:
                free = offset if free is None else free
            else:
                free = offset if free is None else free
                break  # an empty record ends every probe chain: the key is not in the table
        if free is None:
            self._count(_REFUSED_AT, 1)
            return None
        self._write(free, tag=tag, holders=mine, payload=self._initial_payload(), flags=USED)
        self._count(_USED_AT, 1)
        return free

    def _delete(self, offset: int) -> None:
        self._write(offset, tag=bytes(16), holders=0, payload=bytes(self.payload_size), flags=DELETED)
        self._count(_USED_AT, -1)
        # Tombstones followed by an empty record end no probe chain any more: empty them.
        capacity = self.capacity
        index = (offset - HEADER_SIZE) // self.record_size
        if self._flags(self._offset((index + 1) % capacity)) != EMPTY:
            return
        for _ in range(capacity):
            here = self._offset(index)
            if self._flags(here) != DELETED:
                break
            self._write(here, flags=EMPTY)
            index = (index - 1) % capacity

    def _join(self) -> None:
        """Clear the marks this worker slot's predecessor left (it died without releasing)."""
        mine = 1 << self.worker
        with self.locked():
            for index in range(self.capacity):
                offset = self._offset(index)
                if self._flags(offset) != USED:
                    continue
                self._repair_if_torn(offset)
                self._leave(offset)
                holders = self._holders(offset)
                if holders & mine:
                    if holders & ~mine:
                        self._write(offset, holders=holders & ~mine)
                    else:
                        self._delete(offset)


class SharedTable(_Records[SharedCell[W]]):
    """Words by key (``CellStore``): circuits, endpoint ejections."""

    def __init__(self, path: Path, codec: Codec[W], *, capacity: int, workers: int, worker: int) -> None:
        self.codec = codec
        super().__init__(
            path, codec.name, codec.size, whole=True, capacity=capacity, workers=workers, worker=worker
        )

    def _initial_payload(self) -> bytes:
        return self.codec.pack(self.codec.initial)

    def _new_cell(self, offset: int, tag: bytes) -> SharedCell[W]:
        return SharedCell(self, offset, tag)

    def try_load(self, cell: SharedCell[W]) -> W | None:
        """The cell's word from an unlocked copy of its record; None if the copy is not whole."""
        offset = cell.offset
        raw = self.map[offset : offset + self.record_size]
        seq = int.from_bytes(raw[:8], "little")
        if seq & 1 or zlib.crc32(raw[12:], zlib.crc32(raw[:8])) != int.from_bytes(raw[8:12], "little"):
            return None
        return self._decode(cell, seq, raw)

    def load_locked(self, cell: SharedCell[W]) -> W:
        offset = cell.offset
        if _seq_at(self.map, offset)[0] == cell.seq:
            return cell.read()  # nothing written since this worker decoded it (and nobody writes now)
        self._repair_if_torn(offset)
        raw = self.map[offset : offset + self.record_size]
        return self._decode(cell, int.from_bytes(raw[:8], "little"), raw)

    def _decode(self, cell: SharedCell[W], seq: int, raw: bytes) -> W:
        if int.from_bytes(raw[12:16], "little") != USED or raw[_TAG_AT:_HOLDERS_AT] != cell.tag:
            cell.detach()  # the record was reclaimed (this worker released the key meanwhile)
            return cell.read()
        word = self.codec.unpack(raw[self.payload_at : self.payload_at + self.codec.size])
        return cell.loaded(seq, word)

    def write_payload(self, cell: SharedCell[W], word: W) -> None:
        seq = self._write(cell.offset, payload=self.codec.pack(word))
        cell.loaded(seq, word)


class SharedCounters(_Records[SharedCounter]):
    """Counters by key (``CounterStore``): the bulkheads' calls in flight, one column per worker."""

    def __init__(self, path: Path, *, capacity: int, workers: int, worker: int) -> None:
        self.columns = struct.Struct(f"<{workers}i")
        super().__init__(
            path,
            "in_flight",
            self.columns.size,
            whole=False,
            capacity=capacity,
            workers=workers,
            worker=worker,
        )

    def _new_cell(self, offset: int, tag: bytes) -> SharedCounter:
        return SharedCounter(self, offset, tag)

    def _leave(self, offset: int) -> None:
        # Its calls in flight are no longer this worker's to count here: those of a dead
        # predecessor died with it; those of a released key settle in the detached counter.
        _I32.pack_into(self.map, offset + self.payload_at + 4 * self.worker, 0)


def _open_or_create(path: Path, header: bytes, size: int) -> int:
    """The table file's descriptor; the first worker creates it whole, then links it into place."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # the memory is reserved now: no SIGBUS on a full /dev/shm
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it
                    raise
                os.ftruncate(fd, size)
            os.pwrite(fd, header.ljust(HEADER_SIZE, b"\0"), 0)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # another worker was first: use its table
        finally:
            os.close(fd)
            os.unlink(tmp)
    return os.open(path, os.O_RDWR)


# --- what a worker gives its gateway ---------------------------------------------------------------


class SharedBackendState:
    """The shared tables of one supervisor's workers; a worker hands this to ``serve``.

    ``clock`` is CLOCK_MONOTONIC, the same in every process of the host (trio's clock is not: it
    starts at a random offset in each run).
    """

    clock: Final = staticmethod(time.monotonic)

    def __init__(self, directory: Path, workers: int, worker: int) -> None:
        self.directory = directory
        self.workers = workers
        self.worker = worker
        self.tables: dict[str, _Records[Any]] = {}

    def circuits(self, snapshot: Snapshot) -> SharedTable[CircuitWord] | None:
        return self._open(
            CIRCUITS.name, lambda path, **size: SharedTable(path, CIRCUITS, **size), circuit_slots(snapshot)
        )

    def ejections(self, snapshot: Snapshot) -> SharedTable[EjectionWord] | None:
        return self._open(
            EJECTIONS.name,
            lambda path, **size: SharedTable(path, EJECTIONS, **size),
            endpoint_slots(snapshot),
        )

    def in_flight(self, snapshot: Snapshot) -> SharedCounters | None:
        return self._open("in_flight", SharedCounters, circuit_slots(snapshot))

    def _open(self, name: str, make: Callable[..., T], capacity: int) -> T | None:
        found = self.tables.get(name)
        if found is not None:
            return found  # type: ignore[return-value]
        try:
            table = make(
                self.directory / f"{name}.state", capacity=capacity, workers=self.workers, worker=self.worker
            )
        except (OSError, SharedStateError) as exc:
            log.warning("shared state unavailable; each worker keeps its own", table=name, error=str(exc))
            return None
        self.tables[name] = table  # type: ignore[assignment]
        return table

    def close(self) -> None:
        for table in self.tables.values():
            table.close()
        self.tables.clear()
