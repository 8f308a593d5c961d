"""The one seam between the "what would happen?" commands (explain, audit) and the gateway's core.

One decision procedure: a review's verdict is always the ``Dispatcher``'s — the object ``serve``
holds — over the namespace label source ``serve`` uses (the configuration's Namespace objects with
``--unknown-namespace``, or a cluster's), with the budget the apiserver gives (the registration's
``timeoutSeconds``), on the path the registration sends the review to (``/validate/fail`` runs only
the Fail backends). Before any of that, the gateway's own registration is matched against the review
with the gateway's matching code (the apiserver's algorithm, MAT-03..30): a review no registration
webhook matches is never sent. Without ``--call`` the backends are not called: ``PlanningCaller``
answers for each as if it allowed, so everything the gateway decides itself (matching, namespaces,
match conditions, dry runs, deadlines) is decided by the same code as in ``serve``.

Everything the commands need from ``gateway.matching``, ``gateway.dispatch``, ``gateway.review``
and ``gateway.sources`` is imported here and only here, so a change of the core's public functions
is mended in this file alone.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import trio

from gateway.admission import AdmissionAttributes
from gateway.config.load import load_documents
from gateway.config.model import Snapshot, Webhook, WebhookKind
from gateway.dispatch.engine import Dispatcher, DispatchSettings, Verdict
from gateway.dispatch.jsonpatch import apply_patch, decode_patch
from gateway.dispatch.ports import NamespaceNotFoundError
from gateway.matching import (
    Call,
    CallFailure,
    ConditionInputs,
    MatchDecision,
    Refuse,
    Skip,
    decide_all,
    is_exempt,
)
from gateway.matching.namespace import NamespaceNotFound, namespace_to_look_up
from gateway.matching.rules import rule_matches
from gateway.registration import HALVES, Half, Settings, compute, half_of, half_path, webhook_path
from gateway.review.inbound import InboundReview, decode_inbound
from gateway.sources.namespaces import NOT_FOUND, FileNamespaces, UnknownNamespace

__all__ = [
    "Call",
    "CallFailure",
    "Dispatcher",
    "MatchDecision",
    "NamespaceNotFound",
    "PlanningCaller",
    "Refuse",
    "Registered",
    "Route",
    "Skip",
    "Verdict",
    "apply_patch",
    "decide",
    "decode_patch",
    "decode_review",
    "dispatcher",
    "matching_rule",
    "namespace_to_look_up",
    "outcome_of",
]

NAME_LABEL = "kubernetes.io/metadata.name"


def decode_review(body: bytes) -> InboundReview:
    """The inbound decoder the server uses (raises ``BadReview``)."""
    return decode_inbound(body)


def decide(
    hooks: Sequence[Webhook],
    review: InboundReview,
    namespace_labels: Mapping[str, str] | NamespaceNotFound | None,
) -> list[MatchDecision]:
    """The server's per-backend decisions, in configuration order (MAT-01..30), with the CEL inputs
    the dispatcher gives them (userInfo and options, MAT-25)."""
    inputs = ConditionInputs(request=review.cel_request()) if any(h.match_conditions for h in hooks) else None
    return decide_all(hooks, review.attributes, namespace_labels, inputs=inputs)


def matching_rule(hook: Webhook, attrs: AdmissionAttributes) -> int | None:
    """The index of the first rule of ``hook`` that matches the request, if any (MAT-03)."""
    for i, rule in enumerate(hook.rules):
        if rule_matches(rule, attrs):
            return i
    return None


# --- namespaces: the sources serve uses ------------------------------------------------------------


class Namespaces:
    """Namespace labels for the dispatcher, answered like ``serve``'s sources answer.

    ``file``: the Namespace objects of a snapshot, an unknown name per ``--unknown-namespace``
    (``FileNamespaces``, serve's file mode). ``fixed``: every namespace a cluster listed (an unknown
    name does not exist), or the one ``--namespace-labels`` names.
    """

    def __init__(
        self,
        *,
        snapshot: Snapshot | None = None,
        unknown_namespace: UnknownNamespace = "notFound",
        fixed: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self._file = FileNamespaces(snapshot, unknown_namespace=unknown_namespace) if snapshot else None
        self._fixed = fixed

    def lookup(self, name: str) -> Mapping[str, str] | NamespaceNotFound:
        if self._fixed is not None:
            found = self._fixed.get(name)
            return NamespaceNotFound(name) if found is None else found
        assert self._file is not None
        labels = self._file.labels_now(name)
        return NamespaceNotFound(name) if labels is NOT_FOUND else labels

    async def labels(self, name: str) -> Mapping[str, str]:
        return self.labels_now(name)

    def labels_now(self, name: str) -> Mapping[str, str]:
        found = self.lookup(name)
        if isinstance(found, NamespaceNotFound):
            raise NamespaceNotFoundError(name)
        return found


# --- the gateway's registration: does the apiserver send the review at all? -------------------------


@dataclass(frozen=True, slots=True)
class Route:
    """One of the gateway's registration webhooks a review reaches: the path the apiserver posts it
    to, the backends that path runs, and the budget (``?timeout=``) it sends."""

    name: str
    kind: WebhookKind
    path: str
    half: Half | None  # validating: the backends of one failurePolicy; None: every one of the kind
    timeout_seconds: float
    failure_policy: str


@dataclass(slots=True)
class Registered:
    """The gateway's registration as the apiserver holds it, loaded like any configuration."""

    webhooks: Snapshot
    routes: dict[str, Route]  # by the registration webhook's identity
    source: str
    unknown_paths: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, docs: Sequence[Mapping[str, Any]], settings: Settings, source: str) -> Registered:
        """From registration documents (what ``registration`` prints, or a file)."""
        webhooks = load_documents([(source, dict(d)) for d in docs], registration=True)
        routes: dict[str, Route] = {}
        unknown: list[str] = []
        for hook in (*webhooks.validating, *webhooks.mutating):
            path = webhook_path(_client_doc(hook))
            half: Half | None = None
            if hook.kind == "validating":
                halves = {half_path(settings.validate_path, h): h for h, _ in HALVES}
                if path not in halves and path != settings.validate_path:
                    unknown.append(f"{hook.name}: {path}")
                    continue
                half = halves.get(path)
            elif path != settings.mutate_path:
                unknown.append(f"{hook.name}: {path}")
                continue
            routes[hook.identity] = Route(
                hook.name, hook.kind, path, half, float(hook.timeout_seconds), hook.failure_policy
            )
        return cls(webhooks, routes, source, unknown)

    @classmethod
    def computed(cls, snapshot: Snapshot, settings: Settings | None = None) -> Registered:
        settings = settings or Settings()
        docs = compute(snapshot, settings).documents()
        return cls.load(docs, settings, "the registration `webhook-gateway registration` computes")

    def routes_for(self, review: InboundReview, labels: Mapping[str, str]) -> tuple[list[Route], list[str]]:
        """The registration webhooks the apiserver calls for ``review`` (mutating first), and for each
        of the kind's webhooks it skips, why. ``labels``: the namespace's labels as the apiserver knows
        them (it always sets kubernetes.io/metadata.name)."""
        attrs = review.attributes
        if is_exempt(attrs):  # MAT-31/32: the apiserver never calls a webhook for these
            return [], [f"the apiserver calls no webhook for {_resource_text(attrs)} (MAT-31/32)"]
        labels = {**labels, NAME_LABEL: attrs.namespace} if attrs.namespace else dict(labels)
        routes: list[Route] = []
        skipped: list[str] = []
        for kind in ("mutating", "validating"):
            hooks = self.webhooks.webhooks(kind)
            for hook, decision in zip(hooks, decide(hooks, review, labels), strict=True):
                route = self.routes.get(hook.identity)
                if route is None:
                    continue
                if isinstance(decision, Skip):
                    skipped.append(f"{hook.name}: {_skip_text(hook, decision, attrs)}")
                else:  # Call (or a condition error: the apiserver calls, or applies its policy)
                    routes.append(route)
        return routes, skipped


def _client_doc(hook: Webhook) -> dict[str, Any]:
    cc = hook.client_config
    if cc.service is not None:
        return {"clientConfig": {"service": {"path": cc.service.path or "/"}}}
    return {"clientConfig": {"url": cc.url or ""}}


def _skip_text(hook: Webhook, decision: Skip, attrs: AdmissionAttributes) -> str:
    what = f"{attrs.operation} {_resource_text(attrs)}"
    if decision.reason == "rules":
        return f"no rule matches {what}"
    if decision.reason == "namespaceSelector":
        return f"namespace {attrs.namespace} is excluded (namespaceSelector)"
    if decision.reason == "objectSelector":
        return "objectSelector excludes the object"
    false = decision.conditions.false_condition if decision.conditions else None
    return f"matchCondition {false} excludes {what}" if false else f"matchConditions exclude {what}"


def _resource_text(attrs: AdmissionAttributes) -> str:
    r = attrs.resource
    text = f"{r.resource}.{r.group}" if r.group else r.resource
    return text + (f"/{attrs.sub_resource}" if attrs.sub_resource else "")


# --- calling, or planning the calls ----------------------------------------------------------------


class _Reply(msgspec.Struct, frozen=True):
    status: int
    content_type: str
    body: bytes


class PlanningCaller:
    """A WebhookCaller that calls no one: it records every call the dispatcher makes (the backend
    and the timeout it gets) and answers as that backend allowing, in the version it was asked in.

    With it the dispatcher decides everything that does not depend on what backends answer, exactly
    as in ``serve``: which backends are called, in which order, with which timeout, and every answer
    the gateway gives without them (MAT-16/17/28, FPT-09).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[Webhook, float]] = []

    async def call(self, hook: Webhook, body: bytes, *, timeout_seconds: float) -> _Reply:
        self.calls.append((hook, timeout_seconds))
        sent = json.loads(body)
        reply = {
            "apiVersion": sent.get("apiVersion"),
            "kind": "AdmissionReview",
            "response": {"uid": (sent.get("request") or {}).get("uid", ""), "allowed": True},
        }
        return _Reply(200, "application/json", json.dumps(reply).encode())

    def url(self, hook: Webhook, *, timeout_seconds: float) -> str:
        cc = hook.client_config
        if cc.url:
            return cc.url
        assert cc.service is not None
        svc = cc.service
        return f"https://{svc.name}.{svc.namespace}.svc:{svc.port}{svc.path or ''}"


@contextlib.asynccontextmanager
async def dispatcher(
    namespaces: Namespaces, *, call: bool, backend_kubeconfig: str | None = None
) -> AsyncIterator[tuple[Dispatcher, PlanningCaller | None]]:
    """The server's Dispatcher over the server's backend caller (``call``), or over a
    ``PlanningCaller`` that calls no one."""
    if not call:
        planner = PlanningCaller()
        yield Dispatcher(planner, namespaces, DispatchSettings()), planner
        return
    from gateway.transport.caller import BackendCaller
    from gateway.transport.credentials import CredentialStore
    from gateway.transport.pool import ClientPool

    credentials = CredentialStore.load(backend_kubeconfig) if backend_kubeconfig else None
    async with ClientPool() as pool:
        yield Dispatcher(BackendCaller(pool, credentials), namespaces, DispatchSettings()), None


async def run_review(
    engine: Dispatcher,
    review: InboundReview,
    snapshot: Snapshot,
    *,
    route: Route,
    budget: float,
    margin: float = 0.2,
) -> Verdict:
    """What the gateway answers on ``route.path`` for ``review`` when the apiserver gives it ``budget``
    seconds: the same Dispatcher call and deadline as ``serve`` (its app: arrival + budget - margin)."""
    deadline = trio.current_time() + budget - margin
    target = snapshot if route.half is None else half_of(snapshot, route.half)
    return await engine.decide(route.kind, review, target, deadline=deadline)


# --- what a verdict means to a CI gate ---------------------------------------------------------------

Outcome = Literal["allowed", "denied", "error"]
ERRORS = ("failed_closed", "failed_open", "internal_error")


def outcome_of(verdict: Verdict) -> Outcome:
    """``denied``: a backend rejected, or the gateway refused the review itself (a namespace that does
    not exist, a failing match condition, a dry run a backend cannot take). ``error``: otherwise, a
    backend could not be called or answered wrongly (whether its failurePolicy let the review through
    or not). ``allowed``: neither."""
    records = verdict.report.invocations if verdict.report else []
    # A dry run refused before any call (FPT-09) is the gateway's own denial; an internal error after a
    # call (a patch that cannot be applied) is the backend's fault.
    if any(r.outcome == "rejected" or (r.outcome == "internal_error" and not r.backend_uid) for r in records):
        return "denied"
    if any(r.outcome in ERRORS for r in records):
        return "error"
    return "allowed" if verdict.allowed else "denied"


def as_plain(value: Any) -> Any:
    """msgspec Structs and Raw values as plain JSON-able data (for -o json)."""
    return msgspec.json.decode(msgspec.json.encode(value))
