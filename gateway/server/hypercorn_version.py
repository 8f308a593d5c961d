"""Which hypercorn releases the patches in ``hypercorn_fixes`` were verified against.

Kept apart from the patches so the ``--workers`` supervisor (which never loads hypercorn) can refuse
an unverified release before it starts any worker.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Final

__all__ = ["VERIFIED_HYPERCORN", "UnsupportedHypercornError", "check_version"]

# The hypercorn releases whose internals (TCPServer.run/protocol_send, H2Protocol._handle_events/
# stream_send/_send_data, H11Protocol._handle_events/_check_protocol/_create_stream/_send_h11_event/
# _maybe_recycle, TaskGroup.spawn_app, HTTPStream.handle/app_send/_send_error_response and its scope)
# were read and tested against. Another version must be read again before it is added here. The
# HTTP/1.1 patches also build h11's own header list (h11._headers.Headers), which pyproject.toml
# pins to h11 0.16.x for that reason.
VERIFIED_HYPERCORN: Final = frozenset({"0.18.0"})


class UnsupportedHypercornError(SystemExit):
    """The installed hypercorn is not one whose internals the patches were verified against."""


def check_version(installed: str | None = None) -> None:
    """Refuse to run (one line, no traceback) unless hypercorn's version is a verified one."""
    if installed is None:
        try:
            installed = package_version("hypercorn")
        except PackageNotFoundError:
            installed = "unknown"
    if installed not in VERIFIED_HYPERCORN:
        raise UnsupportedHypercornError(
            f"webhook-gateway: hypercorn {installed} is not supported (verified: "
            f"{', '.join(sorted(VERIFIED_HYPERCORN))}); install a verified version"
        )
