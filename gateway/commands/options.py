"""Shared option plumbing: every option may also come from a ``WEBHOOK_GATEWAY_*`` variable.

A variable means one thing. ``serve``'s options, and the few options every command that has them
means the same way (``SHARED_OPTIONS``: the gateway's configuration, its paths, the cluster's and the
backends' credentials), read ``WEBHOOK_GATEWAY_<OPTION>``; every other option of a subcommand reads
``WEBHOOK_GATEWAY_<COMMAND>_<OPTION>`` (``--namespace`` of ``audit`` is
``WEBHOOK_GATEWAY_AUDIT_NAMESPACE``), so a variable exported for one command never changes another.
A flag given on the command line wins. ``--help`` shows each option's real default and its variable.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

ENV_PREFIX = "WEBHOOK_GATEWAY_"
PROG = "webhook-gateway"
NO_CONFIG = (
    "no configuration given: pass --config DIR_OR_FILE (or set WEBHOOK_GATEWAY_CONFIG), a directory "
    "or file of Validating/MutatingWebhookConfiguration objects; `webhook-gateway demo --write-samples "
    "DIR` writes a sample one"
)


# Options that mean the same for every command that has them (and read the same variable).
SHARED_OPTIONS = frozenset(
    {
        "--config",  # the gateway's configuration (demo's own --config is a demo configuration)
        "--allow-empty-config",
        "--strict-https",
        "--unknown-namespace",
        "--backend-kubeconfig",
        "--kubeconfig",
        "--deadline-margin",
        "--validate-path",
        "--mutate-path",
        "--log-format",
    }
)


def env_name(option: str, command: str = "serve") -> str:
    """The variable of ``option`` for ``command`` (see the module's docstring)."""
    name = option.lstrip("-").replace("-", "_").upper()
    if command == "serve" or (option in SHARED_OPTIONS and command != "demo"):
        return ENV_PREFIX + name
    return f"{ENV_PREFIX}{command.upper()}_{name}"


def _truthy(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def add_option(
    target: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    help: str,
    shown_default: str | None = None,
    command: str = "serve",
    **kwargs: Any,
) -> None:
    """Add ``flag``; its default comes from its WEBHOOK_GATEWAY_* variable when that is set.

    ``shown_default`` replaces the default in ``--help`` when the real value is computed at run time.
    """
    env = env_name(flag, command)
    kind = kwargs.get("action")
    if env in os.environ:
        raw = os.environ[env]
        if kind == "store_true":
            kwargs["default"] = _truthy(raw)
        elif kind == "append":
            kwargs["default"] = [part for part in raw.split(",") if part]
            kwargs["action"] = _AppendOverridingDefault  # the command line replaces the variable's list
        else:
            try:
                kwargs["default"] = kwargs.get("type", str)(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:  # a usage error, as on the command line
                sys.stderr.write(f"webhook-gateway: error: {env}: {exc}\n")
                raise SystemExit(2) from None
        kwargs.pop("required", None)
    default = kwargs.get("default")
    if shown_default is not None:
        shown = f" (default: {shown_default})"
    elif default in (None, False, [], (), "") or kind == "store_true":
        shown = ""
    else:
        shown = f" (default: {default})"
    target.add_argument(flag, help=f"{help}{shown} [env: {env}]", **kwargs)


class _AppendOverridingDefault(argparse._AppendAction):
    """``append`` whose first value on the command line replaces the default (from a variable)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit 2, like every start-up failure.

    ``prog`` is ``webhook-gateway COMMAND`` (or ``webhook-gateway`` for serve): it names the command
    whose variables the options read.
    """

    @property
    def command(self) -> str:
        parts = self.prog.split()
        return parts[1] if len(parts) > 1 else "serve"

    def add_option(self, flag: str, *, help: str, **kwargs: Any) -> None:
        add_option(self, flag, help=help, command=self.command, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(message: str, code: int = 1) -> int:
    """Print one start-up failure line to stderr and return the exit code."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code
