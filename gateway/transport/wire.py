"""What the connection modules share: the reply value and the retry signal.

Foreign exceptions are mapped to typed ``TransportError``s in ``gateway.wire.errors``, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.errors import TransportError

Header = tuple[bytes, bytes]


@dataclass(frozen=True, slots=True)
class HTTPResponse:
    """A backend's complete reply; header names are lower-case bytes."""

    status: int
    headers: list[Header] = field(default_factory=list)
    body: bytes = b""
    http_version: str = "HTTP/1.1"

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (``name`` in lower case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


class RetryableError(TransportError):
    """The request provably never reached the backend's handler; the pool may resend it once.

    Raised only for HTTP/2 streams that never carried a byte (the connection was already closing or
    out of stream ids) or that the peer refused: REFUSED_STREAM, or a GOAWAY whose last stream id
    is below the stream's. An HTTP/1.1 request is never resent once its first byte was written:
    the backend may have read and processed it (FPT-10). Never escapes the pool.
    """
