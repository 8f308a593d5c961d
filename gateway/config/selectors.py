"""Compiled label selectors (MAT-21/22), built once at load time.

Syntax is checked by the loader (CFG-21); this module only represents and evaluates a selector.
``matchLabels`` entries become ``In`` requirements with one value, as in apimachinery.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

Operator = Literal["In", "NotIn", "Exists", "DoesNotExist"]


class Requirement(msgspec.Struct, frozen=True):
    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        op = self.operator
        if op == "In":
            value = labels.get(self.key)
            return value is not None and value in self.values
        if op == "NotIn":
            value = labels.get(self.key)
            return value is None or value not in self.values
        if op == "Exists":
            return self.key in labels
        return self.key not in labels  # DoesNotExist


class LabelSelector(msgspec.Struct, frozen=True):
    """A compiled selector: requirements ANDed; ``{}`` selects everything.

    ``error`` is set for a selector that cannot be built (only from laxly validated cluster sources,
    CFG-24); consulting it is then a matching error (MAT-23) carrying that text.
    """

    requirements: tuple[Requirement, ...] = ()
    error: str | None = None

    @property
    def is_empty(self) -> bool:
        return not self.requirements and self.error is None

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


EVERYTHING = LabelSelector()
