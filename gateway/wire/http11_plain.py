"""The client's side of the common HTTP/1.1 exchange without h11's state machine.

A backend call is one POST with a ``Content-Length`` body on a keep-alive connection, and a
webhook answers it with a status line, a few headers and a ``Content-Length`` body. For that
shape h11 builds and validates an event object per part and walks its state machine for each, on
the path of every call (about 30 µs to frame the request and 30 µs to read the reply, measured on
a loaded loopback call). This module frames such a request and reads such a reply head directly;
everything else is left to h11 (``None``), which ``gateway.wire.http11`` then drives as before.

It is a verified shortcut, not a second HTTP grammar: request fields are checked with h11's own
expressions and written byte for byte as h11 writes them (``Host`` first), and a reply head is
taken only when h11 would read it the same way: HTTP/1.1, a final status that has a body, exactly
one plain ``Content-Length``, no ``Transfer-Encoding``, no ``Connection`` other than
``keep-alive``, CRLF line ends and no folded lines. The server's side of the same shortcut is
``gateway.server.http11_fast``; tests/test_wire_http11_plain.py checks this one against h11.

Sans-IO: no sockets, no trio.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final, NamedTuple

from gateway.wire.h11_private import field_name, field_value, header_field, request_target, status_line

Header = tuple[bytes, bytes]

_TARGET: Final = re.compile(request_target.encode("ascii"))
_FIELD_NAME: Final = re.compile(field_name.encode("ascii"))
_FIELD_VALUE: Final = re.compile(field_value.encode("ascii"))
_STATUS_LINE: Final = re.compile(status_line.encode("ascii"))
_HEADER_FIELD: Final = re.compile(header_field.encode("ascii"))
_DIGITS: Final = re.compile(rb"[0-9]{1,18}")

# Request headers whose meaning h11 tracks with state of its own: such a request goes through h11.
_LEFT_TO_H11: Final = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"connection", b"te"})
# Methods whose reply always has the body its head announces (a reply to HEAD has none).
_METHODS: Final = frozenset({b"GET", b"POST"})

END_OF_HEAD: Final = b"\r\n\r\n"
# h11 refuses a head that has not ended within this many bytes; past it the reply is h11's to refuse.
MAX_HEAD_BYTES: Final = 16 * 1024


class PlainResponse(NamedTuple):
    """A parsed plain reply head: what ``HTTP11Exchange.receive_head`` returns, and the body's size."""

    status: int
    headers: list[Header]  # names lower-cased, as h11 iterates them
    length: int  # Content-Length
    head_size: int  # bytes of the head, CRLF CRLF included


def frame_request(method: bytes, target: bytes, headers: Sequence[Header], body: bytes) -> bytes | None:
    """The bytes h11 writes for this whole request, or None (let h11 frame it).

    Framed here only for GET and POST with exactly one ``Host``, a ``Content-Length`` equal to the
    body's length (or none and no body), nothing in ``_LEFT_TO_H11`` and every part well-formed by
    h11's grammar.
    """
    if method not in _METHODS or _TARGET.fullmatch(target) is None:
        return None
    host = b""
    length = b""
    lines: list[bytes] = []
    for name, value in headers:
        if _FIELD_NAME.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
            return None
        lower = name.lower()
        if lower == b"host":
            if host:
                return None
            host = b"%s: %s\r\n" % (name, value)
            continue
        if lower == b"content-length":
            if length:
                return None
            length = value
        elif lower in _LEFT_TO_H11:
            return None
        lines.append(b"%s: %s\r\n" % (name, value))
    if not host or length != (b"%d" % len(body) if length or body else b""):
        return None
    return b"".join((b"%s %s HTTP/1.1\r\n" % (method, target), host, *lines, b"\r\n", body))


def parse_plain_response(data: bytes) -> PlainResponse | None:
    """The reply head at the start of ``data`` when it is a plain one, else None (let h11 read it).

    ``data`` must hold the whole head (``END_OF_HEAD`` found); what follows it is not looked at.
    """
    end = data.find(END_OF_HEAD)
    if end < 0:
        return None
    lines = data[:end].split(b"\r\n")
    line = _STATUS_LINE.fullmatch(lines[0])
    if line is None or line["http_version"] != b"1.1":
        return None
    status = int(line["status_code"])
    if status < 200 or status in (204, 304):  # 1xx, and replies that have no body whatever they say
        return None
    headers: list[Header] = []
    length = -1
    for text in lines[1:]:
        field = _HEADER_FIELD.fullmatch(text)
        if field is None:  # also a folded line, or a bare LF inside a line
            return None
        name, value = field["field_name"].lower(), field["field_value"]
        if name == b"content-length":
            if length >= 0 or _DIGITS.fullmatch(value) is None:
                return None
            length = int(value)
        elif name == b"transfer-encoding" or (name == b"connection" and value.lower() != b"keep-alive"):
            return None
        headers.append((name, value))
    if length < 0:  # a body read until the connection closes: h11's
        return None
    return PlainResponse(status, headers, length, end + len(END_OF_HEAD))
