"""Shared fixtures. Fixtures that start servers live in tests/support/."""
