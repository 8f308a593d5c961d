"""``Observability``: the server's ``ReviewObserver``: metrics and logs for every review request.

The ASGI app calls ``review_started`` when a review request arrives and ``review_finished`` when it
is answered (or abandoned); the composition root calls ``config_reloaded`` after every configuration
load attempt. Metrics and the canonical line can each be switched off (``--no-metrics``,
``--no-review-log``); the FPT-03 fail-open warnings and configuration problems are always logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import structlog

from gateway.config.model import Snapshot
from gateway.config.trust import CaReference, ca_expiries
from gateway.conversion.convert import ConversionReport
from gateway.dispatch.report import DispatchReport
from gateway.dispatch.shadow import ShadowResult
from gateway.observability.canonical import (
    InboundLike,
    VerdictLike,
    backend_seconds_of,
    conversion_fields,
    failed_open_fields,
    review_fields,
    trace_id_of,
)
from gateway.observability.logs import EventWriter
from gateway.observability.metrics import Metrics
from gateway.resilience import CircuitState, Transition

# Calls the gateway decided not to make: overload shedding, an open circuit, a full bulkhead. While
# such a condition lasts, every review fails open on the same backends; one warning line per review
# and backend would turn an overload into a log flood (and cost the CPU the shedding saves). They
# are logged at most once per webhook and reason per second, each line counting the ones left out
# since the previous; the metrics and each review's own line still record every one.
CALLS_NOT_MADE: Final = frozenset({"shed", "circuit_open", "max_in_flight"})


class LineThrottle:
    """At most one line per key per ``window`` seconds; ``admit`` says how many were left out before."""

    __slots__ = ("_clock", "_last", "_left_out", "_max_keys", "_window")

    def __init__(self, clock: Callable[[], float], window: float = 1.0, max_keys: int = 4096) -> None:
        self._clock = clock
        self._window = window
        self._max_keys = max_keys  # keys are webhook names x reasons; bounded all the same
        self._last: dict[Hashable, float] = {}
        self._left_out: dict[Hashable, int] = {}

    def admit(self, key: Hashable) -> int | None:
        """None: leave this line out. Otherwise write it, noting the returned count left out."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._window:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return None
        if last is None and len(self._last) >= self._max_keys:
            self._last.clear()
            self._left_out.clear()
        self._last[key] = now
        return self._left_out.pop(key, 0)


class Observability:
    """Records every review in ``metrics`` (if given) and writes its canonical log line.

    Cheap on the hot path and never raises: a failure while recording is logged and swallowed,
    because observing a review must never change its answer.
    """

    def __init__(
        self,
        metrics: Metrics | bool | None = True,
        *,
        review_log: bool = True,
        log_bodies: bool = False,
        logger: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``metrics``: a ``Metrics`` to record into, True for a new one, False/None for none."""
        if metrics is True:
            metrics = Metrics()
        self.prometheus: Metrics | None = metrics or None
        self.review_log = review_log
        self.log_bodies = log_bodies
        self._log: Any = logger if logger is not None else structlog.get_logger("gateway.review")
        self._bound: Any = None  # the configured logger, resolved on first use (skips the lazy proxy)
        self._review_line: EventWriter | None = None  # writes the canonical line through _bound
        self._not_made = LineThrottle(clock)

    # --- ReviewObserver --------------------------------------------------------------------------

    def review_started(self, endpoint: str) -> None:
        """A review request arrived."""
        if self.prometheus is not None:
            self.prometheus.review_started(endpoint)

    def review_finished(
        self,
        endpoint: str,
        *,
        code: int,
        seconds: float,
        inbound: InboundLike | None,
        verdict: VerdictLike | None,
        error: str = "",
        trace: str = "",
        line: bool = True,
    ) -> None:
        """A review request ended: with a verdict (HTTP 200), or without one (400, 413, 499, 500).

        ``line``: False counts it without its review line (shed reviews beyond the first per second,
        ``gateway.server.app``; under overload their lines would cost as much as their answers).
        """
        try:
            report = verdict.report if verdict is not None else None
            backend_seconds = 0.0  # computed once for the metrics and the line
            if report is not None and (self.prometheus is not None or self.review_log):
                backend_seconds = backend_seconds_of(report)
            if self.prometheus is not None:
                self.prometheus.review_finished(
                    endpoint,
                    code=code,
                    seconds=seconds,
                    operation=inbound.attributes.operation if inbound is not None else "",
                    allowed=verdict.allowed if verdict is not None else None,
                    report=report,
                    backend_seconds=backend_seconds,
                )
            log = self._bound
            review_line = self._review_line
            if log is None or review_line is None:
                log = self._bound = self._log.bind()
                review_line = self._review_line = EventWriter(log)
            trace_id = ""
            if report is not None:
                for record in report.invocations:
                    if record.outcome == "failed_open":
                        trace_id = self._warn_failed_open(log, endpoint, inbound, report, trace)
                        break
                if report.conditions or report.dropped:
                    self._warn_report(log, endpoint, inbound, report)
            if not self.review_log or not line:
                return
            # Answered reviews are INFO; unanswered ones WARNING (caller's fault) or ERROR (ours, 5xx).
            level = _INFO if verdict is not None else (_ERROR if code >= 500 else _WARNING)
            if not log.is_enabled_for(level):
                return
            fields = review_fields(
                endpoint,
                code=code,
                seconds=seconds,
                inbound=inbound,
                verdict=verdict,
                error=error,
                trace_id=trace_id or trace_id_of(trace),
                log_bodies=self.log_bodies,
                backend_seconds=backend_seconds,
            )
            review_line.write(level, "review", fields)
        except Exception:  # noqa: BLE001 - observing must never change or break the answer
            self._log.exception("recording a review failed", endpoint=endpoint, code=code)

    def _warn_failed_open(
        self, log: Any, endpoint: str, inbound: InboundLike | None, report: DispatchReport, trace: str
    ) -> str:
        """FPT-03: one warning per call error ignored under Ignore; returns the trace id if it was needed."""
        trace_id = ""
        uid = inbound.uid if inbound is not None else ""
        for record in report.invocations:
            if record.outcome == "failed_open":
                left_out = 0
                if record.error_kind in CALLS_NOT_MADE:
                    admitted = self._not_made.admit((record.name, record.error_kind))
                    if admitted is None:
                        continue
                    left_out = admitted
                trace_id = trace_id or trace_id_of(trace)
                fields = failed_open_fields(endpoint, uid, record, trace_id)
                if left_out:
                    fields["suppressed"] = left_out
                log.warning("backend failed open", **fields)
        return trace_id

    @staticmethod
    def _warn_report(log: Any, endpoint: str, inbound: InboundLike | None, report: DispatchReport) -> None:
        """Match conditions that failed to evaluate (MAT-26/29) and dropped review entries."""
        for condition in report.conditions:
            for name, message in condition.errors:  # MAT-26/29: backend and condition named
                log.warning(
                    "match condition failed",
                    uid=inbound.uid if inbound is not None else "",
                    endpoint=endpoint,
                    webhook=condition.name,
                    condition=name,
                    error=message,
                )
        if report.dropped:
            log.warning(
                "review entries dropped",
                uid=inbound.uid if inbound is not None else "",
                endpoint=endpoint,
                dropped=report.dropped,
            )

    def conversion_finished(self, report: ConversionReport) -> None:
        """A conversion request ended: MET-10/11 metrics and one canonical ``conversion`` line."""
        try:
            if self.prometheus is not None:
                self.prometheus.conversion_finished(report)
            if not self.review_log:
                return
            level = logging.INFO if report.result == "success" else logging.WARNING
            if report.code >= 500:
                level = logging.ERROR
            self._log.log(level, "conversion", **conversion_fields(report, trace_id_of(report.trace)))
        except Exception:  # noqa: BLE001 - observing must never change or break the answer
            self._log.exception("recording a conversion failed", crd=report.crd)

    def metrics(self) -> tuple[bytes, str] | None:
        """The /metrics body and content type, or None when metrics are off (then /metrics is 404)."""
        if self.prometheus is None:
            return None
        return self.prometheus.render()

    # --- configuration and pool ------------------------------------------------------------------

    def config_reloaded(
        self,
        ok: bool,
        snapshot: Snapshot | None,
        problems: Sequence[object] = (),
    ) -> None:
        """Record a configuration load attempt (MET-09) and log it with its problems (CFG-23/25).

        ``snapshot`` is the configuration in force afterwards (the new one on success, the last good
        one on failure). ``problems`` are ``errors.ConfigProblem`` values (anything whose ``str`` is
        the message): warnings on success; on failure, the errors that refused the new set.
        """
        generation = snapshot.generation if snapshot is not None else 0
        backends = {
            "validating": len(snapshot.validating) if snapshot is not None else 0,
            "mutating": len(snapshot.mutating) if snapshot is not None else 0,
        }
        if self.prometheus is not None:
            self.prometheus.config_reloaded(ok, generation, backends)
            if snapshot is not None:
                self.prometheus.backends_configured(
                    (hook.name, hook.kind, hook.timeout_seconds)
                    for hook in (*snapshot.validating, *snapshot.mutating)
                )
        # CRD conversion entries (CNV-01) are backends too; counted once a configuration has any.
        conversions = len(snapshot.conversions) if snapshot is not None else 0
        extra = {"conversion": conversions} if conversions else {}
        if self.prometheus is not None and (
            conversions or ("conversion",) in self.prometheus.backends.children
        ):
            self.prometheus.backends.labels("conversion").value = conversions
        log = self._log
        if ok:
            log.info("configuration loaded", generation=generation, **backends, **extra)
            for problem in problems:
                log.warning("configuration warning", generation=generation, problem=str(problem))
            return
        log.error(
            "configuration refused; the last good configuration stays in force"
            if snapshot is not None
            else "configuration refused at start-up; not serving",
            generation=generation,
            problems=[str(p) for p in problems],
        )

    def serving_certificate_loaded(self, certfile: str) -> None:
        """Export when the serving certificate just (re)loaded from ``certfile`` expires."""
        if self.prometheus is None:
            return
        from cryptography import x509

        try:
            with open(certfile, "rb") as f:
                cert = x509.load_pem_x509_certificate(f.read())
        except (OSError, ValueError) as exc:
            self._log.warning(
                "cannot read the serving certificate's expiry", certfile=certfile, error=str(exc)
            )
            return
        self.prometheus.serving_certificate_loaded(cert.not_valid_after_utc.timestamp())

    # --- backend trust (caFrom references) ---------------------------------------------------------

    def backend_trust_changed(self, snapshot: Snapshot, bundles: Mapping[CaReference, bytes]) -> None:
        """Export the expiry of every CA certificate backends are verified against now."""
        if self.prometheus is not None:
            self.prometheus.backend_cas_trusted(ca_expiries(snapshot, bundles))

    def ca_source_updated(self, reference: CaReference, result: str, detail: str) -> None:
        """A value was read from ``reference``: ``changed`` (``detail`` describes the new bundle),
        ``unchanged``, or ``refused`` (``detail`` says why; the last good bundle stays in force)."""
        source = reference.describe()
        if self.prometheus is not None:
            self.prometheus.backend_ca_updated(source, result)
        log = structlog.get_logger("gateway.trust")
        if result == "changed":
            log.info("backend CA in force", source=source, bundle=detail)
        elif result == "refused":
            log.warning("backend CA refused; the last good one stays in force", source=source, reason=detail)

    def backend_certificate_seen(self, server: str, der: bytes) -> None:
        """A backend presented this certificate (DER) in a TLS handshake: export its expiry."""
        if self.prometheus is None:
            return
        from cryptography import x509

        try:
            not_after = x509.load_der_x509_certificate(der).not_valid_after_utc.timestamp()
        except ValueError:
            return
        self.prometheus.backend_certificate_seen(server, not_after)

    def watch_pool(self, pool: ConnectionCounts) -> None:
        """Export the pool's open connections per origin (``pool.open_connections()`` at each scrape)."""
        if self.prometheus is not None:
            self.prometheus.set_connection_source(pool.open_connections)

    def set_connection_source(self, source: Callable[[], Mapping[Any, int]] | None) -> None:
        """Export ``source()`` (origin -> open connections) at each scrape."""
        if self.prometheus is not None:
            self.prometheus.set_connection_source(source)

    # --- backend protections (gateway.resilience) ------------------------------------------------

    def circuit_changed(self, webhook: str, transition: Transition) -> None:
        """A backend's circuit breaker moved: logged (opening as a warning) and counted."""
        state = transition.state
        level = logging.WARNING if state is CircuitState.OPEN else logging.INFO
        structlog.get_logger("gateway.resilience").log(
            level, "backend circuit " + state.label, webhook=webhook, previous=transition.previous.label
        )
        if self.prometheus is not None:
            self.prometheus.circuit_changed(webhook, int(state), state.label)

    def review_shed(self, reason: str) -> None:
        """A review was answered at once because the gateway was overloaded (its reason: in_flight,
        event_loop_lag, cpu)."""
        if self.prometheus is not None:
            self.prometheus.review_shed(reason)

    def shadow_decided(self, result: ShadowResult) -> None:
        """A Shadow-mode backend's result: counted, and logged on one line with its would-be message."""
        fields: dict[str, Any] = {
            "webhook": result.webhook,
            "configuration": result.configuration,
            "kind": result.kind,
            "outcome": result.outcome,
            "ms": int(result.seconds * 1_000_000.0 + 0.5) / 1000.0,
        }
        if result.message:
            fields["message"] = result.message
        if result.review_uid:
            fields["uid"] = result.review_uid
        structlog.get_logger("gateway.shadow").info("shadow decision", **fields)
        if self.prometheus is not None:
            self.prometheus.shadow_decision(result.webhook, result.outcome)

    def call_refused(self, webhook: str, reason: str) -> None:
        """A backend call was not made (circuit_open, max_in_flight); the review log shows the call error."""
        if self.prometheus is not None:
            self.prometheus.call_refused(webhook, reason)

    # --- inbound connections (gateway.server.limits.InboundEvents) ------------------------------

    def connection_closed(self, reason: str) -> None:
        """The gateway closed an inbound connection because a limit was reached (counted only)."""
        if self.prometheus is not None and reason:
            self.prometheus.inbound_connection_closed(reason)

    def connection_rejected(self, reason: str) -> None:
        """An inbound connection was refused at accept (counted; the listener logs, rate-limited)."""
        if self.prometheus is not None:
            self.prometheus.inbound_connection_rejected(reason)

    def h2_goaway(self, reason: str) -> None:
        if self.prometheus is not None:
            self.prometheus.h2_goaway(reason)

    def handshake_abandoned(self, where: str) -> None:
        """A dial's client closed it before its handshake was computed, while it waited ``where``:
        ``accept_queue`` (the kernel's, accepting paused) or ``gate`` (for the event loop)."""
        if self.prometheus is not None:
            self.prometheus.inbound_handshake_abandoned(where)

    def handshake_failed(self, reason: str) -> None:
        """A TLS handshake the gateway began did not complete: ``client_gone`` (the client closed or
        reset meanwhile) or ``refused`` (TLS refused it)."""
        if self.prometheus is not None:
            self.prometheus.inbound_handshake_failed(reason)

    def connection_unused(self) -> None:
        """An inbound connection's client closed it before its first request (a dial not needed)."""
        if self.prometheus is not None:
            self.prometheus.inbound_connection_unused()

    def accept_paused(self, seconds: float) -> None:
        """The listener accepted nothing for ``seconds``: handshakes waited for the event loop."""
        if self.prometheus is not None:
            self.prometheus.inbound_accept_paused(seconds)

    def certificate_reloaded(self, ok: bool) -> None:
        if self.prometheus is not None:
            self.prometheus.certificate_reloaded(ok)

    def gc_collected(self, reason: str, seconds: float) -> None:
        """A full garbage collection (``gateway.server.gcgovernor``) stopped the loop for ``seconds``."""
        if self.prometheus is not None:
            self.prometheus.gc_collected(reason, seconds)

    def set_circuit_source(self, source: Callable[[], Iterable[tuple[str, int, bool]]] | None) -> None:
        """At every scrape, each circuit's state as the guards act on it now (not as last reported)."""
        if self.prometheus is not None:
            self.prometheus.set_circuit_source(source)

    def set_inbound_source(self, source: Callable[[], int] | None) -> None:
        """Export ``source()`` (open inbound connections) at each scrape."""
        if self.prometheus is not None:
            self.prometheus.set_inbound_source(source)


class ConnectionCounts(Protocol):
    """What ``watch_pool`` needs from ``transport.pool.ClientPool``."""

    def open_connections(self) -> Mapping[Any, int]: ...


_INFO: Final = logging.INFO
_WARNING: Final = logging.WARNING
_ERROR: Final = logging.ERROR
