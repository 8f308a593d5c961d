"""The composition root: load configuration, open the client pool, serve, drain.

Everything long-lived is owned by one nursery: the backend client pool (and its HTTP/2 reader
tasks), the configuration and certificate watchers, the namespace label source and the HTTP
server(s) (``gateway.server.hypercorn``). SIGTERM turns /readyz to 503 at once, keeps serving for
``--drain-seconds`` (endpoints take time to be removed), then stops accepting and lets in-flight
reviews finish.
"""

from __future__ import annotations

import errno
import gc
import signal
import ssl
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog
import trio

from gateway.config.load import load_config
from gateway.config.model import Snapshot
from gateway.config.trust import cluster_reference_problems
from gateway.dispatch.engine import Dispatcher, DispatchSettings
from gateway.dispatch.ports import NamespaceNotFoundError
from gateway.errors import ConfigError, ListenError
from gateway.server.app import GatewayApp, Readiness, ServerSettings, request_path
from gateway.server.cgroup import CpuBudget, cpu_share
from gateway.server.gcgovernor import GcGovernor, GcPolicy, govern
from gateway.server.hypercorn.config import GatewayConfig, server_config
from gateway.server.hypercorn.listener import serve_inbound
from gateway.server.hypercorn.version import check_versions
from gateway.server.limits import (
    InboundLimits,
    InboundRuntime,
    connection_bounds,
    raise_nofile_limit,
)
from gateway.server.memory import (
    HeapTrimmer,
    limit_malloc_arenas,
    memory_limit,
    physical_memory,
    resident_bytes,
)
from gateway.settings import ServeSettings
from gateway.wire.tls import server_context

if TYPE_CHECKING:
    from gateway.observability import Observability
    from gateway.server.shared_state import SharedBackendState

log = structlog.get_logger("gateway.server")

_GC_POLICY: Final = GcPolicy()  # when full garbage collections run once serving (gcgovernor)


class ReloadableTLS:
    """The serving certificate, replaced atomically when its files change (rotation without restart).

    ``context`` is the SSLContext new connections handshake with (the listener asks for it at every
    accept). ``reload`` builds a *new* context from the files and swaps it in only when the pair
    loads and matches; otherwise the old pair keeps serving and the error is raised. Loading into
    the live context instead would leave it half-replaced while a renewer has written the new
    certificate but not yet its key, and every handshake in between would fail.
    """

    def __init__(self, certfile: str, keyfile: str, client_ca: str | None) -> None:
        self.certfile, self.keyfile, self.client_ca = certfile, keyfile, client_ca
        self.context = self._build()

    def _build(self) -> ssl.SSLContext:
        # TRN-14 with client_ca; raises unless the key matches the certificate.
        return server_context(self.certfile, self.keyfile, client_ca=self.client_ca)

    def reload(self) -> None:
        """Load the files into a new context and use it from the next handshake on; raise if broken."""
        self.context = self._build()

    def current(self) -> ssl.SSLContext:
        return self.context


@dataclass
class Running:
    """What the started server reports to ``nursery.start`` callers (tests, demo)."""

    urls: list[str]
    metrics_urls: list[str]
    app: GatewayApp
    shutdown: Callable[[], None]


async def serve(
    options: ServeSettings,
    *,
    observer: Observability | None = None,
    handle_signals: bool = True,
    readiness: Readiness | None = None,
    shared_state: SharedBackendState | None = None,
    processes: int = 1,
    gc_policy: GcPolicy = _GC_POLICY,
    task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the gateway until SIGTERM/SIGINT (or ``Running.shutdown()``), then drain and return.

    ``shared_state``: a worker's tables of per-backend state shared with the other workers
    (``--workers N``); circuits, bulkheads' counts and endpoint ejections then live there.
    ``processes``: how many gateway processes share this one's memory limit (``--workers``).
    ``gc_policy``: when full garbage collections run once serving (tests shorten its bounds).
    """
    from gateway.dispatch.policy import GuardedBackends
    from gateway.dispatch.shadow import ShadowCalls
    from gateway.resilience import BackendGuards
    from gateway.sources.configdir import ConfigStore, fingerprint, watch_config_dir, watch_files
    from gateway.transport.caller import BackendCaller
    from gateway.transport.credentials import CredentialStore
    from gateway.transport.pool import ClientPool
    from gateway.transport.trust import TrustStore

    check_versions()  # hypercorn's and h11's internals are used: only verified releases run
    strict = bool(options.strict_https)
    nofile = raise_nofile_limit()  # as Go programs do: the hard limit is what the operator allows
    limit_malloc_arenas()  # before any thread starts (gateway.server.memory)

    def load(generation: int) -> Snapshot:  # start-up and every reload: what `check` runs too
        snapshot = load_config(
            options.config, strict_https=strict, allow_empty=options.allow_empty_config, generation=generation
        )
        if options.namespace_source != "cluster" and (problems := cluster_reference_problems(snapshot)):
            raise ConfigError(problems)  # caFrom of a cluster object, and no cluster to read it from
        return snapshot

    baseline = fingerprint(Path(options.config))  # taken first, so no change before the watch is missed
    if observer is None:
        from gateway.observability import Observability

        observer = Observability(metrics=False, review_log=False)  # still logs configuration events
    try:
        first = load(1)
    except ConfigError as exc:
        observer.config_reloaded(ok=False, snapshot=None, problems=exc.errors)
        raise
    store = ConfigStore(first)
    observer.config_reloaded(ok=True, snapshot=first, problems=list(first.warnings))

    credentials = CredentialStore.load(options.backend_kubeconfig) if options.backend_kubeconfig else None
    tls = (
        ReloadableTLS(options.certfile, options.keyfile or options.certfile, options.client_ca)
        if options.certfile
        else None
    )
    if tls is not None:
        observer.serving_certificate_loaded(tls.certfile)
    limits = inbound_limits(options)
    runtime = inbound_runtime(limits, options, observer, nofile=nofile, processes=processes)
    observer.set_inbound_source(lambda: runtime.open_connections)
    trimmer = HeapTrimmer()
    runtime.on_closed = trimmer.connections_changed
    readiness = readiness if readiness is not None else Readiness()  # a worker passes one (--workers)
    shutdown_requested = trio.Event()

    trust = TrustStore()  # the CA bundles of caFrom references, kept fresh by the CA sources
    trust.subscribe(lambda _reference: observer.backend_trust_changed(store.snapshot, trust.bundles()))
    observer.backend_trust_changed(first, {})
    async with (
        ClientPool(
            max_connections_per_origin=options.max_connections_per_backend,
            max_response_bytes=options.max_backend_response_bytes,
            on_peer_certificate=observer.backend_certificate_seen,
        ) as pool,
        trio.open_nursery() as nursery,
    ):
        caller = BackendCaller(pool, credentials, trust=trust)
        ca_sources = await _ca_sources(nursery, options, trust, observer, first)
        readiness.add_check(lambda: ca_sources.ready)  # issue 34: every caFrom read once
        caller.prepare(first)  # backend targets (URL, TLS, credentials) are built with the snapshot
        source = await _namespace_source(nursery, options, store)
        endpoint_slices = _endpoint_slices(nursery, options, caller, store.snapshot, shared_state)
        namespaces = _NamespaceLabels(source)
        # MAT-33: ready once a configuration is loaded and, if any backend needs namespace labels,
        # the namespace source has synced.
        readiness.add_check(lambda: source.ready or not _needs_namespaces(store.snapshot))
        nursery.start_soon(_when_synced, source, readiness)
        # Per-backend circuit breakers and bulkheads (webhook-gateway.io/backend-policy), kept across reloads.
        guards = BackendGuards(
            shared_state.clock if shared_state is not None else trio.current_time,
            on_transition=observer.circuit_changed,
            cells=shared_state.circuits(first) if shared_state is not None else None,
            in_flight=shared_state.in_flight(first) if shared_state is not None else None,
        )
        guards.reconcile((*first.validating, *first.mutating))
        observer.set_circuit_source(guards.circuits)  # /metrics shows the state the guards act on
        dispatcher = Dispatcher(
            caller,
            namespaces,
            DispatchSettings(
                patch_mode=options.patch_mode,
                audit_patches=options.audit_patches,
                exclude_virtual_resources=not options.include_virtual_resources,
            ),
            policy=GuardedBackends(guards, on_refused=observer.call_refused),
            # Shadow-mode calls outlive the review that started them: the server's nursery owns them.
            shadow=ShadowCalls(nursery, on_result=observer.shadow_decided),
        )
        overload = _overload_gate(options, observer, runtime.cpu_budget)
        if overload is not None and overload.policy.max_event_loop_lag is not None:
            await nursery.start(overload.run_lag_probe)
        app = GatewayApp(
            overload=overload,
            snapshot=lambda: store.snapshot,
            dispatcher=dispatcher,
            readiness=readiness,
            observer=observer,
            settings=ServerSettings(
                validate_path=options.validate_path,
                mutate_path=options.mutate_path,
                max_request_bytes=options.max_request_bytes,
                default_timeout_seconds=options.default_timeout,
                deadline_margin_seconds=options.deadline_margin,
                serve_metrics=not options.metrics_bind,  # /metrics on the metrics listener only
            ),
            conversions=_conversion_service(caller, options, observer),
        )
        if overload is not None:  # a shed review is answered where it is read (docs/resilience.md)
            runtime.answer_at_once = app.answer_at_once
            runtime.sheds_now = lambda: overload.shed_reason() is not None
        observer.watch_pool(pool)
        if trimmer.available:
            nursery.start_soon(trimmer.run)

        def on_reload(result: str, problems: Sequence[Any]) -> None:
            if result == "success":
                ca_sources.watch_snapshot(store.snapshot)
                caller.prepare(store.snapshot)
                observer.backend_trust_changed(store.snapshot, trust.bundles())
            observer.config_reloaded(ok=result == "success", snapshot=store.snapshot, problems=list(problems))
            if endpoint_slices is not None:
                endpoint_slices.watch_snapshot(store.snapshot)
            guards.reconcile((*store.snapshot.validating, *store.snapshot.mutating))
            readiness.changed()  # a configuration that needs no namespace labels may make it ready

        await nursery.start(
            partial(
                watch_config_dir,
                Path(options.config),
                store,
                lambda _path, generation: load(generation),
                interval=options.config_poll_seconds,
                on_reload=on_reload,
                baseline=baseline,
            )
        )
        if credentials is not None and options.backend_kubeconfig:
            await nursery.start(
                partial(
                    watch_files,
                    list(credentials.files),
                    _reload_credentials(caller, options.backend_kubeconfig),
                    interval=options.config_poll_seconds,
                )
            )
        if tls is not None:
            await nursery.start(
                partial(
                    watch_files,
                    [Path(tls.certfile), Path(tls.keyfile)],
                    _reload_tls(tls, observer),
                    interval=options.config_poll_seconds,
                )
            )

        stop_serving = trio.Event()
        if handle_signals:
            nursery.start_soon(_wait_for_signal, shutdown_requested)
        # The HTTP servers get their own nursery: it closes only when hypercorn has drained them.
        async with trio.open_nursery() as servers:
            main_cfg = server_config(
                options.bind, tls=tls, shutdown_timeout=options.shutdown_timeout, runtime=runtime
            )
            urls: list[str] = await servers.start(
                _serve_app, app, main_cfg, tls.current if tls is not None else None, stop_serving.wait
            )
            metrics_urls: list[str] = []
            if options.metrics_bind:
                metrics_cfg = server_config(options.metrics_bind, tls=None, shutdown_timeout=1.0)
                metrics_urls = await servers.start(
                    _serve_app, _MetricsOnly(app), metrics_cfg, None, stop_serving.wait
                )
            log.info(
                "serving",
                urls=urls,
                metrics=metrics_urls,
                config=options.config,
                validating=len(first.validating),
                mutating=len(first.mutating),
            )
            # Everything alive now (modules, configuration, TLS contexts) lives as long as the
            # process: keep it out of the cyclic GC, whose full collections otherwise scan it all and
            # stall the event loop for 20-40 ms (docs/performance.md).
            gc.collect()
            gc.freeze()
            # Full collections from now on when the gateway is quiet, or at a bound on time and
            # memory growth, never by CPython's own count: each scans every open connection's
            # objects, 200-420 ms of the event loop with thousands open (gateway.server.gcgovernor).
            await nursery.start(
                partial(
                    govern,
                    GcGovernor.start(
                        gc_policy, trio.current_time(), resident_bytes(), runtime.open_connections
                    ),
                    lambda: (runtime.requests_in_flight, runtime.last_request_at, len(runtime.pending)),
                    lambda: runtime.open_connections,
                    on_collected=observer.gc_collected,
                )
            )
            registrar = None
            if options.manage_registration:
                from gateway.server.self_registration import registrar_from

                registrar = registrar_from(
                    options, lambda: store.snapshot, lambda: readiness.ready and not readiness.draining
                )
                await nursery.start(registrar.run)
            task_status.started(Running(urls, metrics_urls, app, shutdown_requested.set))

            await shutdown_requested.wait()
            # Everything below ends by this time, whatever clients do.
            hard_deadline = trio.current_time() + options.drain_seconds + options.shutdown_timeout
            readiness.draining = True  # /readyz → 503 at once; keep serving while endpoints update
            runtime.start_draining()  # answers carry Connection: close; HTTP/2 callers get GOAWAY
            if registrar is not None:
                with trio.move_on_at(hard_deadline):
                    await registrar.shutdown()  # relax the registrations on uninstall; hand over the Lease
            log.info("shutting down: draining", drain_seconds=options.drain_seconds)
            await trio.sleep(options.drain_seconds)
            # Let in-flight reviews finish before connections are closed.
            with trio.move_on_at(hard_deadline):
                await app.wait_idle()
            stop_serving.set()  # stop accepting; idle connections close at once, busy ones when answered
            servers.cancel_scope.deadline = hard_deadline
        nursery.cancel_scope.cancel()  # watchers, namespace source, pool readers
    log.info("stopped")


_LISTEN_ERRORS = (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL)


async def _serve_app(
    app: Any,
    cfg: GatewayConfig,
    tls_context: Callable[[], ssl.SSLContext] | None,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await serve_inbound(
            app, cfg, tls_context=tls_context, shutdown_trigger=shutdown_trigger, task_status=task_status
        )
    except* OSError as group:
        # Binding happens inside nested nurseries: the OSError arrives wrapped in exception groups.
        _, rest = group.split(lambda e: isinstance(e, OSError) and e.errno in _LISTEN_ERRORS)
        if rest is None or rest is not group:
            bind_error = next(_oserrors(group))
            raise ListenError(", ".join(cfg.bind), bind_error) from None
        raise


def _oserrors(exc: BaseException) -> Iterator[OSError]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _oserrors(inner)
    elif isinstance(exc, OSError) and exc.errno in _LISTEN_ERRORS:
        yield exc


def inbound_runtime(
    limits: InboundLimits, options: ServeSettings, observer: Any, *, nofile: int, processes: int
) -> InboundRuntime:
    """The listener's runtime, with the connection bounds derived from descriptors and memory."""
    detected = memory_limit()
    limit = options.memory_limit or detected or physical_memory()
    bounds = connection_bounds(
        limits,
        nofile=nofile,
        reserve=options.fd_reserve,
        memory_limit=limit,
        resident=resident_bytes(),
        processes=processes,
    )
    # What the handshake gate and --shed-max-cpu measure the process's CPU against: read again while
    # serving, since a pod's CPU limit can change while it runs (in-place resize).
    budget = CpuBudget(
        partial(cpu_share, processes),
        on_change=lambda before, now: log.info("cpu budget changed", cpu_budget=now, before=before),
    )
    log.info(
        "inbound connection bounds",
        connections=bounds.connections,
        pending=bounds.pending,
        by_memory=bounds.memory,
        by_file_descriptors=bounds.fds,
        memory_limit=limit,
        memory_limit_from="--memory-limit" if options.memory_limit else "cgroup" if detected else "machine",
        processes=processes,
        cpu_budget=budget(),
    )
    return InboundRuntime(
        limits=limits,
        events=observer,
        max_connections=bounds.connections,
        max_pending=bounds.pending,
        cpu_budget=budget,
    )


def inbound_limits(options: ServeSettings) -> InboundLimits:
    """The inbound limits from the settings."""
    return InboundLimits(
        header_timeout=options.header_read_timeout,
        body_timeout=options.body_read_timeout,
        idle_timeout=options.idle_timeout,
        write_timeout=options.write_timeout,
        max_connections=options.max_inbound_connections,
        max_pending=options.max_pending_connections,
        handshake_timeout=options.handshake_timeout,
        handshake_burst=options.handshake_burst,
        handshake_rate=options.handshake_rate,
        max_waiting_handshakes=options.max_waiting_handshakes,
        h2_control_burst=options.h2_control_frame_burst,
        h2_control_rate=options.h2_control_frame_rate,
        h2_max_settings=InboundLimits().h2_max_settings,
    )


def _reload_credentials(caller: Any, path: str) -> Callable[[Sequence[Path]], None]:
    """Backend credentials rotate like certificates: a file that does not load keeps the old ones."""
    from gateway.errors import ClientConfigError
    from gateway.transport.credentials import CredentialStore

    def reload(_changed: Sequence[Path]) -> None:
        try:
            caller.credentials = CredentialStore.load(path)
            log.info("backend credentials reloaded", kubeconfig=path)
        except ClientConfigError as exc:
            log.error("backend credentials reload failed; keeping the old ones", error=str(exc))

    return reload


def _reload_tls(tls: ReloadableTLS, observer: Any) -> Callable[[Sequence[Path]], None]:
    """Swap in the new pair if it loads and matches; otherwise keep the old one, log once, count."""
    last_error = ""

    def reload(_changed: Sequence[Path]) -> None:
        nonlocal last_error
        try:
            tls.reload()
        except (OSError, ssl.SSLError) as exc:
            observer.certificate_reloaded(ok=False)
            error = str(exc) or type(exc).__name__
            if error != last_error:  # a renewer writing in steps must not flood the log
                log.error(
                    "serving certificate reload failed; still serving the previous certificate",
                    certfile=tls.certfile,
                    error=error,
                )
            last_error = error
            return
        last_error = ""
        observer.certificate_reloaded(ok=True)
        observer.serving_certificate_loaded(tls.certfile)
        log.info("serving certificate reloaded", certfile=tls.certfile)

    return reload


async def _wait_for_signal(event: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            event.set()
            return


async def _when_synced(source: Any, readiness: Readiness) -> None:
    """Reviews waiting for readiness (MAT-33) look again once the namespace source has synced."""
    await source.wait_synced()
    readiness.changed()


def _needs_namespaces(snapshot: Snapshot) -> bool:
    return any(not h.namespace_selector.is_empty for h in (*snapshot.validating, *snapshot.mutating))


async def _namespace_source(nursery: trio.Nursery, options: ServeSettings, store: Any) -> Any:
    """GW-01: Namespace objects from the config directory, or a list+watch of the cluster's."""
    from gateway.sources.namespaces import ClusterNamespaces, FileNamespaces

    if options.namespace_source != "cluster":
        return FileNamespaces(store, unknown_namespace=options.unknown_namespace)
    from gateway.sources.kube import KubeClient, in_cluster_config, load_kubeconfig

    config = load_kubeconfig(Path(options.kubeconfig)) if options.kubeconfig else in_cluster_config()
    source = ClusterNamespaces(KubeClient(config))
    nursery.start_soon(source.run)  # readiness waits for its first list (MAT-33)
    return source


async def _ca_sources(
    nursery: trio.Nursery, options: ServeSettings, trust: Any, observer: Any, snapshot: Snapshot
) -> Any:
    """Issue 34: read and follow every caFrom reference (cluster objects with cluster access, files)."""
    from gateway.sources.ca import CaSources

    client = None
    if options.namespace_source == "cluster":
        from gateway.sources.kube import KubeClient, in_cluster_config, load_kubeconfig

        config = load_kubeconfig(Path(options.kubeconfig)) if options.kubeconfig else in_cluster_config()
        client = KubeClient(config)
    sources = CaSources(
        trust, client, on_update=observer.ca_source_updated, file_interval=options.config_poll_seconds
    )
    sources.watch_snapshot(snapshot)
    await nursery.start(sources.run)
    return sources


def _overload_gate(options: ServeSettings, observer: Any, cpu_budget: float | Callable[[], float]) -> Any:
    """Overload shedding when --shed-max-in-flight, --shed-max-event-loop-lag or --shed-max-cpu is
    given; the CPU is measured against ``cpu_budget`` (``cgroup.CpuBudget``)."""
    from gateway.resilience import ShedPolicy
    from gateway.server.cgroup import CpuShare
    from gateway.server.overload import OverloadGate

    policy = ShedPolicy(
        max_in_flight=options.shed_max_in_flight,
        max_event_loop_lag=options.shed_max_event_loop_lag,
        max_cpu_share=options.shed_max_cpu,
    )
    if not policy.enabled:
        return None
    cpu = CpuShare(cpu_budget) if policy.max_cpu_share is not None else None
    return OverloadGate(policy, on_shed=observer.review_shed, cpu_share=cpu.share if cpu else None)


def _endpoint_slices(
    nursery: trio.Nursery,
    options: ServeSettings,
    caller: Any,
    snapshot: Snapshot,
    shared_state: SharedBackendState | None,
) -> Any:
    """With cluster access, service backends are balanced over their EndpointSlices (else DNS)."""
    if options.namespace_source != "cluster":
        return None
    from gateway.sources.endpointslices import ClusterEndpointSlices
    from gateway.sources.kube import KubeClient, in_cluster_config, load_kubeconfig
    from gateway.transport.endpoints import EndpointRouter

    config = load_kubeconfig(Path(options.kubeconfig)) if options.kubeconfig else in_cluster_config()
    if shared_state is not None:  # ejections shared by every worker
        router = EndpointRouter(shared_state.clock, cells=shared_state.ejections(snapshot))
    else:
        router = EndpointRouter(trio.current_time)
    caller.endpoints = router
    source = ClusterEndpointSlices(KubeClient(config), router.update)
    source.watch_snapshot(snapshot)
    nursery.start_soon(source.run)
    return source


class _NamespaceLabels:
    """Adapts a namespace label source to dispatch's port (NOT_FOUND → NamespaceNotFoundError)."""

    def __init__(self, source: Any) -> None:
        from gateway.sources.namespaces import NOT_FOUND

        self._source = source
        self._not_found = NOT_FOUND

    async def labels(self, name: str) -> Mapping[str, str]:
        found = await self._source.labels(name)
        if found is self._not_found:
            raise NamespaceNotFoundError(name)
        return found  # type: ignore[no-any-return]

    def labels_now(self, name: str) -> Mapping[str, str] | None:
        found = self._source.labels_now(name)
        if found is self._not_found:
            raise NamespaceNotFoundError(name)
        return found  # type: ignore[no-any-return]


class _MetricsOnly:
    """The metrics listener: /metrics, /healthz and /readyz only."""

    def __init__(self, app: GatewayApp) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = request_path(scope) if scope["type"] == "http" else ""
        if path == "/metrics" and scope["method"] in ("GET", "HEAD"):
            rendered = self.app.observer.metrics()
            if rendered is not None:
                await self.app.respond_metrics(send, rendered)
                return
        if scope["type"] == "http" and path not in ("/metrics", "/healthz", "/readyz"):
            body = b"not found\n"
            await send(
                {
                    "type": "http.response.start",
                    "status": 404,
                    "headers": [(b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _conversion_service(caller: Any, options: ServeSettings, observer: Observability) -> Any:
    """CRD conversion (CNV-01..15) over the admission backends' transport, with the opt-in cache."""
    from gateway.conversion.cache import CacheSettings, ConversionCache
    from gateway.conversion.convert import ConversionService

    settings = CacheSettings(
        ttl_seconds=options.conversion_cache_ttl,
        max_entries=options.conversion_cache_max_entries,
        max_bytes=options.conversion_cache_max_bytes,
    )
    return ConversionService(
        caller,
        cache=ConversionCache(settings, trio.current_time),
        on_finished=observer.conversion_finished,
    )
