"""CRD conversion webhooks fronted by the gateway (docs/behaviour.md#conversion).

``codec`` reads and writes ConversionReviews (v1 and v1beta1), ``verify`` checks a backend's reply
(CNV-09..11), ``cache`` is the opt-in per-object cache of converted objects, and ``convert`` drives
one conversion over the gateway's shared backend transport. ``codec``, ``verify`` and ``cache`` are
pure (no I/O); only ``convert`` awaits.
"""
