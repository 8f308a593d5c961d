"""Calling one backend: negotiate, encode, POST, classify the HTTP status, decode and verify.

Every way a call can fail becomes ``CallingWebhookError`` (governed by failurePolicy); what a
verified reply *means* (allow, reject, patch) is decided by the validating/mutating dispatchers.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio
from gateway.dispatch.status import http_error_cause
from gateway.review import (
    BackendResponse,
    InboundReview,
    decode_backend_response,
    encode_backend_request,
    negotiate_version,
    new_request_uid,
    no_known_version_error,
)

from gateway.admission import AdmissionAttributes
from gateway.config.model import Webhook
from gateway.dispatch.ports import WebhookCaller
from gateway.errors import CallingWebhookError

# A hair of slack over the transport's own cancel scope: if the transport ever overran its
# deadline (a bug), dispatch still answers in time.
_GUARD_SECONDS = 0.05


@dataclass(slots=True)
class Called:
    """A verified reply and the facts metrics/logs need about the call."""

    response: BackendResponse
    version: str
    backend_uid: str


def deadline_exceeded(caller: WebhookCaller, hook: Webhook) -> CallingWebhookError:
    """FPT-08 / VAL-10: the budget is gone before (or while) the backend could be called."""
    url = caller.url(hook, timeout_seconds=0)
    return CallingWebhookError(
        f'failed to call webhook: Post "{url}": context deadline exceeded', status_code=503, kind="timeout"
    )


async def call_backend(
    caller: WebhookCaller,
    hook: Webhook,
    inbound: InboundReview,
    attrs: AdmissionAttributes,
    *,
    deadline: float,
    mutating: bool,
) -> Called:
    """One invocation of ``hook`` on the current object; raises CallingWebhookError on any call error."""
    version = negotiate_version(hook)
    if version is None:  # REV-05
        raise no_known_version_error()
    remaining = min(float(hook.timeout_seconds), deadline - trio.current_time())
    if remaining <= 0:
        raise deadline_exceeded(caller, hook)
    backend_uid = new_request_uid()
    body = encode_backend_request(inbound, version=version, uid=backend_uid, object=attrs.object)
    with trio.move_on_after(remaining + _GUARD_SECONDS) as guard:
        reply = await caller.call(hook, body, timeout_seconds=remaining)
    if guard.cancelled_caught:
        raise deadline_exceeded(caller, hook)
    if not 200 <= reply.status <= 206:  # REV-09: anything else is a call error, body never decoded
        cause, code = http_error_cause(reply.status, reply.content_type, reply.body)
        raise CallingWebhookError(f"failed to call webhook: {cause}", status_code=code, kind="status")
    response = decode_backend_response(
        reply.body,
        version=version,
        sent_uid=backend_uid,
        mutating=mutating,
        status_code=reply.status,
        content_type=reply.content_type,
    )
    return Called(response=response, version=version, backend_uid=backend_uid)
