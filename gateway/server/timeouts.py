"""The caller's ``?timeout=`` parameter (FPT-07): Go duration syntax → seconds."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Final
from urllib.parse import parse_qsl

_UNITS: Final = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_go_duration(text: str) -> float | None:
    """Seconds for a Go duration such as ``10s``, ``1m0s``, ``1.5s``, ``500ms``; None if unparseable.

    Negative durations are not meaningful for a timeout and are refused too.
    """
    text = text.strip()
    if not text:
        return None
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(text):
        m = _PART.match(text, pos)
        if m is None:
            return None
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    return total


@lru_cache(maxsize=256)
def caller_timeout(query_string: bytes) -> float | None:
    """The positive ``?timeout=`` of a request's query string in seconds, or None (missing or unusable).

    Memoised: kube-apiserver sends the same query string (``timeout=10s``) on every call, and
    parsing it cost ~6 µs each time, twice per review (body deadline, dispatch budget). The memo
    holds only query strings and numbers, bounded, so a caller sending a new one per request costs
    the parse, never memory.
    """
    if not query_string:
        return None
    for key, value in parse_qsl(query_string.decode("latin-1")):
        if key == "timeout":
            seconds = parse_go_duration(value)
            return seconds if seconds is not None and seconds > 0 else None
    return None
