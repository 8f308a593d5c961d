"""Backend protections and overload shedding: pure state machines over an injected clock.

No I/O and no knowledge of AdmissionReview: the dispatch drivers ask a ``BackendGuard`` before each
backend call and report the result after it; the server asks the ``Shedder`` before each review.
Each protection only ever turns a call into a call error for that backend, which its own
failurePolicy then decides, so none produces a decision the backend's policy would not.
"""

from gateway.resilience.breaker import (
    CallPermit,
    CircuitBreaker,
    CircuitOpen,
    CircuitState,
    Clock,
    Transition,
)
from gateway.resilience.bulkhead import Bulkhead, BulkheadToken
from gateway.resilience.guards import BackendGuard, BackendGuards, Pass, Refusal, backend_key
from gateway.resilience.shedding import (
    Assessment,
    ReviewSlot,
    Shedder,
    ShedPolicy,
    ShedReason,
)

__all__ = [
    "Assessment",
    "BackendGuard",
    "BackendGuards",
    "Bulkhead",
    "BulkheadToken",
    "CallPermit",
    "CircuitBreaker",
    "CircuitOpen",
    "CircuitState",
    "Clock",
    "Pass",
    "Refusal",
    "ReviewSlot",
    "ShedPolicy",
    "ShedReason",
    "Shedder",
    "Transition",
    "backend_key",
]
