"""The one seam between the "what would happen?" commands (explain, audit) and the gateway's core.

``explain`` and ``audit`` never re-implement matching or dispatch: they ask the same functions the
server uses. Everything they need from ``gateway.matching``, ``gateway.dispatch`` and
``gateway.review`` is imported here and only here, so a change of the core's public functions is
mended in this file alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gateway.admission import AdmissionAttributes
from gateway.config.model import Snapshot, Webhook
from gateway.dispatch.engine import Dispatcher, DispatchSettings, Verdict
from gateway.dispatch.jsonpatch import apply_patch, decode_patch
from gateway.dispatch.ports import NamespaceNotFoundError
from gateway.matching import Call, CallFailure, ConditionInputs, MatchDecision, Refuse, Skip, decide_all
from gateway.matching.namespace import namespace_to_look_up
from gateway.matching.rules import rule_matches
from gateway.review.inbound import InboundReview, decode_inbound

__all__ = [
    "Call",
    "CallFailure",
    "Dispatcher",
    "MatchDecision",
    "Refuse",
    "Skip",
    "Verdict",
    "apply_patch",
    "decide",
    "decode_patch",
    "decode_review",
    "dispatcher",
    "matching_rule",
    "namespace_to_look_up",
]


def decode_review(body: bytes) -> InboundReview:
    """The inbound decoder the server uses (raises ``BadReview``)."""
    return decode_inbound(body)


def decide(
    hooks: tuple[Webhook, ...], review: InboundReview, namespace_labels: Mapping[str, str] | None
) -> list[MatchDecision]:
    """The server's per-backend decisions, in configuration order (MAT-01..30), with the CEL inputs
    the dispatcher gives them (userInfo and options, MAT-25)."""
    # The dispatcher's CEL inputs (MAT-25): ``request`` as the decoded review carries it.
    inputs = ConditionInputs(request=review.cel_request()) if any(h.match_conditions for h in hooks) else None
    return decide_all(hooks, review.attributes, namespace_labels, inputs=inputs)


def matching_rule(hook: Webhook, attrs: AdmissionAttributes) -> int | None:
    """The index of the first rule of ``hook`` that matches the request, if any (MAT-03)."""
    for i, rule in enumerate(hook.rules):
        if rule_matches(rule, attrs):
            return i
    return None


class _FixedLabels:
    """A namespace label source that knows one answer (explain's --namespace-labels, audit's list)."""

    def __init__(self, labels: Mapping[str, Mapping[str, str]]) -> None:
        self._labels = labels

    async def labels(self, name: str) -> Mapping[str, str]:
        found = self.labels_now(name)
        assert found is not None  # every answer is known now
        return found

    def labels_now(self, name: str) -> Mapping[str, str] | None:
        found = self._labels.get(name)
        if found is None:
            raise NamespaceNotFoundError(name)
        return found


@contextlib.asynccontextmanager
async def dispatcher(
    namespaces: Mapping[str, Mapping[str, str]], *, backend_kubeconfig: str | None = None
) -> AsyncIterator[Dispatcher]:
    """The server's Dispatcher over the server's backend caller, with a fixed namespace label source."""
    from gateway.transport.caller import BackendCaller
    from gateway.transport.credentials import CredentialStore
    from gateway.transport.pool import ClientPool

    credentials = CredentialStore.load(backend_kubeconfig) if backend_kubeconfig else None
    async with ClientPool() as pool:
        yield Dispatcher(BackendCaller(pool, credentials), _FixedLabels(namespaces), DispatchSettings())


async def run_review(
    engine: Dispatcher, review: InboundReview, snapshot: Snapshot, *, kind: str, deadline: float
) -> Verdict:
    if kind == "mutating":
        return await engine.mutate(review, snapshot, deadline=deadline)
    return await engine.validate(review, snapshot, deadline=deadline)


def as_plain(value: Any) -> Any:
    """msgspec Structs and Raw values as plain JSON-able data (for -o json)."""
    import msgspec

    return msgspec.json.decode(msgspec.json.encode(value))
