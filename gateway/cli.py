"""The command line: ``webhook-gateway [COMMAND] [OPTIONS]`` — parse, then hand over to one command.

Each subcommand lives in ``gateway.commands.<name>`` with ``SUMMARY``, ``build_parser(prog)``,
``settings(namespace)`` (a typed, frozen value) and ``run(settings) -> exit code``. Without a command,
``serve`` runs. Every option may also come from ``WEBHOOK_GATEWAY_<OPTION>`` (the command line wins).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module
from types import ModuleType
from typing import Any

from gateway import __version__
from gateway.commands.options import PROG, env_name

COMMANDS = ("serve", "check", "demo", "explain", "audit", "registration")

__all__ = ["COMMANDS", "Invocation", "env_name", "main", "parse"]


def _command(name: str) -> ModuleType:
    return import_module(f"gateway.commands.{name}")


def usage(prog: str = PROG) -> str:
    return f"{prog} [{'|'.join(COMMANDS)}] [OPTIONS]   ({prog} COMMAND --help for a command's options)"


def _epilog(prog: str) -> str:
    lines = ["commands:"]
    lines += [f"  {name:<8} {_command(name).SUMMARY}" for name in COMMANDS]
    lines.append(f"\n{prog} --version prints the version. Every option also reads WEBHOOK_GATEWAY_<OPTION>.")
    return "\n".join(lines)


@dataclass(frozen=True)
class Invocation:
    command: str
    options: Any  # the command's frozen settings (``ServeSettings`` for serve)


def parse(argv: Sequence[str], prog: str = PROG) -> Invocation:
    """Parse argv (without the program name) into a command and its settings."""
    args = list(argv)
    command = "serve"
    if args and args[0] in COMMANDS:
        command = args.pop(0)
    elif args and not args[0].startswith("-"):
        sys.stderr.write(
            f"{prog}: error: unknown command {args[0]!r}; the commands are {', '.join(COMMANDS)} "
            f"(see {prog} --help)\n"
        )
        raise SystemExit(2)
    module = _command(command)
    if command == "serve":
        parser = module.build_parser(
            prog if not argv or argv[0] != "serve" else f"{prog} serve",
            usage=usage(prog),
            epilog=_epilog(prog),
        )
    else:
        parser = module.build_parser(f"{prog} {command}")
    parser.add_argument("--version", action="version", version=f"{prog} {__version__}")
    return Invocation(command, module.settings(parser.parse_args(args)))


def main(argv: Sequence[str] | None = None) -> int:
    invocation = parse(sys.argv[1:] if argv is None else argv)
    code: int = _command(invocation.command).run(invocation.options)
    return code
