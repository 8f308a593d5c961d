"""Does this backend apply to this review? Pure, synchronous predicates over ``AdmissionAttributes``.

``rules`` (MAT-03..08) → ``namespace`` (MAT-11..17) → ``objects`` (MAT-18..20) → ``conditions``
(MAT-24..30), combined by ``invocation.should_call`` with upstream's precedence (MAT-01/02) over the
match plans compiled with the Snapshot (``gateway.config.plan``). The dispatcher looks namespace
labels up once per review (``namespace_to_look_up``) before matching.
"""

from gateway.matching.conditions import ConditionFacts, ConditionInputs, evaluate_conditions
from gateway.matching.invocation import (
    Call,
    CallFailure,
    MatchDecision,
    Refuse,
    Skip,
    decide_all,
    decide_candidates,
    forbidden,
    forbidden_message,
    is_exempt,
    matching_error_status,
    not_ready_error,
    should_call,
)
from gateway.matching.namespace import (
    NamespaceLabels,
    NamespaceLookupFailed,
    NamespaceNotFound,
    labels_from_map,
    namespace_to_look_up,
)

__all__ = [
    "Call",
    "CallFailure",
    "ConditionFacts",
    "ConditionInputs",
    "MatchDecision",
    "NamespaceLabels",
    "NamespaceLookupFailed",
    "NamespaceNotFound",
    "Refuse",
    "Skip",
    "decide_all",
    "decide_candidates",
    "evaluate_conditions",
    "forbidden",
    "forbidden_message",
    "is_exempt",
    "labels_from_map",
    "matching_error_status",
    "namespace_to_look_up",
    "not_ready_error",
    "should_call",
]
