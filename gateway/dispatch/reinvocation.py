"""Reinvocation bookkeeping of the mutating chain (MUT-15..19): which backends round 1 calls again.

Pure state, one per inbound review, like upstream's ``webhookReinvokeContext``
(apiserver pkg/admission/plugin/webhook/mutating/reinvocationcontext.go). The mutating dispatcher
calls ``record`` after every invocation in either round, asks ``should_run_round_1`` after round 0,
and in round 1 calls a matching backend only if ``should_reinvoke`` says so. Backends are named by
their ORD-03 identity ``<configuration>/<webhook>/<k>``.
"""

from __future__ import annotations

__all__ = ["ReinvocationState"]


class ReinvocationState:
    """The sets P (invoked, re-invocable), R (to reinvoke) and the reinvoke flag of MUT-15."""

    __slots__ = ("_flag", "_previously_invoked", "_to_reinvoke")

    def __init__(self) -> None:
        self._previously_invoked: set[str] = set()
        self._to_reinvoke: set[str] = set()
        self._flag = False

    def record(self, identity: str, *, if_needed: bool, changed: bool) -> None:
        """Account for one invocation (MUT-15/18/19), in round 0 or round 1.

        ``changed``: the invocation changed the object (MUT-12); false for a call error ignored under
        ``Ignore``. ``if_needed``: the backend's ``reinvocationPolicy`` is ``IfNeeded``; such a backend
        enters P even when its call failed and was ignored.
        """
        # upstream: mutating dispatcher Dispatch — the change is handled before the backend joins P, so
        # a backend's own change never makes it eligible for reinvocation.
        if changed:
            self._to_reinvoke |= self._previously_invoked
            self._previously_invoked = set()
            self._flag = True
        if if_needed:
            self._previously_invoked.add(identity)

    @property
    def should_run_round_1(self) -> bool:
        """MUT-16/19: some invocation changed the object, so one more round runs (possibly calling nobody)."""
        return self._flag

    def should_reinvoke(self, identity: str) -> bool:
        """MUT-16/17: in round 1, call this (matching) backend again; R never shrinks."""
        return identity in self._to_reinvoke

    @property
    def previously_invoked(self) -> frozenset[str]:
        """P: invoked ``IfNeeded`` backends not yet followed by a change."""
        return frozenset(self._previously_invoked)

    @property
    def to_reinvoke(self) -> frozenset[str]:
        """R: backends round 1 calls again if they still match."""
        return frozenset(self._to_reinvoke)

    def __repr__(self) -> str:
        return (
            f"<ReinvocationState reinvoke={self._flag} P={sorted(self._previously_invoked)}"
            f" R={sorted(self._to_reinvoke)}>"
        )
