"""``webhook-gateway`` / ``python -m gateway``: the only reader of argv and the environment.

Configures logging once, then runs ``serve`` (default), ``check`` or ``demo``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from gateway.cli import parse

    invocation = parse(sys.argv[1:] if argv is None else argv)
    if invocation.command == "check":
        return check(invocation.options)
    if invocation.command == "demo":
        from gateway.demo import run_demo

        return run_demo(invocation.options)
    return serve(invocation.options)


def check(options: object) -> int:
    """Validate a configuration directory: print every problem, exit 1 on errors."""
    from gateway.config.load import load_directory
    from gateway.errors import ConfigError

    try:
        snapshot = load_directory(options.config, strict_https=options.strict_https)  # type: ignore[attr-defined]
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{problem.severity}: {problem}", file=sys.stderr)
        errors = len(exc.errors)
        print(f"{options.config}: {errors} error(s); configuration refused", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    except OSError as exc:
        print(f"{options.config}: {exc}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    for problem in snapshot.warnings:
        print(f"warning: {problem}", file=sys.stderr)
    print(
        f"{options.config}: OK: {len(snapshot.validating)} validating and {len(snapshot.mutating)} mutating "  # type: ignore[attr-defined]
        f"webhooks, {len(snapshot.namespaces)} namespaces, {len(snapshot.warnings)} warning(s)"
    )
    if snapshot.warnings and options.warnings_as_errors:  # type: ignore[attr-defined]
        return 1
    return 0


def serve(options: object) -> int:
    import trio

    from gateway.errors import ConfigError
    from gateway.observability import Observability, configure_logging
    from gateway.server.serve import serve as run_server

    configure_logging(options.log_level, options.log_format)  # type: ignore[attr-defined]
    observer = Observability(
        metrics=not options.no_metrics,  # type: ignore[attr-defined]
        review_log=not options.no_review_log,  # type: ignore[attr-defined]
        log_bodies=options.log_bodies,  # type: ignore[attr-defined]
    )
    try:
        trio.run(run_server, options, observer)
    except ConfigError:
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
