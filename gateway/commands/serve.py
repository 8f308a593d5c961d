"""``webhook-gateway [serve]``: serve /validate and /mutate in front of the configured backends."""

from __future__ import annotations

import argparse
from pathlib import Path

from gateway.commands.options import NO_CONFIG, Parser, add_option, fail
from gateway.errors import leaves, startup_failure
from gateway.settings import SERVE_DEFAULTS as D
from gateway.settings import ServeSettings

SUMMARY = "serve /validate and /mutate (the default command)"


def _size(text: str) -> int:
    from gateway.server.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cpu_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a share of the CPU is > 0 and <= 1, not {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a rate is a number >= 0, not {text}")
    return value


def build_parser(prog: str, *, usage: str | None = None, epilog: str | None = None) -> Parser:
    p = Parser(
        prog=prog,
        usage=usage,
        description="Serve /validate and /mutate in front of the backend webhooks configured in --config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=epilog,
    )
    g = p.add_argument_group("serving")
    add_option(
        g,
        "--config",
        help="directory or file of Validating/MutatingWebhookConfiguration, Namespace and "
        "CustomResourceDefinition objects (required)",
        default=D.config,
    )
    add_option(g, "--bind", help="HOST:PORT to serve HTTP/1.1 and HTTP/2 on", default=D.bind)
    add_option(
        g, "--certfile", help="serving certificate (PEM); with --keyfile enables TLS (ALPN h2, http/1.1)"
    )
    add_option(g, "--keyfile", help="serving private key (PEM)")
    add_option(
        g, "--client-ca", help="CA bundle (PEM): require and verify client certificates (the apiserver)"
    )
    add_option(g, "--metrics-bind", help="serve /metrics (and /healthz) on a separate plaintext HOST:PORT")
    add_option(g, "--validate-path", help="path of the validating endpoint", default=D.validate_path)
    add_option(g, "--mutate-path", help="path of the mutating endpoint", default=D.mutate_path)
    add_option(
        g,
        "--max-request-bytes",
        help="largest accepted review body (HTTP 413 above)",
        type=int,
        default=D.max_request_bytes,
    )
    add_option(
        g,
        "--drain-seconds",
        help="after SIGTERM: keep serving (readyz 503) this long before closing",
        type=float,
        default=D.drain_seconds,
    )
    add_option(
        g,
        "--shutdown-timeout",
        help="then wait at most this long for in-flight reviews",
        type=float,
        default=D.shutdown_timeout,
    )
    add_option(
        g,
        "--config-poll-seconds",
        help="how often the config directory and TLS files are checked",
        type=float,
        default=D.config_poll_seconds,
    )
    add_option(
        g,
        "--allow-empty-config",
        action="store_true",
        help="accept a configuration with no webhooks (otherwise refused: it would turn every policy off)",
    )
    add_option(
        g,
        "--workers",
        help="worker processes sharing the listening socket (1: a single process, no supervisor)",
        type=int,
        shown_default="one per CPU this process may use, from its CPU affinity and cgroup CPU quota",
    )

    i = p.add_argument_group("inbound connections (docs/inbound.md)")
    add_option(
        i,
        "--header-read-timeout",
        help="close a connection whose request head has not fully arrived this long after it "
        "started (or after the connection opened); seconds",
        type=float,
        default=D.header_read_timeout,
    )
    add_option(
        i,
        "--body-read-timeout",
        help="give up on a request body not fully received this long after its head (and never "
        "later than the caller's ?timeout=); seconds",
        type=float,
        default=D.body_read_timeout,
    )
    add_option(
        i,
        "--idle-timeout",
        help="close a keep-alive connection idle this long (above the apiserver's 90 s); seconds",
        type=float,
        default=D.idle_timeout,
    )
    add_option(
        i,
        "--write-timeout",
        help="close a connection that does not take a reply (TCP or HTTP/2 window) within; seconds",
        type=float,
        default=D.write_timeout,
    )
    add_option(
        i,
        "--handshake-timeout",
        help="reset a connection whose TLS handshake (plaintext: first byte) is not done this long "
        "after it was accepted; seconds",
        type=float,
        default=D.handshake_timeout,
    )
    add_option(
        i,
        "--handshake-burst",
        help="TLS handshakes computed between two moments the event loop has nothing else to run "
        "(per 50 ms while the process uses most of the CPU it may use; established connections "
        "first; the oldest waiting handshake first); 0: no such gate",
        type=int,
        default=D.handshake_burst,
    )
    add_option(
        i,
        "--handshake-rate",
        help="TLS handshakes a second at most, on average (as many at once after a quiet second), for "
        "dials of a client that has a connection idle at the gateway: no review of its waits for them "
        "(dials left over from a burst; e.g. 20); other dials go as --handshake-burst says; 0: no such "
        "bound",
        type=_non_negative_float,
        default=D.handshake_rate,
    )
    add_option(
        i,
        "--max-waiting-handshakes",
        help="stop accepting new connections while this many TLS handshakes wait for the event loop "
        "(behind --handshake-burst): further dials wait in the kernel's accept queue, where they cost "
        "nothing, instead of being reset later; at most half the pending-connection bound; 0: never stop",
        type=int,
        default=D.max_waiting_handshakes,
    )
    add_option(
        i,
        "--max-inbound-connections",
        help="refuse connections beyond this many open ones (0: derived from the memory limit and the "
        "file-descriptor limit minus --fd-reserve)",
        type=int,
        default=D.max_inbound_connections,
    )
    add_option(
        i,
        "--max-pending-connections",
        help="connections whose TLS handshake is not done yet; one more resets the oldest (0: derived, "
        "at most a quarter of the connection bound)",
        type=int,
        default=D.max_pending_connections,
    )
    add_option(
        i,
        "--memory-limit",
        help="the memory the connection bounds are derived from, in bytes or as 256Mi, 1Gi",
        type=_size,
        shown_default="the cgroup's memory.max, or the machine's memory",
    )
    add_option(
        i,
        "--fd-reserve",
        help="file descriptors kept for backend connections and files when "
        "--max-inbound-connections is 0 (at most half the limit)",
        type=int,
        default=D.fd_reserve,
    )
    add_option(
        i,
        "--h2-control-frame-burst",
        help="the per-connection frame budget: tokens for HTTP/2 control frames, small DATA frames and "
        "resets the client makes the gateway send (HTTP/1.1: small chunks), spent at once before GOAWAY "
        "ENHANCE_YOUR_CALM",
        type=int,
        default=D.h2_control_frame_burst,
    )
    add_option(
        i,
        "--h2-control-frame-rate",
        help="and per second after that",
        type=float,
        default=D.h2_control_frame_rate,
    )

    d = p.add_argument_group("dispatch")
    add_option(
        d,
        "--default-timeout",
        help="budget when the caller sends no ?timeout= (seconds)",
        type=float,
        default=D.default_timeout,
    )
    add_option(
        d,
        "--deadline-margin",
        help="answer this many seconds before the caller's timeout",
        type=float,
        default=D.deadline_margin,
    )
    add_option(
        d,
        "--patch-mode",
        help="combined patch: concatenation of backend patches, or a computed diff",
        choices=("concat", "diff"),
        default=D.patch_mode,
    )
    add_option(
        d,
        "--audit-patches",
        help="also return patch.round_<r>_index_<i> audit annotations",
        action="store_true",
    )
    add_option(
        d,
        "--include-virtual-resources",
        action="store_true",
        help="send token/subject-access reviews to backends too (older apiservers did)",
    )
    add_option(
        d,
        "--strict-https",
        action="store_true",
        help="refuse http:// backend URLs even on loopback (upstream's rule)",
    )

    r = p.add_argument_group("overload (docs/resilience.md)")
    add_option(
        r,
        "--shed-max-in-flight",
        type=int,
        help="answer reviews at once, as if every backend had a call error, while this many are in flight",
    )
    add_option(
        r,
        "--shed-max-event-loop-lag",
        type=float,
        help="the same while the event loop runs more than this many seconds late",
    )
    add_option(
        r,
        "--shed-max-cpu",
        type=_cpu_fraction,
        help="the same while the process used this share or more of the CPU it may use over the last "
        "100 ms (its CPU quota's share per worker, at most one CPU; 0.85: 85 percent), before the quota "
        "stalls it",
    )

    t = p.add_argument_group("backends")
    add_option(t, "--backend-kubeconfig", help="kubeconfig-format file with per-host backend credentials")
    add_option(
        t,
        "--max-backend-response-bytes",
        help="largest accepted backend reply",
        type=int,
        default=D.max_backend_response_bytes,
    )
    add_option(
        t,
        "--max-connections-per-backend",
        help="connection pool bound per backend origin",
        type=int,
        default=D.max_connections_per_backend,
    )

    n = p.add_argument_group("namespaces")
    add_option(
        n,
        "--namespace-source",
        choices=("config", "cluster"),
        default=D.namespace_source,
        help="where namespaceSelector labels come from: Namespace objects in --config, or a watch",
    )
    add_option(n, "--kubeconfig", help="kubeconfig for --namespace-source=cluster (default: in-cluster)")
    add_option(
        n,
        "--unknown-namespace",
        choices=("notFound", "emptyLabels"),
        default=D.unknown_namespace,
        help="file mode: a namespace without a Namespace object is 404, or has no labels",
    )

    s = p.add_argument_group("self-managed registration (docs/deploy.md)")
    add_option(
        s,
        "--manage-registration",
        action="store_true",
        help="when ready and elected (a Lease), create and keep the gateway's own registrations "
        "(uses --kubeconfig or the pod's service account)",
    )
    add_option(
        s,
        "--registration-ca-bundle",
        help="CA bundle for the registrations' caBundle (default: ca.crt next to --certfile)",
    )
    add_option(
        s,
        "--registration-namespace",
        help="the gateway's namespace (Service, Lease)",
        default=D.registration_namespace,
    )
    add_option(s, "--registration-service", help="the gateway's Service", default=D.registration_service)

    c = p.add_argument_group("CRD conversion cache (CRDs annotated webhook-gateway.io/conversion-cache)")
    add_option(
        c,
        "--conversion-cache-ttl",
        type=float,
        default=D.conversion_cache_ttl,
        help="seconds a converted object is kept",
    )
    add_option(
        c,
        "--conversion-cache-max-entries",
        type=int,
        default=D.conversion_cache_max_entries,
        help="most converted objects kept",
    )
    add_option(
        c,
        "--conversion-cache-max-bytes",
        type=int,
        default=D.conversion_cache_max_bytes,
        help="most bytes of converted objects kept",
    )

    o = p.add_argument_group("observability")
    add_option(
        o, "--log-level", choices=("debug", "info", "warning", "error"), default=D.log_level, help="log level"
    )
    add_option(o, "--log-format", choices=("json", "console"), default=D.log_format, help="log format")
    add_option(o, "--log-bodies", action="store_true", help="debug: include review bodies in logs")
    add_option(o, "--no-metrics", action="store_true", help="disable Prometheus metrics")
    add_option(o, "--no-review-log", action="store_true", help="disable the per-review canonical log line")
    return p


def settings(options: argparse.Namespace) -> ServeSettings:
    return ServeSettings.from_options(options)


# --- start-up checks: every failure names the file or flag and the fix, as the busy-port message does ---

_CERT = "-----BEGIN CERTIFICATE-----"


def _read(flag: str, path: str, what: str) -> tuple[bytes | None, str | None]:
    try:
        return Path(path).read_bytes(), None
    except IsADirectoryError:
        return None, f"{flag} {path}: is a directory; pass the {what}"
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        return None, f"{flag} {path}: {reason}; pass the {what}"


def _has_key(pem: bytes) -> bool:
    return b"PRIVATE KEY-----" in pem


def _encrypted(pem: bytes) -> bool:
    return b"BEGIN ENCRYPTED PRIVATE KEY" in pem or b"Proc-Type: 4,ENCRYPTED" in pem


def _address_problem(flag: str, address: str | None) -> str | None:
    if address is None:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return f"{flag} {address}: expected HOST:PORT, e.g. 0.0.0.0:8443 or [::]:8443"
    return None


def startup_problem(options: ServeSettings) -> str | None:
    """The one line saying why serve cannot start with these options (files, flags), or None."""
    import os

    for flag, address in (("--bind", options.bind), ("--metrics-bind", options.metrics_bind)):
        if (problem := _address_problem(flag, address)) is not None:
            return problem
    files = [
        (
            "--backend-kubeconfig",
            options.backend_kubeconfig,
            "kubeconfig-format file of the backends' credentials",
        ),
        ("--kubeconfig", options.kubeconfig, "cluster's kubeconfig file"),
        (
            "--registration-ca-bundle",
            options.registration_ca_bundle,
            "PEM file of the registrations' CA bundle",
        ),
    ]
    for flag, path, what in files:
        if path:
            _, problem = _read(flag, path, what)
            if problem:
                return problem
    needs = [f for f, on in (("--namespace-source cluster", options.namespace_source == "cluster"),
                             ("--manage-registration", options.manage_registration)) if on]  # fmt: skip
    if needs and not options.kubeconfig and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return (
            f"{needs[0]}: not running in a cluster (no KUBERNETES_SERVICE_HOST): pass --kubeconfig FILE "
            "to reach a cluster from here"
        )
    return tls_problem(options)


def tls_problem(options: ServeSettings) -> str | None:
    """The one line that says why --certfile/--keyfile/--client-ca cannot serve, or None.

    Checked before anything starts (and before worker processes are forked): the files are read and
    loaded exactly as serving loads them (``gateway.wire.tls.server_context``).
    """
    import ssl

    from gateway.wire.tls import server_context

    if options.keyfile and not options.certfile:
        return f"--keyfile {options.keyfile} given without --certfile: pass the serving certificate too"
    if options.client_ca and not options.certfile:
        return f"--client-ca {options.client_ca} needs TLS: pass --certfile and --keyfile too"
    if not options.certfile:
        return None
    cert, problem = _read("--certfile", options.certfile, "serving certificate's PEM file (e.g. tls.crt)")
    if problem or cert is None:
        return problem
    if _CERT.encode() not in cert:
        return f"--certfile {options.certfile}: no PEM certificate in the file; pass the serving certificate"
    keyfile = options.keyfile or options.certfile
    if options.keyfile:
        key, problem = _read("--keyfile", options.keyfile, "serving private key's PEM file (e.g. tls.key)")
        if problem or key is None:
            return problem
        if not _has_key(key):
            return f"--keyfile {options.keyfile}: no PEM private key in the file; pass the certificate's key"
    elif not _has_key(cert):
        return (
            f"--certfile {options.certfile} holds no private key: pass the key file with --keyfile "
            "(e.g. tls.key next to tls.crt)"
        )
    else:
        key = cert
    flag = "--keyfile" if options.keyfile else "--certfile"
    if _encrypted(key):
        return (
            f"{flag} {keyfile}: the private key is encrypted; pass it unencrypted, as a TLS Secret holds it"
        )
    if options.client_ca:
        ca, problem = _read(
            "--client-ca",
            options.client_ca,
            "PEM file of the CA bundle the clients' certificates are checked with",
        )
        if problem or ca is None:
            return problem
        if _CERT.encode() not in ca:
            return f"--client-ca {options.client_ca}: no PEM certificate in the file; pass the clients' CA"
    try:
        server_context(options.certfile, keyfile, client_ca=options.client_ca)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or exc.reason == "KEY_VALUES_MISMATCH":
            return (
                f"--keyfile {keyfile} does not match --certfile {options.certfile}: pass the private key of "
                "this certificate (tls.key and tls.crt of the same Secret)"
            )
        which = f"--certfile {options.certfile}" + (
            f" / --keyfile {options.keyfile}" if options.keyfile else ""
        )
        return f"{which}: cannot be used for TLS ({exc.reason or exc}); pass a PEM certificate and its key"
    except OSError as exc:  # read again between the checks above and now
        return f"--certfile {options.certfile}: {(exc.strerror or str(exc)).lower()}"
    return None


def run(options: ServeSettings) -> int:
    """Run the gateway until SIGTERM/SIGINT; exit 2 if the configuration is refused at start-up."""
    from functools import partial

    import trio

    from gateway.errors import ConfigError, GatewayError
    from gateway.observability import Observability, configure_logging, count_dropped_lines
    from gateway.server.workers import supervise, worker_count

    if options.workers is not None and options.workers < 0:
        return fail(f"--workers: {options.workers} is not a number of processes (0: one per CPU)", 2)
    if not options.config:
        return fail(NO_CONFIG, 2)
    if (problem := startup_problem(options)) is not None:
        return fail(problem)
    if (workers := worker_count(options)) > 1:
        from gateway.server.hypercorn.version import check_versions

        check_versions()  # before any worker starts: one line, as a single process says it
        try:
            return supervise(options, workers)  # N worker processes on one listening socket
        except GatewayError as exc:  # cannot listen: one line, as for a single process
            return fail(str(exc))
    from gateway.server.serve import serve as run_server

    # Lines leave the event loop through memory and a writer thread: a stdout nobody reads must not
    # stop reviews (observability/logsink.py).
    configure_logging(options.log_level, options.log_format, background=True)
    observer = Observability(
        metrics=not options.no_metrics,
        review_log=not options.no_review_log,
        log_bodies=options.log_bodies,
    )
    if observer.prometheus is not None:
        count_dropped_lines(observer.prometheus.log_lines_dropped.labels().inc)
    try:
        trio.run(partial(run_server, options, observer=observer))
    except KeyboardInterrupt:
        return 130
    except ConfigError:
        return 2  # every problem was logged, one line each
    except BaseException as exc:
        if any(isinstance(leaf, ConfigError) for leaf in leaves(exc)):
            return 2
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves(exc)):
            return 130
        line = startup_failure(exc)
        if line is None:
            raise
        return fail(line)
    return 0
