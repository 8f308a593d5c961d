"""The Status of every deny the dispatcher can answer, and the cause text of a non-2xx backend reply.

Dispatch decides *that* a review is denied; this module says *how*, with the exact texts of the
apiserver's (ERR-01..10) and of MUT-06/09/10 and VAL-06/07. All builders return new
``gateway.admission.Status`` values; none of them raises.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

import msgspec

from gateway.admission import NestedTooDeeplyError, Status, StatusCause, StatusDetails, decode_nested
from gateway.config.fielderrors import go_quote

__all__ = [
    "call_error_status",
    "changed_kind_status",
    "combine_denials",
    "dry_run_status",
    "http_error_cause",
    "internal_error_status",
    "not_an_object_status",
    "panicked_status",
    "patch_failure_status",
    "patch_on_delete_status",
    "rejection_status",
]

FAILURE: Final = "Failure"


def _internal_error(text: str) -> Status:
    """upstream: apimachinery errors.NewInternalError — 500, the text once as message and once as cause."""
    return Status(
        status=FAILURE,
        code=500,
        reason="InternalError",
        message=f"Internal error occurred: {text}",
        details=StatusDetails(causes=[StatusCause(message=text)]),
    )


def rejection_status(webhook: str, backend: Status | None) -> Status:
    """ERR-01: a backend's rejection, normalised and prefixed with the backend's name."""
    # upstream: pkg/admission/plugin/webhook/errors statuserror.go ToStatusErr
    result = backend or Status()
    denied_by = f'admission webhook "{webhook}" denied the request'
    if result.message:
        message = f"{denied_by}: {result.message}"
    elif result.reason:
        message = f"{denied_by}: {result.reason}"
    else:
        message = f"{denied_by} without explanation"
    return Status(
        status=FAILURE if result.status in ("", "Success") else result.status,
        message=message,
        reason=result.reason,
        details=result.details,
        code=result.code if result.code >= 400 else 400,
    )


def call_error_status(webhook: str, reason: str) -> Status:
    """ERR-02: a call error under ``failurePolicy: Fail``; ``reason`` is an ERR-03 text."""
    return _internal_error(f'failed calling webhook "{webhook}": {reason}')


def dry_run_status(webhook: str) -> Status:
    """ERR-04 / FPT-09: a matching backend with side effects in a dry-run review."""
    message = f'admission webhook "{webhook}" does not support dry run'
    return Status(status=FAILURE, code=400, reason="BadRequest", message=message)


def patch_failure_status(webhook: str, error: str | BaseException) -> Status:
    """ERR-05 / MUT-07: a patch that cannot be applied; the gateway names the backend [GW]."""
    return _internal_error(f'admission webhook "{webhook}" returned a patch that cannot be applied: {error}')


def not_an_object_status(webhook: str, error: str | BaseException) -> Status:
    """MUT-09: the patched document is not a JSON object (reported like ERR-05)."""
    return patch_failure_status(webhook, error)


def patch_on_delete_status(webhook: str) -> Status:
    """MUT-06: a non-empty patch for a request without object."""
    return _internal_error(
        f'admission webhook "{webhook}" attempted to modify the object,'
        " which is not supported for this operation"
    )


def changed_kind_status(
    webhook: str, old_api_version: str, old_kind: str, new_api_version: str, new_kind: str
) -> Status:
    """MUT-10 [GW]: a patch changed the object's apiVersion or kind."""
    return _internal_error(
        f'admission webhook "{webhook}" changed apiVersion/kind from '
        f"{old_api_version}/{old_kind} to {new_api_version}/{new_kind}"
    )


def panicked_status(webhook: str, text: str, *, kind: str = "validating") -> Status:
    """VAL-06 [GW]: an unexpected exception while handling one backend, under ``Fail``.

    ``kind`` names the admission plugin as the apiserver does (``ValidatingAdmissionWebhook``,
    ``MutatingAdmissionWebhook``).
    """
    # upstream: validating dispatcher's recover() turns a panic into this internal error; upstream's
    # mutating chain has no such recovery (a panic fails the request), the gateway confines it alike.
    plugin = "MutatingAdmissionWebhook" if kind == "mutating" else "ValidatingAdmissionWebhook"
    return _internal_error(f"{plugin}/{webhook} has panicked: {text}")


def internal_error_status(step: str, error: str | BaseException) -> Status:
    """ERR-08 [GW]: a failure of the gateway itself while handling a well-formed review."""
    return _internal_error(f"{step}: {error}")


def combine_denials(statuses: Sequence[Status], *, limit: int = 8192) -> Status:
    """VAL-07 [GW]: one deny reporting every recorded error, in configuration order.

    Code, reason, status and details are the first error's; the message is every message joined with
    ``; ``, cut at whole messages so that it stays within ``limit`` characters (the first message is
    always kept), followed by ``; and N more`` when some were left out.
    """
    if not statuses:
        raise ValueError("combine_denials needs at least one status")
    first = statuses[0]
    if len(statuses) == 1:
        return first
    messages = [first.message]
    used = len(first.message)
    for index, status in enumerate(statuses[1:], start=1):
        rest = len(statuses) - index
        # Keep room for the "; and N more" that would follow if a later message does not fit.
        tail = 0 if rest == 1 else len(f"; and {rest - 1} more")
        if used + 2 + len(status.message) + tail > limit:
            messages.append(f"and {rest} more")
            break
        messages.append(status.message)
        used += 2 + len(status.message)
    return Status(
        status=first.status,
        message="; ".join(messages),
        reason=first.reason,
        details=first.details,
        code=first.code,
    )


# --- ERR-07: the cause of a reply outside 200–206 ------------------------------------------------------

# upstream: client-go rest/request.go maxUnstructuredResponseTextBytes
_MAX_SERVER_MESSAGE: Final = 2048

# upstream: apimachinery errors.NewGenericServerResponse, per HTTP status; None means "the server message"
_GENERIC_CAUSES: Final[dict[int, str | None]] = {
    400: "the server rejected our request for an unknown reason",
    401: "the server has asked for the client to provide credentials",
    403: None,
    404: "the server could not find the requested resource",
    405: "the server does not allow this method on the requested resource",
    409: "the server reported a conflict",
    415: None,
    422: "the server rejected our request due to an error in our request",
    429: "the server has received too many requests and has asked us to try again later",
    503: "the server is currently unable to handle the request",
    504: "the server was unable to return a response in the time allotted,"
    " but may still be processing the request",
}

# Go's unicode.IsSpace, used by strings.TrimSpace (Python's str.strip also strips \x1c-\x1f).
_GO_SPACE: Final = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"  # noqa: E501
# RFC 2045 token characters, as Go's mime package checks them.
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_SPACES: Final = f"[{re.escape(_GO_SPACE)}]*"
_PARAM: Final = re.compile(
    rf';{_SPACES}({_TOKEN.pattern}){_SPACES}={_SPACES}({_TOKEN.pattern}|"(?:[^"\\]|\\.)*")', re.DOTALL
)


class _StatusBody(msgspec.Struct):
    """The members of a Status reply body that decide ERR-07's override."""

    kind: str = ""
    status: str = ""
    message: str = ""
    code: int = 0


_status_decoder: Final = msgspec.json.Decoder(_StatusBody)


def _media_type(content_type: str) -> str:
    """Go's mime.ParseMediaType, reduced to what ERR-07 needs: the lower-cased media type, or ValueError."""
    base, semicolon, params = content_type.partition(";")
    value = base.strip(_GO_SPACE).lower()
    main = _TOKEN.match(value)
    if main is None:
        raise ValueError("mime: no media type")
    rest = value[main.end() :]
    media_type = main.group()
    if rest:
        if not rest.startswith("/"):
            raise ValueError("mime: expected slash after first token")
        sub = _TOKEN.match(rest, 1)
        if sub is None:
            raise ValueError("mime: expected token after slash")
        if rest[sub.end() :]:
            raise ValueError("mime: unexpected content after media subtype")
        media_type += rest[: sub.end()]
    remainder = semicolon + params
    seen: set[str] = set()
    while remainder := remainder.lstrip(_GO_SPACE):
        param = _PARAM.match(remainder)
        if param is None:
            if remainder.strip(_GO_SPACE) == ";":
                break  # one trailing semicolon is tolerated
            raise ValueError("mime: invalid media parameter")
        name = param.group(1).lower()
        if name in seen:
            raise ValueError("mime: duplicate parameter name")
        seen.add(name)
        remainder = remainder[param.end() :]
    return media_type


def _failure_status(body: bytes) -> _StatusBody | None:
    """The body as a ``kind: Status`` object with ``status: Failure``, or None (ERR-07 override)."""
    try:
        decoded = decode_nested(_status_decoder, body)
    except (msgspec.DecodeError, NestedTooDeeplyError):
        return None
    # Status is registered "unversioned" in upstream's scheme, so any apiVersion decodes as it; the code
    # is an int32 there.
    if decoded.kind != "Status" or decoded.status != FAILURE or not -(2**31) <= decoded.code < 2**31:
        return None
    return decoded


def http_error_cause(status_code: int, content_type: str, body: bytes) -> tuple[str, int]:
    """ERR-07 / FPT-12: the cause text of a reply with a status outside 200–206, and its metrics code.

    The call error's reason is then ``failed to call webhook: <cause>``. Unlike transport failures
    (ERR-06), this cause has *no* ``Post "<url>": `` prefix: upstream's rest client returns the
    server-response error itself from ``Result.Into``, not a ``*url.Error`` (client-go rest/request.go
    transformResponse → Result.Error), and the dispatcher wraps it only with ``failed to call webhook: ``.
    """
    # upstream: client-go rest/request.go transformResponse, newUnstructuredResponseError, Result.Error
    if content_type:
        try:
            is_text = _media_type(content_type).startswith("text/")
        except ValueError as exc:
            # The rest client fails before looking at the status: an internal error with code 500.
            return f"Internal error occurred: {exc}", 500
    else:
        is_text = True  # no Content-Type is read as text (isTextResponse)
    # The webhook client's serializer has no media type, so it decodes a body of any content type; a
    # Status with status Failure then replaces the generic error, message and code alike.
    if body:
        status = _failure_status(body)
        if status is not None:
            return status.message, status.code
    head = body[:_MAX_SERVER_MESSAGE]
    server_message = head.decode("utf-8", "surrogateescape").strip(_GO_SPACE) if is_text else "unknown"
    return _generic_cause(status_code, server_message), status_code


def _generic_cause(code: int, server_message: str) -> str:
    """upstream: apimachinery errors.NewGenericServerResponse's message for an HTTP status."""
    if code == 406:
        if server_message in ("", "unknown"):
            return "the server was unable to respond with a content type that the client supports"
        return _printable(server_message)
    if code in _GENERIC_CAUSES:
        fixed = _GENERIC_CAUSES[code]
        return fixed if fixed is not None else _printable(server_message)
    if code >= 500:
        return (
            f"an error on the server ({go_quote(server_message)}) has prevented the request from succeeding"
        )
    return f"the server responded with the status code {code} but did not return more information"


def _printable(text: str) -> str:
    """A message that may hold undecodable bytes, as a valid string (U+FFFD for each bad byte)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
