"""Calling the backends and deciding: the mutating chain, the validating fan-out, and their pure helpers.

The pure, synchronous parts live beside the async dispatcher: ``jsonpatch`` (JSON Patch with upstream
semantics), ``status`` (the Status values of every deny), ``annotations`` (audit annotations and warnings)
and ``reinvocation`` (round-1 bookkeeping).
"""
