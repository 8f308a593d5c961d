"""The dependency releases whose private internals the gateway uses, and the one check of them.

Two libraries are used below their public API, each for a measured reason: h11 (its header grammar
and its header list: ``gateway.wire.h11_private``) and hypercorn (its protocol classes:
``gateway.server.hypercorn``). A release is added to its list only after those internals were read
again and the byte-level tests passed against it. pyproject.toml's version ranges say what pip
may install; this check says what the gateway agrees to run with, and refuses anything else at
start-up with one line that names the installed and the verified versions.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Final

__all__ = ["VERIFIED_H11", "UnsupportedReleaseError", "check_releases", "unsupported"]

# h11's private ``_abnf`` (the request-line, status-line and header-field expressions) and
# ``_headers.Headers`` (its header list, built directly on the server's reply path).
VERIFIED_H11: Final = frozenset({"0.16.0"})


class UnsupportedReleaseError(SystemExit):
    """An installed library is not a release whose internals the gateway was verified against."""


def unsupported(package: str, verified: frozenset[str], installed: str | None = None) -> str | None:
    """Why ``package`` cannot be used (one phrase naming the versions), or None when it can."""
    if installed is None:
        try:
            installed = package_version(package)
        except PackageNotFoundError:
            installed = "unknown"
    if installed in verified:
        return None
    return f"{package} {installed} is not supported (verified: {', '.join(sorted(verified))})"


def check_releases(*problems: str | None) -> None:
    """Refuse to run (one line, no traceback) when any of ``problems`` (from ``unsupported``) is set."""
    found = [problem for problem in problems if problem]
    if found:
        raise UnsupportedReleaseError(f"webhook-gateway: {'; '.join(found)}; install a verified version")
