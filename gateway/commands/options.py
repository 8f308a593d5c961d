"""Shared option plumbing: every option may also come from a ``WEBHOOK_GATEWAY_*`` variable.

The environment variable of ``--some-option`` is ``WEBHOOK_GATEWAY_SOME_OPTION``; a flag given on the
command line wins. ``--help`` shows each option's real default and its variable.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

ENV_PREFIX = "WEBHOOK_GATEWAY_"
PROG = "webhook-gateway"


def env_name(option: str) -> str:
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def _truthy(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def add_option(
    target: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    help: str,
    shown_default: str | None = None,
    **kwargs: Any,
) -> None:
    """Add ``flag``; its default comes from its WEBHOOK_GATEWAY_* variable when that is set.

    ``shown_default`` replaces the default in ``--help`` when the real value is computed at run time.
    """
    env = env_name(flag)
    kind = kwargs.get("action")
    if env in os.environ:
        raw = os.environ[env]
        if kind == "store_true":
            kwargs["default"] = _truthy(raw)
        elif kind == "append":
            kwargs["default"] = [part for part in raw.split(",") if part]
        else:
            kwargs["default"] = kwargs.get("type", str)(raw)
        kwargs.pop("required", None)
    default = kwargs.get("default")
    if shown_default is not None:
        shown = f" (default: {shown_default})"
    elif default in (None, False, [], ()) or kind == "store_true":
        shown = ""
    else:
        shown = f" (default: {default})"
    target.add_argument(flag, help=f"{help}{shown} [env: {env}]", **kwargs)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit 2, like every start-up failure."""

    def add_option(self, flag: str, *, help: str, **kwargs: Any) -> None:
        add_option(self, flag, help=help, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(message: str, code: int = 1) -> int:
    """Print one start-up failure line to stderr and return the exit code."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code
