"""webhook-gateway: one admission webhook in front of many."""

__version__ = "0.1.0"
