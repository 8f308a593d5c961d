"""What happened during one review, as plain values: read by logs and metrics, never by dispatch.

Dispatch fills a ``DispatchReport``; observability turns it into the canonical log line and metric
updates. Keeping this a value (instead of calling metrics from every branch) keeps the dispatcher's
control flow readable and lets tests assert on exactly what was recorded. The report and its
invocation records are (mutable) msgspec Structs, built in a fraction of a dataclass's time: one
record per backend call. They are never encoded or decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from gateway.matching import ConditionFacts, MatchDecision

# How one backend invocation ended (MET-02/03/05/06 derive from it).
InvocationOutcome = Literal[
    "allowed",  # verified reply, allowed (patch applied if any)
    "rejected",  # verified reply, allowed: false (ERR-01)
    "failed_closed",  # call error under Fail (ERR-02)
    "failed_open",  # call error under Ignore (FPT-03)
    "internal_error",  # dry-run refusal, patch failure (code 0)
    "cancelled",  # the caller went away: nothing is counted (FPT-03, MET-04)
]

ErrorType = Literal["no_error", "calling_webhook_error", "apiserver_internal_error"]


class InvocationRecord(msgspec.Struct):
    """One backend invocation that reached the call stage (MET-02)."""

    name: str
    configuration: str
    round: int
    index: int
    outcome: InvocationOutcome
    code: int  # MET-03 code label (already capped at 600)
    duration_seconds: float
    version: str = ""
    reason: str = ""  # rejection message or call-error reason, for logs
    error_kind: str = ""  # call-error class for metrics (connect, tls, timeout, status, ...)
    mutated: bool = False
    backend_uid: str = ""  # REV-15: logged for correlation, never returned
    mode: str = "Enforce"  # Warn: recorded, never denying (Shadow results are reported apart)

    @property
    def rejected(self) -> bool:
        """MET-06: true for rejections, fail-closed call errors and internal errors."""
        return self.outcome in ("rejected", "failed_closed", "internal_error")

    @property
    def error_type(self) -> ErrorType:
        """MET-05 error_type of a rejecting invocation."""
        if self.outcome == "failed_closed":
            return "calling_webhook_error"
        if self.outcome == "internal_error":
            return "apiserver_internal_error"
        return "no_error"


@dataclass(slots=True)
class ConditionRecord:
    """Match-condition facts for one backend (MET-07, MAT-30)."""

    name: str
    excluded: bool
    evaluation_errors: int
    seconds: float
    # (condition name, error text) of every erroring expression, or of a failed evaluation as a whole
    # (MAT-26/29): logged one line each, naming backend and condition.
    errors: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ModeRecord:
    """A backend that ran in a rollout mode (Warn, Shadow), for the log line and audit annotations."""

    name: str
    configuration: str
    mode: str
    round: int
    index: int


class DispatchReport(msgspec.Struct):
    """Everything observability needs about one review."""

    kind: Literal["validating", "mutating"]
    operation: str
    invocations: list[InvocationRecord] = msgspec.field(default_factory=list)
    conditions: list[ConditionRecord] = msgspec.field(default_factory=list)
    matched: int = 0
    allowed: bool = True
    denied_by: str = ""  # backend name (or step) that decided a deny
    deny_reason: str = ""
    deadline_exhausted: bool = False
    reinvoked: list[str] = msgspec.field(default_factory=list)
    dropped: list[str] = msgspec.field(default_factory=list)  # dropped annotations / warnings, for logs
    modes: list[ModeRecord] = msgspec.field(default_factory=list)  # backends in Warn or Shadow mode

    def note_conditions(self, name: str, decision: MatchDecision) -> None:
        """MET-07/MAT-30 facts and MAT-26/29 errors of one backend's match conditions, if it has any."""
        facts: ConditionFacts | None = getattr(decision, "conditions", None)
        if facts is None:
            return
        failure = (facts.failure,) if facts.failure is not None else ()
        self.conditions.append(
            ConditionRecord(
                name=name,
                excluded=facts.excluded,
                evaluation_errors=facts.evaluation_errors,
                seconds=facts.evaluation_seconds,
                errors=tuple((e.name, e.message) for e in (*facts.errors, *failure)),
            )
        )

    @property
    def backend_seconds(self) -> float:
        """Time spent in backend invocations: the longest one for a fan-out, the sum for a chain.

        End-to-end time minus this is the gateway's own overhead (MET-09 [GW]).
        """
        durations = [r.duration_seconds for r in self.invocations]
        if not durations:
            return 0.0
        return max(durations) if self.kind == "validating" else sum(durations)
