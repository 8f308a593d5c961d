"""``webhook-gateway`` / ``python -m gateway``: the only reader of argv and the environment.

Configures logging once, then runs ``serve`` (default), ``check`` or ``demo``.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.errors import GatewayError


def main(argv: Sequence[str] | None = None) -> int:
    from gateway.cli import parse

    invocation = parse(sys.argv[1:] if argv is None else argv)
    if invocation.command == "check":
        return check(invocation.options)
    if invocation.command == "demo":
        from gateway.demo import run_demo

        return run_demo(invocation.options)
    if invocation.command == "registration":
        from gateway.commands.registration import run as run_registration

        return run_registration(invocation.options)
    return serve(invocation.options)


def check(options: Namespace) -> int:
    """Validate a configuration directory: print every problem, exit 1 on errors."""
    from gateway.config.backend_policy import DEFAULT_POLICY
    from gateway.config.load import load_directory
    from gateway.errors import ConfigError

    where = options.config
    try:
        snapshot = load_directory(where, strict_https=options.strict_https)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{problem.severity}: {problem}", file=sys.stderr)
        print(f"{where}: {len(exc.errors)} error(s); configuration refused", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return 1
    for problem in snapshot.warnings:
        print(f"warning: {problem}", file=sys.stderr)
    findings: list[str] = []
    if getattr(options, "registration", None):
        from gateway.commands.registration import registration_findings

        findings = registration_findings(snapshot, options.registration)
        for finding in findings:
            print(f"warning: {finding}", file=sys.stderr)
    print(
        f"{where}: OK: {len(snapshot.validating)} validating and {len(snapshot.mutating)} mutating webhooks, "
        f"{len(snapshot.namespaces)} namespaces, {len(snapshot.warnings)} warning(s)"
    )
    for crd_name, entry in sorted(snapshot.conversions.items()):  # CRD conversion webhooks
        cc = entry.client_config
        target = cc.url or (f"service {cc.service.namespace}/{cc.service.name}" if cc.service else "")
        cache = ", cache on" if entry.cache else ""
        print(
            f"  conversion {crd_name} -> {target} (review versions "
            f"{', '.join(entry.conversion_review_versions)}; timeout {entry.timeout_seconds:g}s{cache})"
        )
    for hook in (*snapshot.validating, *snapshot.mutating):  # webhook-gateway.io/backend-policy in force
        if hook.backend_policy != DEFAULT_POLICY:
            policy = hook.backend_policy.describe()
            print(f"  {hook.kind} webhook {hook.name!r} ({hook.configuration}): {policy}")
    return 1 if (snapshot.warnings or findings) and options.warnings_as_errors else 0


def serve(options: Namespace) -> int:
    """Run the gateway until SIGTERM/SIGINT; exit 2 if the configuration is refused at start-up."""
    from functools import partial

    import structlog
    import trio

    from gateway.errors import ConfigError, GatewayError
    from gateway.observability import Observability, configure_logging
    from gateway.server.workers import supervise, worker_count

    if (workers := worker_count(options)) > 1:
        return supervise(options, workers)  # N worker processes on one socket
    from gateway.server.serve import serve as run_server

    configure_logging(options.log_level, options.log_format)
    observer = Observability(
        metrics=not options.no_metrics,
        review_log=not options.no_review_log,
        log_bodies=options.log_bodies,
    )
    try:
        trio.run(partial(run_server, options, observer=observer))
    except ConfigError:
        return 2
    except KeyboardInterrupt:
        return 130
    except (GatewayError, BaseExceptionGroup) as exc:
        refused = _refusal(exc)
        if refused is None:
            raise
        # A credential file refused at start-up: one line naming file and field, never a traceback.
        structlog.get_logger("gateway").error("start-up refused", error=str(refused))
        return 2
    return 0


def _refusal(exc: BaseException) -> GatewayError | None:
    """The gateway's own error behind ``exc`` when it is the only one (nurseries wrap errors)."""
    from gateway.errors import GatewayError

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, GatewayError) else None


if __name__ == "__main__":
    sys.exit(main())
