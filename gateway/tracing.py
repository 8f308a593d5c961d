"""W3C trace context (``traceparent``): honour the caller's, send one child context per backend call.

The server stores the inbound context in a contextvar; trio copies contextvars into child tasks, so
every backend call of the review sees it and the transport adds a fresh child ``traceparent``.
Only the header is propagated; exporting spans is left to a future OpenTelemetry integration.
"""

from __future__ import annotations

import contextvars
import random
import re
from typing import Final

_TRACEPARENT: Final = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

current_trace: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "current_trace", default=None
)  # (trace_id, flags) of the review being handled


def parse_traceparent(value: str) -> tuple[str, str, str] | None:
    """(trace_id, parent_id, flags) of a valid version-00 ``traceparent``, else None."""
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "ff" or set(m.group(2)) == {"0"} or set(m.group(3)) == {"0"}:
        return None
    return m.group(2), m.group(3), m.group(4)


def start_review_trace(inbound_header: str) -> str:
    """Bind the review's trace (the caller's, or a new one) to this context; returns the trace id."""
    parsed = parse_traceparent(inbound_header) if inbound_header else None
    if parsed is None:
        trace_id, flags = f"{_bits(128) or 1:032x}", "00"
    else:
        trace_id, _, flags = parsed
    current_trace.set((trace_id, flags))
    return trace_id


def child_traceparent() -> str | None:
    """A new ``traceparent`` for one outbound call, child of the current review's trace."""
    trace = current_trace.get()
    if trace is None:
        return None
    return f"00-{trace[0]}-{_bits(64) or 1:016x}-{trace[1]}"


# Trace and span ids: random non-zero numbers as lowercase hex (all-zero ids are invalid in W3C
# trace context). They need to be unique, not secret: ``random`` (as OpenTelemetry's own id
# generator does) avoids a ``getrandom`` system call per id.
_bits: Final = random.getrandbits
