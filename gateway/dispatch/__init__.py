"""Calling the backends and deciding: the validating fan-out and the mutating chain.

Layers, top to bottom (import-linter keeps them so): ``engine`` (the ``Dispatcher`` facade the server
holds) → ``validating`` / ``mutating`` (thin drivers over I/O) → ``invoke`` (one backend call, as a
value) → ``outcome`` (pure: the ``Outcome`` union, ``apply_failure_policy``, ``settle`` building the
reply, annotations and report once, and the backend policy seam) → the pure helpers ``jsonpatch``
(JSON Patch with upstream semantics), ``status`` (the Status of every deny), ``annotations`` (audit
annotations and warnings), ``reinvocation`` (round-1 bookkeeping), ``report`` (what observability
reads) and ``ports`` (what dispatch needs from transport and sources).
"""
