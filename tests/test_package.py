"""The package imports cheaply and tells its version."""

import gateway


def test_version_is_a_string() -> None:
    """The package exposes a PEP 440 version string."""
    assert gateway.__version__.count(".") == 2
