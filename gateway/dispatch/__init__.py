"""Calling the backends and deciding: the validating fan-out and the mutating chain.

Layers, top to bottom (import-linter keeps them so): ``engine`` (the ``Dispatcher`` the server
holds: one walk of a review, from exemption to verdict) → ``validating`` / ``mutating`` (the
drivers: who is called, in which order) → ``invoke`` (one backend invocation, the one call path of
both drivers: admission, call, classification, settling, confinement) and ``policy`` (the server's
backend policy) → ``shadow`` (Shadow-mode calls apart from the review) → ``outcome`` (pure: the
``Outcome`` union, ``apply_failure_policy``, ``settle`` building the reply, annotations and report
once, and the backend policy seam) → the pure helpers ``jsonpatch`` (JSON Patch with upstream
semantics), ``status`` (the Status of every deny), ``annotations`` (audit annotations and
warnings), ``reinvocation`` (round-1 bookkeeping), ``report`` (what observability reads) and
``ports`` (what dispatch needs from transport and sources).
"""
