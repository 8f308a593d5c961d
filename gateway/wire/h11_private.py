"""h11's private pieces the gateway uses, imported in this one place behind a version check.

- ``h11._abnf``: the request-line, status-line and header-field expressions h11 matches heads
  against. The HTTP/1.1 fast paths (``gateway.server.http11_fast`` for the inbound side,
  ``gateway.wire.http11_plain`` for backend calls) take only what h11's own grammar takes, so that
  they are a verified shortcut and not a second parser (measured: docs/performance.md).
- ``h11._headers.Headers``: h11's header list, built directly on the server's reply path
  (``gateway.server.hypercorn.http11``) instead of through h11's normalising pass (about 30 µs per
  review with the head written together with its body; docs/performance.md).

Both are private to h11, so they are imported only after the installed h11 has been checked
against the releases they were read in (``gateway.wire.releases.VERIFIED_H11``): another release
refuses to start with one line naming the versions instead of behaving differently.
"""

from __future__ import annotations

from gateway.wire.releases import VERIFIED_H11, check_releases, unsupported

check_releases(unsupported("h11", VERIFIED_H11))

from h11._abnf import (  # noqa: E402 - only after the version check above
    field_name,
    field_value,
    header_field,
    request_line,
    request_target,
    status_line,
)
from h11._headers import Headers  # noqa: E402 - only after the version check above

__all__ = [
    "Headers",
    "field_name",
    "field_value",
    "header_field",
    "request_line",
    "request_target",
    "status_line",
]
