"""The gateway's exception hierarchy (bottom of the import stack: imports nothing from the gateway).

One root, ``GatewayError``. Failing to *call* a backend (``CallingWebhookError``, upstream's
``ErrCallingWebhook``) is the only family governed by ``failurePolicy``; a rejection is a value,
never an exception. Errors carry structured fields so that callers never parse message texts.
"""

from __future__ import annotations

import errno
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal


class GatewayError(Exception):
    """Root of every error the gateway raises on purpose."""


# --- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One problem found while loading configuration (CFG-23): where, what, how bad.

    ``str()`` gives the one-line message operators read, e.g.
    ``config/team-a.yaml: MutatingWebhookConfiguration "team-a" webhooks[1].timeoutSeconds: must be ...``.
    """

    file: str
    message: str
    kind: str = ""
    name: str = ""
    path: str = ""
    severity: Literal["error", "warning"] = "error"
    code: str = ""  # a warning's code for `check`, where its producer gave it one

    def __str__(self) -> str:
        where = self.file
        if self.kind:
            where += f': {self.kind} "{self.name}"' if self.name else f": {self.kind}"
        if self.path:
            where += f" {self.path}" if self.kind else f": {self.path}"
        return f"{where}: {self.message}"


class ConfigError(GatewayError):
    """A configuration set was refused; ``problems`` lists every error (and the warnings seen)."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        errors = [p for p in problems if p.severity == "error"]
        super().__init__("\n".join(str(p) for p in errors) or "invalid configuration")

    @property
    def errors(self) -> list[ConfigProblem]:
        return [p for p in self.problems if p.severity == "error"]


# --- inbound reviews -----------------------------------------------------------------------------


class BadReview(GatewayError):
    """The caller's review is malformed (REV-01): answered with HTTP 400 and this message."""


# --- calling a backend ---------------------------------------------------------------------------


TransportErrorKind = Literal["connect", "tls", "timeout", "too_large", "transport"]


class TransportError(GatewayError):
    """The transport could not deliver a request or read its reply.

    ``cause`` is the Go-like text upstream would print after ``Post "<url>": `` (ERR-06), e.g.
    ``context deadline exceeded``, ``dial tcp 127.0.0.1:1: connect: connection refused``. ``kind``
    classifies it where the foreign error is mapped (``gateway.wire.errors``), once: callers never
    parse ``cause``.
    """

    def __init__(self, cause: str, kind: TransportErrorKind = "transport") -> None:
        self.cause = cause
        self.kind: TransportErrorKind = kind
        super().__init__(cause)


class TransportTimeout(TransportError):
    """The call's deadline passed (FPT-05)."""

    def __init__(self) -> None:
        super().__init__("context deadline exceeded", "timeout")


class ResponseTooLarge(TransportError):
    """The reply body exceeded the configured limit (TRN-12)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"response body exceeds {limit} bytes", "too_large")


class ClientConfigError(GatewayError):
    """A backend's caBundle or credentials cannot be used (TRN-07): every call is a call error."""


class CallingWebhookError(GatewayError):
    """A call error (upstream ``ErrCallingWebhook``): governed by ``failurePolicy``.

    ``reason`` is the full ERR-03 text (e.g. ``failed to call webhook: Post "...": connection refused``);
    ``status_code`` is the FPT-12 code used by metrics; ``kind`` classifies it for metrics and logs.
    A failed POST (``gateway.transport.caller``) also carries its parts: ``url``, the full URL called
    (``""`` when none could be built), and ``cause``, what went wrong, so that callers with other
    message shapes (conversion, CNV-13) never parse ``reason``.
    """

    def __init__(
        self, reason: str, *, status_code: int = 503, kind: str = "call", url: str = "", cause: str = ""
    ) -> None:
        self.reason = reason
        self.status_code = status_code
        self.kind = kind
        self.url = url
        self.cause = cause
        super().__init__(reason)


class MatchingError(GatewayError):
    """A matching step failed in a way that answers the whole review (MAT-02/16/17/23/28).

    ``details`` mirrors the Status ``details`` object (name, group, kind ...).
    """

    def __init__(
        self, *, code: int, reason: str, message: str, details: dict[str, str] | None = None
    ) -> None:
        self.code = code
        self.status_reason = reason
        self.message = message
        self.details = details or {}
        super().__init__(message)


# --- namespace labels ----------------------------------------------------------------------------


class NamespaceLookupError(GatewayError):
    """Namespace labels could not be obtained (MAT-17), for a reason other than "not found".

    The dispatcher answers ``500 Internal error occurred: <str(error)>``; the message is the
    Go-like text upstream would show, e.g. ``Get "https://10.0.0.1:443/api/v1/namespaces/a": ...``.
    """


class ListenError(GatewayError):
    """A listener could not be opened (address in use, not available, not permitted)."""

    def __init__(self, address: str, exc: OSError) -> None:
        self.address = address
        reason = exc.strerror or str(exc)
        hint = {
            errno.EADDRINUSE: "stop the process using it or choose another address",
            errno.EACCES: "choose a port above 1023 or grant CAP_NET_BIND_SERVICE",
            errno.EADDRNOTAVAIL: "use an address of this host (or 0.0.0.0)",
        }.get(exc.errno or 0, "choose another address")
        super().__init__(f"cannot listen on {address}: {reason.lower()}; {hint}")


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside (nested) exception groups, or ``exc`` itself."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


def startup_failure(exc: BaseException) -> str | None:
    """The one line an expected start-up failure is reported as; None for a defect (re-raised)."""
    found = list(leaves(exc))
    for leaf in found:
        if isinstance(leaf, ListenError):
            return str(leaf)
    for leaf in found:
        if isinstance(leaf, GatewayError | ssl.SSLError):
            return str(leaf)
        if isinstance(leaf, OSError):
            where = f"{leaf.filename}: " if leaf.filename else ""
            reason = leaf.strerror or errno.errorcode.get(leaf.errno or 0, "") or str(leaf)
            return f"{where}{reason}"
    return None
