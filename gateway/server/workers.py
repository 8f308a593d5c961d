"""``--workers N``: N gateway processes on one listening socket, and the supervisor that keeps them.

Why processes: one trio gateway uses one core. With N > 1 the command-line process becomes a small
supervisor: it binds the listening socket(s) once and starts N workers, each a complete gateway
(``server.serve.serve``) that accepts on the *inherited* socket (hypercorn's ``fd://`` bind).

An inherited socket rather than SO_REUSEPORT, because

- the supervisor keeps the socket open, so connections waiting in the accept queue survive a
  worker's death (with SO_REUSEPORT each worker has its own queue, and a worker killed with
  connections in it resets them);
- an idle worker takes the next connection from the shared queue, whereas SO_REUSEPORT spreads
  connections by a hash of their addresses whatever each worker's load: kube-apiserver keeps a few
  long-lived connections, which a hash can put on the same worker;
- ``--bind HOST:0`` and bind errors are handled once, and no other process can join the port.

What the supervisor guarantees:

- A worker that dies is restarted after a back-off (reset once a worker has run for a while) and
  counted (``webhook_gateway_worker_restarts_total``). A worker that exits before all workers were
  ever ready makes the supervisor stop with its exit code (2: configuration refused), as one
  process would.
- SIGTERM/SIGINT go to every worker; each drains as a single gateway does (``/readyz`` 503 for
  ``--drain-seconds``, then in-flight reviews finish). Workers still running after
  ``--drain-seconds`` + ``--shutdown-timeout`` + a margin are killed.
- Reloads: every worker watches the configuration directory, the serving certificate and the
  backend credentials itself (the same polling watchers as one process), so every reload reaches
  every worker. A worker that is restarted loads the files as they are then.
- Readiness: each worker publishes its own readiness in one byte of a shared memory map; ``/readyz``
  on any worker answers 200 only when every byte is set, so a probe gets the same answer from
  whichever worker accepted it. Reviews do not wait for the other workers (a worker is ready to
  review on its own, MAT-33).
- Metrics: every worker keeps its plain in-memory metrics (the hot path is unchanged) and writes a
  binary snapshot of them to the run directory every ``DUMP_SECONDS``; ``/metrics`` on any worker
  sums its live metrics with the other workers' snapshots (counters and histograms add up, gauges
  per family, see ``GAUGE_MERGE``). A restarted worker starts its counters from its predecessor's
  last snapshot, so totals never go backwards; what the killed worker counted after its last
  snapshot is lost. docs/performance.md compares this with prometheus_client's multiprocess mode.
- Per-backend state: circuit breakers, bulkheads' calls in flight and endpoint ejections live in
  tables every worker maps (``gateway.server.shared_state``): one state per backend, read at
  every call, so a circuit opened by one worker is open in all from the next call on;
  ``/metrics`` shows the circuit states read from the same table.
- Cluster namespace watch: each worker runs its own list+watch (see docs/performance.md for
  the request counts that justify it).
- A worker whose supervisor disappears (killed with SIGKILL) drains and exits by itself.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec
import structlog
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from gateway.errors import ConfigError, GatewayError, ListenError, startup_failure
from gateway.observability import Metrics, Observability
from gateway.observability.metrics import PREFIX, HistogramChild
from gateway.server.cgroup import cpu_quota
from gateway.server.limits import raise_nofile_limit
from gateway.settings import ServeSettings
from gateway.sources.reflector import Backoff

if TYPE_CHECKING:
    from gateway.server.app import Readiness
    from gateway.server.shared_state import SharedBackendState

log = structlog.get_logger("gateway.workers")

SPEC_ENV: Final = "WEBHOOK_GATEWAY_INTERNAL_WORKER"  # how a worker receives its assignment
DUMP_SECONDS: Final = 0.5  # how stale another worker's share of /metrics can be
READY_POLL_SECONDS: Final = 0.1
PARENT_POLL_SECONDS: Final = 1.0
STABLE_SECONDS: Final = 10.0  # a worker that ran this long starts a new back-off sequence
KILL_MARGIN_SECONDS: Final = 5.0
EXIT_CONFIG_REFUSED: Final = 2
_WORKER_ENTRY: Final = "import sys; from gateway.server.workers import worker_main; sys.exit(worker_main())"

# Gauges of several workers are combined per family: in-flight reviews and open connections add
# up. Each worker numbers its configuration generations itself (a restarted worker starts again at
# 1), so the merged generation and backend counts are the highest any worker reports; the last
# reload counts as successful only if it was on every worker.
# A circuit's state is not added up: every worker reads the same shared state, and the scraping
# worker's live reading replaces the snapshots (``_circuit_states``); the snapshots only speak for a
# circuit that is not shared (the table was full), and then only when every worker agrees.


def _agreed(values: Sequence[float]) -> float | None:
    return values[0] if all(v == values[0] for v in values) else None


GAUGE_MERGE: Final[Mapping[str, Callable[[Sequence[float]], float | None]]] = {
    PREFIX + "reviews_in_flight": sum,
    PREFIX + "backends": max,
    PREFIX + "config_generation": max,
    PREFIX + "config_last_reload_successful": min,
    # expiry timestamps: every worker reports the same certificates; the earliest is the one that matters
    PREFIX + "serving_certificate_expiry_timestamp_seconds": min,
    PREFIX + "backend_ca_expiry_timestamp_seconds": min,
    PREFIX + "backend_certificate_expiry_timestamp_seconds": min,
    PREFIX + "backend_circuit_state": _agreed,
}
# Gauges that describe a live process: a dead worker's last values are dropped, not kept.
LIVE_GAUGES: Final = frozenset({PREFIX + "reviews_in_flight"})


# --- how many ------------------------------------------------------------------------------------


def available_cpus(
    *,
    affinity: int | None = None,
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> int:
    """The CPUs this process may use: its affinity mask, capped by a cgroup v2 or v1 CPU quota.

    A container limited to ``cpu: 1500m`` sees every host CPU in its affinity mask but gets 1.5 CPUs
    of time: the quota is rounded up (2), as a partial CPU still adds capacity.
    """
    cpus = affinity if affinity is not None else len(os.sched_getaffinity(0))
    quota = cpu_quota(proc_cgroup=proc_cgroup, cgroup_root=cgroup_root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def worker_count(options: ServeSettings) -> int:
    """``--workers``, or one per available CPU when it is not given (or 0)."""
    wanted = options.workers
    if wanted is not None and wanted < 0:
        raise SystemExit(f"--workers: {wanted} is not a number of processes (0: one per CPU)")
    return int(wanted) if wanted else available_cpus()


# --- shared state between the supervisor and its workers -----------------------------------------


class ReadyFlags:
    """One byte per worker in a shared memory map: 1 while that worker is ready."""

    def __init__(self, path: Path, workers: int, *, create: bool = False) -> None:
        if create:
            path.write_bytes(b"\0" * workers)
        self.workers = workers
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), workers)

    def set(self, slot: int, ready: bool) -> None:
        self._map[slot] = 1 if ready else 0

    def all_ready(self) -> bool:
        return self._map.find(b"\0", 0, self.workers) < 0

    def count(self) -> int:
        return self.workers - self._map[: self.workers].count(0)


class SupervisorState(msgspec.Struct):
    """What the supervisor publishes for /metrics (written whole, replaced atomically)."""

    workers: int
    restarts: list[int]


Row = tuple[tuple[str, ...], float, list[int]]  # labels, value (sum for histograms), bucket counts


class MetricsSnapshot(msgspec.Struct):
    """One worker's metrics at one instant."""

    pid: int
    families: dict[str, list[Row]]
    connections: dict[str, int] = msgspec.field(default_factory=dict)
    inbound: int = 0  # open connections of the review listener
    unshared_circuits: list[str] = msgspec.field(default_factory=list)  # circuits of this worker only


_encoder: Final = msgspec.msgpack.Encoder()
_snapshot_decoder: Final = msgspec.msgpack.Decoder(MetricsSnapshot)
_state_decoder: Final = msgspec.json.Decoder(SupervisorState)


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` so that readers see the old or the new file, never a partial one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def capture(metrics: Metrics) -> MetricsSnapshot:
    """The current values of every family (and the pool's open connections)."""
    unshared = metrics.refresh_circuit_states()
    families: dict[str, list[Row]] = {}
    for family in metrics.families:
        rows: list[Row] = []
        for labels, child in family.children.items():
            if isinstance(child, HistogramChild):
                rows.append((labels, child.sum, child.counts))
            else:
                rows.append((labels, child.value, []))
        families[family.name] = rows
    connections: dict[str, int] = {}
    source = metrics.connection_source
    if source is not None:
        with contextlib.suppress(Exception):  # a broken pool probe must not break the snapshot
            for origin, count in source().items():
                connections[str(origin)] = connections.get(str(origin), 0) + count
    inbound = 0
    if metrics.inbound_source is not None:
        with contextlib.suppress(Exception):
            inbound = metrics.inbound_source()
    return MetricsSnapshot(os.getpid(), families, connections, inbound, unshared)


def merge(into: Metrics, snapshots: Iterable[MetricsSnapshot], *, gauges: bool = True) -> None:
    """Add counters and histograms of ``snapshots`` into ``into``; combine gauges per ``GAUGE_MERGE``."""
    families = {family.name: family for family in into.families}
    gauge_values: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for snapshot in snapshots:
        for name, rows in snapshot.families.items():
            family = families.get(name)
            if family is None:
                continue  # a family another version of the gateway had
            for labels, value, counts in rows:
                if len(labels) != len(family.labelnames):
                    continue
                if family.kind == "gauge":
                    gauge_values.setdefault((name, tuple(labels)), []).append(value)
                    continue
                child = family.labels(*labels)
                if isinstance(child, HistogramChild):
                    if len(counts) == len(child.counts):
                        for i, count in enumerate(counts):
                            child.counts[i] += count
                        child.sum += value
                else:
                    child.value += value
    if gauges:
        for (name, labels), values in gauge_values.items():
            merged = GAUGE_MERGE.get(name, sum)(values)
            if merged is not None:
                families[name].labels(*labels).value = merged  # type: ignore[union-attr]


@dataclass
class RunDirectory:
    """The supervisor's private directory: ready flags, its state, each worker's metrics snapshot."""

    path: Path
    workers: int
    flags: ReadyFlags = field(init=False)

    def __post_init__(self) -> None:
        self.flags = ReadyFlags(self.path / "ready", self.workers, create=not (self.path / "ready").exists())

    def snapshot_path(self, slot: int) -> Path:
        return self.path / f"worker-{slot}.metrics"

    def write_snapshot(self, slot: int, data: bytes) -> None:
        # Metrics are best effort: a full or removed directory must not stop a worker.
        with contextlib.suppress(OSError):
            _replace(self.snapshot_path(slot), data)

    def read_snapshot(self, slot: int) -> MetricsSnapshot | None:
        try:
            return _snapshot_decoder.decode(self.snapshot_path(slot).read_bytes())
        except (OSError, msgspec.DecodeError):
            return None

    def forget_live_values(self, slot: int) -> None:
        """After a worker's death: keep its counters in the totals, drop what described it alive."""
        snapshot = self.read_snapshot(slot)
        if snapshot is None:
            return
        for name in LIVE_GAUGES:
            snapshot.families[name] = [
                (labels, 0.0, counts) for labels, _, counts in snapshot.families.get(name, [])
            ]
        snapshot.connections = {}
        snapshot.inbound = 0
        self.write_snapshot(slot, _encoder.encode(snapshot))

    def write_state(self, state: SupervisorState) -> None:
        _replace(self.path / "supervisor.json", msgspec.json.encode(state))

    def read_state(self) -> SupervisorState | None:
        try:
            return _state_decoder.decode((self.path / "supervisor.json").read_bytes())
        except (OSError, msgspec.DecodeError):
            return None


# --- the worker's side ---------------------------------------------------------------------------


class WorkerObservability(Observability):
    """``Observability`` whose ``/metrics`` is the sum over all workers."""

    def __init__(self, run: RunDirectory, slot: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run = run
        self.slot = slot
        self.shared_state: SharedBackendState | None = None

    def metrics(self) -> tuple[bytes, str] | None:
        own = self.prometheus
        if own is None:
            return None
        mine = capture(own)
        snapshots = [mine]
        reviews: dict[int, float] = {self.slot: _reviews(mine)}
        for slot in range(self.run.workers):
            if slot != self.slot and (other := self.run.read_snapshot(slot)) is not None:
                snapshots.append(other)
                reviews[slot] = _reviews(other)
        combined = Metrics()
        merge(combined, snapshots)
        _circuit_states(combined, own, snapshots)
        connections: dict[str, int] = {}
        for snapshot in snapshots:
            for origin, count in snapshot.connections.items():
                connections[origin] = connections.get(origin, 0) + count
        combined.set_connection_source(lambda: connections)
        inbound = sum(snapshot.inbound for snapshot in snapshots)
        combined.set_inbound_source(lambda: inbound)
        body, content_type = combined.render()
        extra = CollectorRegistry()
        extra.register(_WorkerFamilies(self.run, reviews, self.shared_state))
        return body + generate_latest(extra), content_type


def _circuit_states(combined: Metrics, own: Metrics, snapshots: Sequence[MetricsSnapshot]) -> None:
    """``backend_circuit_state`` as every worker acts on it: the shared state, read now by this
    worker (the snapshots can be ``DUMP_SECONDS`` old); for a circuit some worker keeps alone,
    the merged snapshots' value (present only where all workers agree)."""
    unshared = {name for snapshot in snapshots for name in snapshot.unshared_circuits}
    source = own.circuit_source
    if source is None:
        return
    family = combined.circuit_state
    try:
        rows = list(source())
    except Exception:  # noqa: BLE001 - a broken probe must not break the whole scrape
        return
    for webhook, state, shared in rows:
        if shared and webhook not in unshared:
            family.labels(webhook).value = state


def _reviews(snapshot: MetricsSnapshot) -> float:
    return sum(row[1] for row in snapshot.families.get(PREFIX + "inbound_requests_total", ()))


class _WorkerFamilies(Collector):
    def __init__(
        self, run: RunDirectory, reviews: Mapping[int, float], shared: SharedBackendState | None
    ) -> None:
        self._run = run
        self._reviews = reviews
        self._shared = shared

    def collect(self) -> Iterable[Metric]:
        state = self._run.read_state()
        workers = Metric(PREFIX + "workers", "Worker processes the gateway runs (--workers).", "gauge")
        workers.samples.append(Sample(workers.name, {}, self._run.workers))
        ready = Metric(PREFIX + "workers_ready", "Worker processes that are ready now.", "gauge")
        ready.samples.append(Sample(ready.name, {}, self._run.flags.count()))
        restarts = Metric(
            PREFIX + "worker_restarts",
            "Worker processes restarted after they exited unexpectedly, per worker slot.",
            "counter",
        )
        reviews = Metric(
            PREFIX + "worker_reviews",
            "Review requests handled per worker slot (how evenly the kernel spreads connections).",
            "counter",
        )
        for slot in range(self._run.workers):
            count = state.restarts[slot] if state is not None and slot < len(state.restarts) else 0
            restarts.samples.append(Sample(restarts.name + "_total", {"worker": str(slot)}, count))
            reviews.samples.append(
                Sample(reviews.name + "_total", {"worker": str(slot)}, self._reviews.get(slot, 0.0))
            )
        return [workers, ready, restarts, reviews, *self._shared_state()]

    def _shared_state(self) -> Iterable[Metric]:
        slots = Metric(
            PREFIX + "shared_state_slots",
            "Records of the per-backend state shared by the workers, per table (circuits, in_flight, "
            "endpoints) and state (used, free); fixed when the gateway starts.",
            "gauge",
        )
        refused = Metric(
            PREFIX + "shared_state_refused",
            "Backends or endpoints that found their shared table full and kept a state of their own "
            "in one worker, per table.",
            "counter",
        )
        tables = self._shared.tables.values() if self._shared is not None else ()
        for table in tables:
            name = table.name
            used = table.used
            slots.samples.append(Sample(slots.name, {"table": name, "state": "used"}, used))
            slots.samples.append(Sample(slots.name, {"table": name, "state": "free"}, table.capacity - used))
            refused.samples.append(Sample(refused.name + "_total", {"table": name}, table.refused))
        return [slots, refused]


class WorkerSpec(msgspec.Struct):
    """A worker's assignment, from the supervisor (environment variable ``SPEC_ENV``)."""

    slot: int
    workers: int
    run_dir: str
    supervisor: int
    bind_fd: int
    metrics_fd: int | None
    options: dict[str, Any]


def worker_main() -> int:
    """Entry point of a worker process (started by the supervisor, ``_WORKER_ENTRY``)."""
    from gateway.observability import configure_logging, count_dropped_lines

    spec = msgspec.json.decode(os.environ.pop(SPEC_ENV), type=WorkerSpec)
    options = replace(
        ServeSettings(**spec.options),
        bind=f"fd://{spec.bind_fd}",
        metrics_bind=f"fd://{spec.metrics_fd}" if spec.metrics_fd is not None else None,
        workers=1,
    )
    # Through a writer thread, in writes the other processes' lines cannot tear (observability/logsink.py).
    configure_logging(options.log_level, options.log_format, background=True, shared=True)
    structlog.contextvars.bind_contextvars(worker=spec.slot)
    run = RunDirectory(Path(spec.run_dir), spec.workers)
    metrics = None if options.no_metrics else Metrics()
    if metrics is not None and (previous := run.read_snapshot(spec.slot)) is not None:
        merge(metrics, [previous], gauges=False)  # totals continue where the last worker stopped
    if metrics is not None:
        count_dropped_lines(metrics.log_lines_dropped.labels().inc)
    observer = WorkerObservability(
        run,
        spec.slot,
        metrics=metrics or False,
        review_log=not options.no_review_log,
        log_bodies=options.log_bodies,
    )
    try:
        trio.run(partial(_run_worker, options, observer, run, spec))
    except ConfigError:
        return EXIT_CONFIG_REFUSED
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        line = startup_failure(exc)
        if line is None:
            raise
        # Every worker meets the same failure: the first to claim it prints the one line.
        with contextlib.suppress(FileExistsError):
            os.close(os.open(run.path / "startup-failure", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            print(f"webhook-gateway: error: {line}", file=sys.stderr)
        return 1
    return 0


async def _run_worker(
    options: ServeSettings, observer: WorkerObservability, run: RunDirectory, spec: WorkerSpec
) -> None:
    from gateway.server.app import Readiness  # here: the supervisor does not load the server
    from gateway.server.serve import Running, serve
    from gateway.server.shared_state import SharedBackendState

    readiness = Readiness()
    readiness.peers = run.flags.all_ready
    shared = observer.shared_state = SharedBackendState(run.path, spec.workers, spec.slot)
    try:
        async with trio.open_nursery() as nursery:

            async def serve_then_stop(task_status: trio.TaskStatus[Running]) -> None:
                await serve(
                    # The workers share the pod's memory limit (the connection bounds: docs/inbound.md).
                    options,
                    observer=observer,
                    readiness=readiness,
                    shared_state=shared,
                    processes=spec.workers,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()

            running: Running = await nursery.start(serve_then_stop)
            nursery.start_soon(_publish_readiness, readiness, run.flags, spec.slot)
            if observer.prometheus is not None:
                nursery.start_soon(_publish_metrics, observer.prometheus, run, spec.slot)
            nursery.start_soon(_watch_supervisor, spec.supervisor, running.shutdown)
    except BaseExceptionGroup as group:
        refused, rest = group.split(ConfigError)
        if refused is not None and rest is None:
            leaf: BaseException = refused
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            raise leaf from None
        raise
    finally:
        run.flags.set(spec.slot, False)
        if os.getppid() != spec.supervisor:
            shutil.rmtree(run.path, ignore_errors=True)  # nobody else will remove it
        elif observer.prometheus is not None:
            run.write_snapshot(spec.slot, _encoder.encode(capture(observer.prometheus)))
        shared.close()


async def _publish_readiness(readiness: Readiness, flags: ReadyFlags, slot: int) -> None:
    while True:
        flags.set(slot, readiness.ready and not readiness.draining)
        await trio.sleep(READY_POLL_SECONDS)


async def _publish_metrics(metrics: Metrics, run: RunDirectory, slot: int) -> None:
    last = b""
    while True:
        data = _encoder.encode(capture(metrics))
        if data != last:
            run.write_snapshot(slot, data)
            last = data
        await trio.sleep(DUMP_SECONDS)


async def _watch_supervisor(supervisor: int, shutdown: Callable[[], None]) -> None:
    while os.getppid() == supervisor:  # noqa: ASYNC110 - nothing notifies us: poll
        await trio.sleep(PARENT_POLL_SECONDS)
    log.warning("the supervisor process is gone; shutting down", supervisor=supervisor)
    shutdown()


# --- the supervisor's side -----------------------------------------------------------------------


def listen(bind: str, backlog: int = 1024) -> socket.socket:
    """A listening socket for ``--bind`` (``HOST:PORT``, ``[V6]:PORT``, ``unix:PATH``), inheritable."""
    if bind.startswith("fd://"):
        sock = socket.socket(fileno=int(bind[5:]))
    elif bind.startswith("unix:"):
        path = bind[5:]
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
    else:
        host, _, port = bind.replace("[", "").replace("]", "").rpartition(":")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
        sock.bind((host, int(port)))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def _run_dir() -> Path:
    # Memory-backed where it exists (also writable in read-only containers); mkdtemp makes a
    # private (0700) directory with an unpredictable name.
    shm = Path("/dev/shm")  # noqa: S108
    base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="webhook-gateway-", dir=base))


def _listen(bind: str) -> socket.socket:
    try:
        return listen(bind)
    except OSError as exc:
        raise ListenError(bind, exc) from None
    except ValueError as exc:
        raise GatewayError(f"cannot listen on {bind}: {exc}") from None


def supervise(options: ServeSettings, workers: int) -> int:
    """Run ``workers`` gateway processes until SIGTERM/SIGINT; the process exit code."""
    from gateway.observability import configure_logging

    configure_logging(options.log_level, options.log_format, background=True, shared=True)
    raise_nofile_limit()  # as a single process does; the workers inherit the raised limit
    main = _listen(options.bind)  # ListenError: the command prints it as one line
    try:
        metrics = _listen(options.metrics_bind) if options.metrics_bind else None
    except BaseException:
        main.close()
        raise
    run_dir = _run_dir()
    try:
        run = RunDirectory(run_dir, workers)
        return trio.run(_supervise, options, run, main, metrics)
    finally:
        main.close()
        if metrics is not None:
            metrics.close()
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class _Slot:
    index: int
    process: trio.Process | None = None
    restarts: int = 0
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.5, maximum=30.0, jitter=0.5))


async def _supervise(
    options: ServeSettings, run: RunDirectory, main: socket.socket, metrics: socket.socket | None
) -> int:
    slots = [_Slot(i) for i in range(run.workers)]
    run.write_state(SupervisorState(run.workers, [0] * run.workers))
    stopping = trio.Event()
    everyone_ready = trio.Event()
    outcome = {"code": 0}
    shared = {
        "workers": run.workers,
        "run_dir": str(run.path),
        "supervisor": os.getpid(),
        "bind_fd": main.fileno(),
        "metrics_fd": metrics.fileno() if metrics is not None else None,
        "options": {k: v for k, v in asdict(options).items() if _plain(v)},
    }
    fds = [main.fileno()] + ([metrics.fileno()] if metrics is not None else [])
    log.info(
        "starting workers",
        workers=run.workers,
        bind=options.bind,
        address=_address(main),
        metrics=_address(metrics) if metrics is not None else None,
    )

    async def keep_running(slot: _Slot) -> None:
        env = {**os.environ, SPEC_ENV: msgspec.json.encode({**shared, "slot": slot.index}).decode()}
        while not stopping.is_set():
            started = trio.current_time()
            process = await trio.lowlevel.open_process(
                [sys.executable, "-c", _WORKER_ENTRY],
                env=env,
                pass_fds=fds,
                process_group=0,  # a terminal's Ctrl-C reaches the supervisor only; it forwards SIGTERM
            )
            slot.process = process
            if stopping.is_set():
                process.send_signal(signal.SIGTERM)
            code = await process.wait()
            run.flags.set(slot.index, False)
            run.forget_live_values(slot.index)  # its counters stay in the totals, its in-flight not
            if stopping.is_set():
                return
            if not everyone_ready.is_set():
                # As one process would: a gateway that cannot start (configuration refused: 2,
                # unreadable certificate: 1) exits instead of being restarted in a loop.
                log.error("a worker failed to start; stopping", worker=slot.index, exit_code=code)
                outcome["code"] = code if code > 0 else 1
                stopping.set()
                return
            if trio.current_time() - started >= STABLE_SECONDS:
                slot.backoff.reset()
            delay = slot.backoff.next_delay()
            slot.restarts += 1
            run.write_state(SupervisorState(run.workers, [s.restarts for s in slots]))
            log.error(
                "worker exited; restarting",
                worker=slot.index,
                pid=process.pid,
                exit_code=code,
                restart_in=round(delay, 2),
                restarts=slot.restarts,
            )
            with trio.move_on_after(delay):
                await stopping.wait()

    async def announce_ready() -> None:
        while not run.flags.all_ready():  # noqa: ASYNC110 - the flags live in shared memory: poll
            await trio.sleep(READY_POLL_SECONDS)
        everyone_ready.set()
        log.info("all workers ready", workers=run.workers)

    async def wait_for_signal() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("shutting down workers", signal=signal.Signals(signum).name)
                stopping.set()
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_signal)
        nursery.start_soon(announce_ready)
        for slot in slots:
            nursery.start_soon(keep_running, slot)
        await stopping.wait()
        # No new worker will need the sockets: once the workers close theirs, connecting fails at
        # once instead of waiting in a queue nobody reads.
        main.close()
        if metrics is not None:
            metrics.close()
        alive = [s.process for s in slots if s.process is not None and s.process.returncode is None]
        for process in alive:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        bound = float(options.drain_seconds) + float(options.shutdown_timeout) + KILL_MARGIN_SECONDS
        with trio.move_on_after(bound):
            for process in alive:
                await process.wait()
        for process in alive:
            if process.returncode is None:
                log.error("worker did not stop in time; killing it", pid=process.pid, waited_seconds=bound)
                process.kill()
        for process in alive:
            await process.wait()
        nursery.cancel_scope.cancel()
    log.info("stopped")
    return outcome["code"]


def _plain(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _address(sock: socket.socket) -> str:
    name = sock.getsockname()
    if isinstance(name, tuple):
        host = f"[{name[0]}]" if ":" in name[0] else name[0]
        return f"{host}:{name[1]}"
    return str(name)
