"""Secrets out of diagnostics: the one URL redactor, for every message that quotes a URL."""

from __future__ import annotations


def redact_url(url: str) -> str:
    """``url`` with the password of its user information replaced by ``xxxxx`` (Go's URL.Redacted).

    Works on text that does not parse as a URL too (it is used in the errors saying so).
    """
    scheme, slashes, rest = url.partition("//")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    userinfo, at, hostport = rest[:end].rpartition("@")
    if not slashes or not at or ":" not in userinfo:
        return url
    return f"{scheme}//{userinfo.partition(':')[0]}:xxxxx@{hostport}{rest[end:]}"
