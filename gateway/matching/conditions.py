"""matchConditions, evaluation half (MAT-24..30): the last predicate before a backend is called.

Expressions were parsed and checked at load (``gateway.config.cel``). Here they run on celpy's
interpreter against the review: ``object``/``oldObject`` are decoded from their raw JSON only when a
backend has conditions, once per object version (``ConditionInputs``). All of one backend's
conditions share one wall-clock bound (MAT-27 [GW]); running past it fails the evaluation as a whole.
The result carries the facts metrics need (MAT-30/MET-07).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import celpy
import lark
import msgspec
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.evaluation import Activation, CELEvalError, Evaluator

from gateway.admission import AdmissionAttributes, is_null
from gateway.config.cel import CompiledCondition, Tree
from gateway.config.model import FailurePolicy

DEFAULT_TIME_LIMIT_SECONDS: Final = 0.25
"""MAT-27 [GW]: one backend's conditions together may take this long (upstream's budget is ~0.25 s)."""

OUT_OF_BUDGET: Final = (
    "validation failed due to running out of cost budget, no further validation rules will be run"
)
"""MAT-27: upstream's text for an exhausted budget, reused for the gateway's wall-clock bound."""

AUTHORIZER_UNAVAILABLE: Final = "authorizer is not available: the gateway has no SubjectAccessReview client"
"""MAT-29 [GW]: the cause for any condition that uses ``authorizer``."""

Clock = Callable[[], float]


class ConditionError(msgspec.Struct, frozen=True):
    """One expression's evaluation error, for logs (MAT-29 asks for backend and condition name)."""

    name: str
    message: str


class ConditionFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What MET-07 counts for one evaluation (MAT-30).

    ``excluded``: the conditions skipped the backend without failing the review. ``evaluation_errors``:
    erroring expressions before the first false one. ``errors`` lists every expression error.
    """

    excluded: bool = False
    evaluation_errors: int = 0
    evaluation_seconds: float = 0.0
    false_condition: str | None = None
    errors: tuple[ConditionError, ...] = ()
    failure: ConditionError | None = None  # the evaluation failed as a whole (MAT-26/27), for logs


class ConditionResult(msgspec.Struct, frozen=True, kw_only=True):
    """``matches``: call the backend. ``error``: the Fail-policy error text for MAT-28's 403."""

    matches: bool
    error: str | None = None
    facts: ConditionFacts


class _OutOfTime(BaseException):
    # A BaseException so that celpy's own ``except Exception`` handlers cannot turn it into a CEL value.
    pass


class _InputsUnusableError(Exception):
    """A CEL variable cannot be built from the review: the evaluation fails as a whole (MAT-26)."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(message)
        self.variable = variable
        self.message = message


# What building CEL values from decoded JSON can raise for input CEL cannot represent: integers
# outside int64/uint64 (celpy's ``ValueError: overflow``), nesting deeper than Python's recursion.
_UNUSABLE_INPUT: Final = (ValueError, TypeError, OverflowError, RecursionError)


_ENVIRONMENT: Final = celpy.Environment()


class _BoundedEvaluator(Evaluator):
    """celpy's interpreter, checking the shared deadline at every node it visits."""

    def __init__(self, ast: Tree, activation: Activation, deadline: float, clock: Clock) -> None:
        super().__init__(ast, activation)
        self._deadline = deadline
        self._clock = clock

    def sub_evaluator(self, ast: Tree) -> Evaluator:
        # macros (all, exists, map ...) evaluate their bodies in nested evaluators
        return _BoundedEvaluator(ast, self.activation, self._deadline, self._clock)

    def _visit_tree(self, tree: Tree) -> object:
        if self._clock() > self._deadline:
            raise _OutOfTime
        return super()._visit_tree(tree)


def _unusable(variable: str, exc: BaseException) -> _InputsUnusableError:
    if isinstance(exc, RecursionError):
        detail = "nested too deeply for CEL evaluation"
    elif isinstance(exc, ValueError) and str(exc) == "overflow":
        detail = "an integer is outside the 64-bit range CEL supports"
    else:
        detail = str(exc) or type(exc).__name__
    return _InputsUnusableError(variable, f"failed to convert {variable} for CEL: {detail}")


def _to_cel(raw: msgspec.Raw | None, what: str) -> object:
    if is_null(raw):
        return None
    try:
        return json_to_cel(msgspec.json.decode(raw))  # type: ignore[arg-type]
    except msgspec.DecodeError as exc:
        raise _InputsUnusableError(what, f"failed to decode {what}: {exc}") from None
    except _UNUSABLE_INPUT as exc:
        raise _unusable(what, exc) from None


def request_fields(attrs: AdmissionAttributes) -> dict[str, object]:
    """MAT-25's ``request`` from what ``AdmissionAttributes`` carries, for callers without the review.

    The dispatcher passes the inbound review's own ``cel_request()`` instead, which also carries
    ``userInfo`` and ``options``; both read ``requestKind``/``requestResource``/``requestSubResource``
    from the request (REV-06/07), never from ``kind``/``resource``.
    """
    kind, rkind = attrs.kind, attrs.request_kind
    res, rres = attrs.resource, attrs.request_resource
    return {
        "uid": attrs.uid,
        "kind": {"group": kind.group, "version": kind.version, "kind": kind.kind},
        "resource": {"group": res.group, "version": res.version, "resource": res.resource},
        "subResource": attrs.sub_resource,
        "requestKind": {"group": rkind.group, "version": rkind.version, "kind": rkind.kind},
        "requestResource": {"group": rres.group, "version": rres.version, "resource": rres.resource},
        "requestSubResource": attrs.request_sub_resource,
        "name": attrs.name,
        "namespace": attrs.namespace,
        "operation": attrs.operation,
        "userInfo": {"username": "", "uid": "", "groups": [], "extra": {}},
        "dryRun": attrs.dry_run,
        "options": None,
    }


class ConditionInputs:
    """One review's CEL variables, decoded lazily; ``object`` is re-decoded only when it changes.

    ``request`` overrides the request fields built from the attributes (the dispatcher may pass the
    inbound AdmissionRequest, which also carries ``userInfo`` and ``options``).
    """

    __slots__ = ("_object", "_object_raw", "_old", "_old_raw", "_request", "_request_override")

    def __init__(self, request: Mapping[str, object] | None = None) -> None:
        self._request_override = request
        self._request: object = None
        self._object_raw: msgspec.Raw | bool | None = False
        self._object: object = None
        self._old_raw: msgspec.Raw | bool | None = False
        self._old: object = None

    def variables(
        self, attrs: AdmissionAttributes, needed: frozenset[str] = frozenset({"object", "oldObject"})
    ) -> dict[str, object]:
        """The activation for ``attrs``; objects are decoded only when ``needed`` names them.

        Raises ``_InputsUnusableError`` for an input CEL cannot be given (not JSON, an integer outside
        64 bits, nesting too deep for the interpreter).
        """
        if "object" in needed and (self._object_raw is False or self._object_raw is not attrs.object):
            self._object = _to_cel(attrs.object, "object")
            self._object_raw = attrs.object
        if "oldObject" in needed and (self._old_raw is False or self._old_raw is not attrs.old_object):
            self._old = _to_cel(attrs.old_object, "oldObject")
            self._old_raw = attrs.old_object
        if self._request is None:
            fields = self._request_override if self._request_override is not None else request_fields(attrs)
            try:
                self._request = json_to_cel(dict(fields))
            except _UNUSABLE_INPUT as exc:
                raise _unusable("request", exc) from None
        return {
            "object": self._object,
            "oldObject": self._old,
            "request": self._request,
            "namespaceObject": None,  # MAT-25: declared, always null for webhooks
            "authorizer": None,
        }


def _cause(exc: CELEvalError) -> str:
    # celpy's texts, reworded where cel-go has a well-known phrasing (GW-12: the dialect may differ)
    text = str(exc.args[0]) if exc.args else str(exc)
    if text.startswith("no such member in mapping: "):  # a field selection: object.metadata.missing
        return "no such key: " + text.removeprefix("no such member in mapping: ").strip("'\"")
    if text == "no such key" and len(exc.args) > 2 and isinstance(exc.args[2], tuple) and exc.args[2]:
        # an index, labels['missing']: celpy keeps the key in the error's arguments, cel-go prints it
        return f"no such key: {exc.args[2][0]}"
    head, sep, _ = text.partition(" (in activation")
    return head if sep else text


def _type_name(value: object) -> str:
    if value is None:
        return "null_type"
    return type(value).__name__.removesuffix("Type").lower() or "unknown"


def aggregate(messages: Sequence[str]) -> str:
    """MAT-28 joining: one distinct text alone, several as ``[e1, e2]`` in order, duplicates once."""
    # upstream: apimachinery util/errors aggregate.Error
    distinct = list(dict.fromkeys(messages))
    if len(distinct) == 1:
        return distinct[0]
    return "[" + ", ".join(distinct) + "]"


def _evaluate_one(
    condition: CompiledCondition, variables: dict[str, object], deadline: float, clock: Clock
) -> bool | str:
    """True/False, or the expression's error text."""
    if condition.error is not None or condition.program is None:
        return f"compilation error: {condition.error}"
    prefix = f"expression '{condition.expression}' resulted in error: "
    if condition.uses_authorizer:
        return prefix + AUTHORIZER_UNAVAILABLE
    assert isinstance(condition.program, lark.Tree)
    activation = Activation(annotations=_ENVIRONMENT.annotations, package=_ENVIRONMENT.package)
    try:
        value = _BoundedEvaluator(condition.program, activation, deadline, clock).evaluate(variables)  # type: ignore[arg-type]
    except CELEvalError as exc:
        return prefix + _cause(exc)
    except RecursionError:
        return prefix + "expression nesting too deep"
    except (TypeError, ValueError, KeyError, IndexError, ArithmeticError, AttributeError) as exc:
        # celpy occasionally lets a Python error escape instead of a CEL error value
        return prefix + str(exc)
    if isinstance(value, celtypes.BoolType):
        return bool(value)
    return prefix + f"expected a bool result, got {_type_name(value)}"


def evaluate_conditions(
    conditions: Sequence[CompiledCondition],
    failure_policy: FailurePolicy,
    attrs: AdmissionAttributes,
    inputs: ConditionInputs | None = None,
    *,
    time_limit_seconds: float = DEFAULT_TIME_LIMIT_SECONDS,
    clock: Clock = time.perf_counter,
) -> ConditionResult:
    """MAT-24..30: evaluate every condition in order and decide call / skip / fail.

    A false condition skips; errors without a false one go to ``failure_policy`` (Fail: ``error`` is
    set; Ignore: skip); a failure of the evaluation as a whole discards every individual result.
    """
    if not conditions:
        return ConditionResult(matches=True, facts=ConditionFacts())
    started = clock()
    deadline = started + time_limit_seconds
    outcomes: list[bool | str] = []
    whole_failure: str | None = None
    failed_condition = ""
    try:
        # decoding an 8 KB object for CEL costs ~1 ms: only do it when an expression names it
        needed = frozenset().union(*(c.variables for c in conditions if c.error is None))
        variables = (inputs or ConditionInputs()).variables(attrs, needed)
        for condition in conditions:
            outcomes.append(_evaluate_one(condition, variables, deadline, clock))
    except _OutOfTime:
        whole_failure = OUT_OF_BUDGET
        failed_condition = conditions[min(len(outcomes), len(conditions) - 1)].name
    except _InputsUnusableError as exc:
        whole_failure = exc.message
        # the first condition that reads the unusable variable (every one does for ``request``)
        readers = [c.name for c in conditions if exc.variable in c.variables]
        failed_condition = readers[0] if readers else conditions[0].name
    seconds = max(0.0, clock() - started)

    if whole_failure is not None:
        # MAT-26: individual results are discarded; MAT-30: not an evaluation error
        failure = ConditionError(name=failed_condition, message=whole_failure)
        if failure_policy == "Fail":
            return ConditionResult(
                matches=False,
                error=whole_failure,
                facts=ConditionFacts(evaluation_seconds=seconds, failure=failure),
            )
        return ConditionResult(
            matches=False, facts=ConditionFacts(excluded=True, evaluation_seconds=seconds, failure=failure)
        )

    errors = tuple(
        ConditionError(name=c.name, message=o)
        for c, o in zip(conditions, outcomes, strict=True)
        if isinstance(o, str)
    )
    counted = 0
    for condition, outcome in zip(conditions, outcomes, strict=True):
        if isinstance(outcome, str):
            counted += 1
        elif outcome is False:
            # upstream: webhook/matchconditions/matcher.go Match stops counting at the first false
            facts = ConditionFacts(
                excluded=True,
                evaluation_errors=counted,
                evaluation_seconds=seconds,
                false_condition=condition.name,
                errors=errors,
            )
            return ConditionResult(matches=False, facts=facts)
    if errors:
        if failure_policy == "Fail":
            facts = ConditionFacts(evaluation_errors=counted, evaluation_seconds=seconds, errors=errors)
            return ConditionResult(matches=False, error=aggregate([e.message for e in errors]), facts=facts)
        facts = ConditionFacts(
            excluded=True, evaluation_errors=counted, evaluation_seconds=seconds, errors=errors
        )
        return ConditionResult(matches=False, facts=facts)
    return ConditionResult(matches=True, facts=ConditionFacts(evaluation_seconds=seconds))
