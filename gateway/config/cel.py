"""CEL match conditions (CFG-22, MAT-24..30): compile at load time, evaluate at match time.

Contract used by the loader and by matching:
- ``compile_condition(name, expression) -> CompiledCondition`` never raises; a compile problem is in
  ``CompiledCondition.error`` (the loader turns it into a CFG-22 error, or a CFG-24 warning for
  cluster sources).
- evaluation lives in ``gateway.matching.conditions``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CompiledCondition:
    name: str
    expression: str
    program: object | None = field(default=None, compare=False, repr=False)
    error: str | None = None


def compile_condition(name: str, expression: str) -> CompiledCondition:
    """Compile one expression in the webhook CEL environment (to be implemented by matching)."""
    return CompiledCondition(name=name, expression=expression, error="CEL is not implemented yet")
