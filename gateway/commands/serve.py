"""``webhook-gateway [serve]``: serve /validate and /mutate in front of the configured backends."""

from __future__ import annotations

import argparse
import errno
import ssl
from collections.abc import Iterator

from gateway.commands.options import Parser, add_option, fail
from gateway.settings import SERVE_DEFAULTS as D
from gateway.settings import ServeSettings

SUMMARY = "serve /validate and /mutate (the default command)"


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
        help="directory of Validating/MutatingWebhookConfiguration and Namespace files",
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


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def startup_failure(exc: BaseException) -> str | None:
    """The one line an expected start-up failure is reported as; None for a defect (re-raised)."""
    from gateway.errors import GatewayError
    from gateway.server.serve import ListenError

    leaves = list(_leaves(exc))
    for leaf in leaves:
        if isinstance(leaf, ListenError):
            return str(leaf)
    for leaf in leaves:
        if isinstance(leaf, GatewayError | ssl.SSLError):
            return str(leaf)
        if isinstance(leaf, OSError):
            where = f"{leaf.filename}: " if leaf.filename else ""
            reason = leaf.strerror or errno.errorcode.get(leaf.errno or 0, "") or str(leaf)
            return f"{where}{reason}"
    return None


def run(options: ServeSettings) -> int:
    """Run the gateway until SIGTERM/SIGINT; exit 2 if the configuration is refused at start-up."""
    from functools import partial

    import trio

    from gateway.errors import ConfigError
    from gateway.observability import Observability, configure_logging
    from gateway.server.serve import serve as run_server

    configure_logging(options.log_level, options.log_format)
    observer = Observability(
        metrics=not options.no_metrics,
        review_log=not options.no_review_log,
        log_bodies=options.log_bodies,
    )
    try:
        trio.run(partial(run_server, options, observer=observer))
    except KeyboardInterrupt:
        return 130
    except ConfigError:
        return 2  # every problem was logged, one line each
    except BaseException as exc:
        if any(isinstance(leaf, ConfigError) for leaf in _leaves(exc)):
            return 2
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in _leaves(exc)):
            return 130
        line = startup_failure(exc)
        if line is None:
            raise
        return fail(line)
    return 0
