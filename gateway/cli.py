"""Command-line options: every option also comes from an environment variable.

``webhook-gateway [serve] --config DIR --bind HOST:PORT ...`` serves; ``check`` validates a
configuration directory; ``demo`` runs the bundled end-to-end demonstration. The environment
variable of ``--some-option`` is ``WEBHOOK_GATEWAY_SOME_OPTION``; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "WEBHOOK_GATEWAY_"
COMMANDS = ("serve", "check", "demo", "registration")


def _env_name(option: str) -> str:
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def _add_option(
    target: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, *, help: str, **kwargs: Any
) -> None:
    """Add ``flag``; its default comes from its WEBHOOK_GATEWAY_* variable when that is set."""
    env = _env_name(flag)
    kind = kwargs.get("action")
    if env in os.environ:
        raw = os.environ[env]
        if kind == "store_true":
            kwargs["default"] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            kwargs["default"] = kwargs.get("type", str)(raw)
        kwargs.pop("required", None)
    default = kwargs.get("default")
    shown = "" if default in (None, False) or kind == "store_true" else f" (default: {default})"
    target.add_argument(flag, help=f"{help}{shown} [env: {env}]", **kwargs)


class _EnvDefaults(argparse.ArgumentParser):
    """An ArgumentParser whose option defaults come from WEBHOOK_GATEWAY_* variables."""

    def add_option(self, flag: str, *, help: str, **kwargs: Any) -> None:
        _add_option(self, flag, help=help, **kwargs)


def _serve_parser(prog: str) -> _EnvDefaults:
    p = _EnvDefaults(
        prog=prog,
        description="Serve /validate and /mutate in front of the backend webhooks configured in --config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Subcommands: `check --config DIR` validates a configuration directory; `demo` runs the "
        "bundled end-to-end demonstration.",
    )
    from gateway import __version__

    p.add_argument("--version", action="version", version=f"webhook-gateway {__version__}")
    g = p.add_argument_group("serving")
    _add_option(
        g,
        "--config",
        help="directory of Validating/MutatingWebhookConfiguration and Namespace files",
        default="config/webhooks",
    )
    _add_option(g, "--bind", help="HOST:PORT to serve HTTP/1.1 and HTTP/2 on", default="127.0.0.1:8443")
    _add_option(
        g, "--certfile", help="serving certificate (PEM); with --keyfile enables TLS (ALPN h2, http/1.1)"
    )
    _add_option(g, "--keyfile", help="serving private key (PEM)")
    _add_option(
        g, "--client-ca", help="CA bundle (PEM): require and verify client certificates (the apiserver)"
    )
    _add_option(g, "--metrics-bind", help="serve /metrics (and /healthz) on a separate plaintext HOST:PORT")
    _add_option(g, "--validate-path", help="path of the validating endpoint", default="/validate")
    _add_option(g, "--mutate-path", help="path of the mutating endpoint", default="/mutate")
    _add_option(
        g,
        "--max-request-bytes",
        help="largest accepted review body (HTTP 413 above)",
        type=int,
        default=32 * 1024 * 1024,
    )
    _add_option(
        g,
        "--drain-seconds",
        help="after SIGTERM: keep serving (readyz 503) this long before closing",
        type=float,
        default=5.0,
    )
    _add_option(
        g,
        "--shutdown-timeout",
        help="then wait at most this long for in-flight reviews",
        type=float,
        default=30.0,
    )
    _add_option(
        g,
        "--workers",
        help="worker processes sharing the listening socket (default: one per CPU this process may "
        "use, from its CPU affinity and cgroup CPU quota; 1: a single process, no supervisor)",
        type=int,
    )
    _add_option(
        g,
        "--config-poll-seconds",
        help="how often the config directory and TLS files are checked",
        type=float,
        default=2.0,
    )

    i = p.add_argument_group("inbound connections (docs/inbound.md)")
    _add_option(
        i,
        "--header-read-timeout",
        help="close a connection whose request head has not fully arrived this long after it "
        "started (or after the connection opened); seconds",
        type=float,
        default=10.0,
    )
    _add_option(
        i,
        "--body-read-timeout",
        help="give up on a request body not fully received this long after its head (and never "
        "later than the caller's ?timeout=); seconds",
        type=float,
        default=10.0,
    )
    _add_option(
        i,
        "--idle-timeout",
        help="close a keep-alive connection idle this long (above the apiserver's 90 s); seconds",
        type=float,
        default=120.0,
    )
    _add_option(
        i,
        "--write-timeout",
        help="close a connection that does not take a reply (TCP or HTTP/2 window) within; seconds",
        type=float,
        default=10.0,
    )
    _add_option(
        i,
        "--max-inbound-connections",
        help="refuse connections beyond this many open ones (0: the file-descriptor limit minus "
        "--fd-reserve, at most 4096)",
        type=int,
        default=0,
    )
    _add_option(
        i,
        "--fd-reserve",
        help="file descriptors kept for backend connections and files when "
        "--max-inbound-connections is 0 (at most half the limit)",
        type=int,
        default=512,
    )
    _add_option(
        i,
        "--h2-control-frame-burst",
        help="HTTP/2 control frames (SETTINGS, PING, RST_STREAM, WINDOW_UPDATE, PRIORITY, "
        "CONTINUATION, empty DATA) a connection may send at once before GOAWAY ENHANCE_YOUR_CALM",
        type=int,
        default=1000,
    )
    _add_option(
        i,
        "--h2-control-frame-rate",
        help="and per second after that",
        type=float,
        default=100.0,
    )

    d = p.add_argument_group("dispatch")
    _add_option(
        d,
        "--default-timeout",
        help="budget when the caller sends no ?timeout= (seconds)",
        type=float,
        default=10.0,
    )
    _add_option(
        d,
        "--deadline-margin",
        help="answer this many seconds before the caller's timeout",
        type=float,
        default=0.2,
    )
    _add_option(
        d,
        "--patch-mode",
        help="combined patch: concatenation of backend patches, or a computed diff",
        choices=("concat", "diff"),
        default="concat",
    )
    _add_option(
        d,
        "--audit-patches",
        help="also return patch.round_<r>_index_<i> audit annotations",
        action="store_true",
    )
    _add_option(
        d,
        "--include-virtual-resources",
        action="store_true",
        help="send token/subject-access reviews to backends too (older apiservers did)",
    )
    _add_option(
        d,
        "--strict-https",
        action="store_true",
        help="refuse http:// backend URLs even on loopback (upstream's rule)",
    )

    t = p.add_argument_group("backends")
    _add_option(t, "--backend-kubeconfig", help="kubeconfig-format file with per-host backend credentials")
    _add_option(
        t,
        "--max-backend-response-bytes",
        help="largest accepted backend reply",
        type=int,
        default=16 * 1024 * 1024,
    )
    _add_option(
        t,
        "--max-connections-per-backend",
        help="connection pool bound per backend origin",
        type=int,
        default=64,
    )

    r = p.add_argument_group("overload")
    _add_option(
        r,
        "--shed-max-in-flight",
        type=int,
        help="answer reviews at once, as if every backend had a call error, while this many are in flight",
    )
    _add_option(
        r,
        "--shed-max-event-loop-lag",
        type=float,
        help="the same while the event loop runs more than this many seconds late",
    )

    n = p.add_argument_group("namespaces")
    _add_option(
        n,
        "--namespace-source",
        choices=("config", "cluster"),
        default="config",
        help="where namespaceSelector labels come from: Namespace objects in --config, or a watch",
    )
    _add_option(n, "--kubeconfig", help="kubeconfig for --namespace-source=cluster (default: in-cluster)")
    _add_option(
        n,
        "--unknown-namespace",
        choices=("notFound", "emptyLabels"),
        default="notFound",
        help="file mode: a namespace without a Namespace object is 404, or has no labels",
    )

    r = p.add_argument_group("self-managed registration")
    _add_option(
        r,
        "--manage-registration",
        action="store_true",
        help="when ready and elected (a Lease), create and keep the gateway's own registrations "
        "(uses --kubeconfig or the pod's service account)",
    )
    _add_option(
        r,
        "--registration-ca-bundle",
        help="CA bundle for the registrations' caBundle (default: ca.crt next to --certfile)",
    )
    _add_option(
        r,
        "--registration-namespace",
        help="the gateway's namespace (Service, Lease)",
        default="webhook-gateway",
    )
    _add_option(r, "--registration-service", help="the gateway's Service", default="webhook-gateway")

    o = p.add_argument_group("observability")
    _add_option(
        o, "--log-level", choices=("debug", "info", "warning", "error"), default="info", help="log level"
    )
    _add_option(o, "--log-format", choices=("json", "console"), default="json", help="log format")
    _add_option(o, "--log-bodies", action="store_true", help="debug: include review bodies in logs")
    _add_option(o, "--no-metrics", action="store_true", help="disable Prometheus metrics")
    _add_option(o, "--no-review-log", action="store_true", help="disable the per-review canonical log line")

    c = p.add_argument_group("CRD conversion cache (CRDs annotated webhook-gateway.io/conversion-cache)")
    _add_option(
        c, "--conversion-cache-ttl", type=float, default=300.0, help="seconds a converted object is kept"
    )
    _add_option(
        c, "--conversion-cache-max-entries", type=int, default=10_000, help="most converted objects kept"
    )
    _add_option(
        c,
        "--conversion-cache-max-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="most bytes of converted objects kept",
    )
    return p


@dataclass(frozen=True)
class Invocation:
    command: str
    options: argparse.Namespace


def parse(argv: Sequence[str], prog: str = "webhook-gateway") -> Invocation:
    """Parse argv (without the program name) into a command and its options."""
    args = list(argv)
    command = "serve"
    if args and args[0] in COMMANDS:
        command = args.pop(0)
    if command == "check":
        p = _EnvDefaults(
            prog=f"{prog} check",
            description="Validate a configuration directory; exit 1 and print every problem.",
        )
        p.add_option("--config", help="configuration directory", default="config/webhooks")
        p.add_option("--strict-https", action="store_true", help="refuse http:// URLs even on loopback")
        p.add_option("--warnings-as-errors", action="store_true", help="exit 1 on warnings too")
        p.add_option(
            "--registration",
            help="also warn where this registration file is broader or stricter than the config needs",
        )
        return Invocation(command, p.parse_args(args))
    if command == "registration":
        return Invocation(command, _registration_parser(prog).parse_args(args))
    if command == "demo":
        p = _EnvDefaults(
            prog=f"{prog} demo",
            description="Start sample backends and the gateway, send reviews, print decisions.",
        )
        p.add_option("--config", help="demo configuration directory", default="")
        p.add_option(
            "--log-format", choices=("json", "console"), default="console", help="gateway log format"
        )
        return Invocation(command, p.parse_args(args))
    return Invocation(command, _serve_parser(prog).parse_args(args))


def _registration_parser(prog: str) -> _EnvDefaults:
    p = _EnvDefaults(
        prog=f"{prog} registration",
        description="Print the narrowest Validating/MutatingWebhookConfiguration pair that delivers every "
        "review some backend in --config could match, minus cluster infrastructure.",
    )
    p.add_option("--config", help="configuration directory", default="config/webhooks")
    p.add_option("--name", help="name of both registration objects", default="webhook-gateway")
    p.add_option(
        "--namespace", help="the gateway's own namespace (always excluded)", default="webhook-gateway"
    )
    p.add_option("--service", help="the gateway's Service", default="webhook-gateway")
    p.add_option("--port", help="the Service port", type=int, default=443)
    p.add_option("--validate-path", help="path of the validating endpoint", default="/validate")
    p.add_option("--mutate-path", help="path of the mutating endpoint", default="/mutate")
    p.add_option("--ca-bundle", help="PEM file of the CA that signed the serving certificate (caBundle)")
    p.add_option(
        "--failure-policy",
        choices=("Fail", "Ignore"),
        default="Fail",
        help="what the apiserver does when no gateway replica answers",
    )
    p.add_option(
        "--deadline-margin",
        help="the gateway's --deadline-margin (added to the backends' budget)",
        type=float,
        default=0.2,
    )
    p.add_option("--exclude-namespaces", help="comma-separated namespaces to exclude as well")
    p.add_option(
        "--include-namespaces", help="comma-separated namespaces to deliver despite the default exclusions"
    )
    p.add_option(
        "--exclude-resources", help="comma-separated RESOURCE[.GROUP] to exclude as well (all subresources)"
    )
    p.add_option(
        "--include-resources",
        help="comma-separated RESOURCE[.GROUP] to deliver despite the default exclusions, e.g. events",
    )
    p.add_option(
        "--no-default-exclusions",
        action="store_true",
        help="exclude nothing by default (not even the gateway's own namespace): unsafe",
    )
    p.add_option("--output", choices=("yaml", "json"), default="yaml", help="output format")
    return p
