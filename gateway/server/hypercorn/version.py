"""Which hypercorn releases this package was verified against, and the start-up check.

Kept apart from the classes so the ``--workers`` supervisor (which never loads hypercorn) can
refuse an unverified release before it starts any worker. Reason: every other module of this
package subclasses hypercorn internals (``TCPServer.run``/``protocol_send``,
``H2Protocol._handle_events``/``_create_stream``/``stream_send``/``_send_data``,
``H11Protocol._handle_events``/``_check_protocol``/``_create_stream``/``_send_h11_event``,
``HTTPStream.handle``/``app_send``/``_send_error_response`` and its scope, ``TaskGroup.spawn_app``,
``ProtocolWrapper``), which hypercorn may change in any release. The same check covers h11, whose
private modules the HTTP/1.1 paths use (``gateway.wire.h11_private``).

Test: tests/test_server_hypercorn.py (an unverified hypercorn or h11 is refused with one line).
"""

from __future__ import annotations

from typing import Final

from gateway.wire.releases import VERIFIED_H11, UnsupportedReleaseError, check_releases, unsupported

__all__ = ["VERIFIED_HYPERCORN", "UnsupportedReleaseError", "check_versions"]

# Another version must be read again (the methods named above) before it is added here.
VERIFIED_HYPERCORN: Final = frozenset({"0.18.0"})


def check_versions(hypercorn: str | None = None, h11: str | None = None) -> None:
    """Refuse to run (one line, no traceback) unless hypercorn and h11 are verified releases.

    The installed versions are read unless given (tests).
    """
    check_releases(
        unsupported("hypercorn", VERIFIED_HYPERCORN, hypercorn),
        unsupported("h11", VERIFIED_H11, h11),
    )
