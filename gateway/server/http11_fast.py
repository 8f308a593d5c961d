"""The common HTTP/1.1 exchange without h11's state machine: a plain request head, a whole reply.

kube-apiserver calls a webhook with one POST at a time on a keep-alive connection: one head with
``Host``, ``Content-Length`` and a handful of ordinary headers, then the body. For that shape h11
builds and validates three event objects and walks its state machine twice per direction, about
45 µs of a request/response cycle (docs/performance.md). This module reads such a head and frames
such a reply directly, and gives up (``None``) on anything else, which h11 then handles as before.

It is a verified shortcut, not a second HTTP parser: a head is taken only if h11 would take it the
same way. The grammar is h11's own (its request-line and header-field expressions, matched whole;
the header lines as one block), and every shape whose meaning h11 decides with state of its own is
left to h11: another HTTP version, a method other than GET or POST, ``Transfer-Encoding``,
``Expect``, ``Upgrade``, a ``Connection`` header other than ``keep-alive``, more or less than one
``Host``, more than one ``Content-Length`` or one with a list, bare LF line ends, folded lines,
and bytes after the body (a pipelined request). A reply is framed only with exactly one
``Content-Length`` that is its body's length, and comes out byte for byte as h11 would write it.
tests/test_server_http11_fast.py checks both against h11 itself, on tables and on generated input.

Sans-IO: no sockets, no trio; ``GatewayH11Protocol`` (``gateway.server.hypercorn.http11``) drives it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final, NamedTuple

from gateway.wire.h11_private import header_field, request_line  # h11's grammar (version-checked)

Header = tuple[bytes, bytes]

_REQUEST_LINE: Final = re.compile(request_line.encode("ascii"))
# Every header line at once: one match in C instead of one per line (h11 matches them one by one).
_HEADER_BLOCK: Final = re.compile(b"(?:" + header_field.encode("ascii") + b"\r\n)*")
_DIGITS: Final = re.compile(rb"[0-9]{1,18}")  # h11 refuses more than 20 digits; 18 fit an int64

_METHODS: Final = frozenset({b"GET", b"POST"})
# Headers whose presence (or value) makes h11 keep per-message state of its own.
_LEFT_TO_H11: Final = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"te"})

# Reply headers h11 does not write as given: it rewrites framing and writes Host first.
_REWRITTEN_BY_H11: Final = frozenset({b"transfer-encoding", b"host"})

_END_OF_HEAD: Final = b"\r\n\r\n"


class PlainRequest(NamedTuple):
    """A parsed plain request head and the body bytes that came with it."""

    method: bytes
    target: bytes
    headers: list[Header]  # names lower-cased (what h11 iterates as)
    raw_headers: list[Header]  # names as sent (h11's raw_items)
    body: bytes  # the body bytes that came with the head
    body_left: int  # body bytes still to come


def parse_plain_request(data: bytes) -> PlainRequest | None:
    """The request in ``data`` when it is a plain one starting at byte 0, else None (ask h11).

    ``data`` must hold the whole head; the body may be partial (``body_left``), never longer.
    """
    end = data.find(_END_OF_HEAD)
    if end < 0:
        return None
    first = data.find(b"\r\n")
    line = _REQUEST_LINE.fullmatch(data, 0, first)
    if line is None or line["http_version"] != b"1.1":
        return None
    method = line["method"]
    if method not in _METHODS:
        return None
    # The header lines, each with its CRLF; a folded line or a bare LF does not match.
    if _HEADER_BLOCK.fullmatch(data, first + 2, end + 2) is None:
        return None
    headers: list[Header] = []
    raw_headers: list[Header] = []
    length = -1
    hosts = 0
    for text in data[first + 2 : end].split(b"\r\n") if end > first else ():
        # The grammar matched: the name ends at the first colon, the value is the rest without the
        # spaces and tabs around it.
        raw_name, _, value = text.partition(b":")
        value = value.strip(b" \t")
        name = raw_name.lower()
        if name == b"content-length":
            if length >= 0 or _DIGITS.fullmatch(value) is None:
                return None
            length = int(value)
        elif name == b"host":
            hosts += 1
        elif name == b"connection":
            if value.lower() != b"keep-alive":
                return None
        elif name in _LEFT_TO_H11:
            return None
        headers.append((name, value))
        raw_headers.append((raw_name, value))
    if hosts != 1:
        return None
    body = data[end + 4 :]
    body_left = max(length, 0) - len(body)
    if body_left < 0:  # bytes after the body: a pipelined request, h11 queues it
        return None
    return PlainRequest(method, line["target"], headers, raw_headers, body, body_left)


def framing_error(method: bytes, target: bytes, http_version: bytes, headers: Iterable[Header]) -> int:
    """The status a request head that h11 accepted must still be refused with (0: none).

    The caller answers it and closes the connection: after faulty framing the bytes that follow
    cannot be trusted to start the next request (the way a request is smuggled behind another).
    The rules (docs/inbound.md, "Request framing"), on top of h11's own:

    - ``Transfer-Encoding`` together with ``Content-Length``, or in an HTTP/1.0 request: 400
      (RFC 9112 §6.1 and §6.3; h11 would let ``Transfer-Encoding`` win and keep the connection);
    - a method with a lower-case letter: 400 (methods are case-sensitive, RFC 9110 §9.1, and every
      method the gateway serves is upper-case; hypercorn would upper-case it);
    - an HTTP version other than 1.0 and 1.1 in the request line: 505 (HTTP/2 comes by ALPN or as
      the prior-knowledge preface ``PRI * HTTP/2.0``, which is not refused here).

    The fast path (``parse_plain_request``) never takes such a head: its method is GET or POST, its
    version 1.1, and it has no ``Transfer-Encoding``.
    """
    if http_version not in (b"1.1", b"1.0"):
        return 0 if (method, target, http_version) == (b"PRI", b"*", b"2.0") else 505
    if method != method.upper():
        return 400
    chunked = length = False
    for name, _value in headers:  # lower-case names (as h11 iterates them)
        if name == b"transfer-encoding":
            chunked = True
        elif name == b"content-length":
            length = True
    if chunked and (length or http_version == b"1.0"):
        return 400
    return 0


def frame_reply(status: int, headers: list[Header], body: bytes) -> bytes | None:
    """The bytes h11 writes for this whole reply to a plain request, or None (ask h11).

    ``headers`` as the app gives them (names lower-case, values well-formed); framed here only
    when they carry exactly one ``Content-Length`` equal to the body's length and nothing that
    makes h11 rewrite them.
    """
    if status < 200 or status in (204, 304):
        return None
    length = b""
    parts = [b"HTTP/1.1 %d \r\n" % status]  # h11 writes an empty reason phrase after a space
    for name, value in headers:
        if name == b"content-length":
            if length:
                return None
            length = value
        elif name in _REWRITTEN_BY_H11:
            return None
        parts.append(b"%s: %s\r\n" % (name, value))
    if length != b"%d" % len(body):
        return None
    parts.append(b"\r\n")
    parts.append(body)
    return b"".join(parts)


def closes(headers: list[Header]) -> bool:
    """True when the reply tells the client the connection ends after it (``Connection: close``)."""
    for name, value in headers:
        if name == b"connection" and b"close" in (token.strip() for token in value.lower().split(b",")):
            return True
    return False
