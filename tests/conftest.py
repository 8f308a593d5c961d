"""Shared fixtures. Servers and clients the fixtures build live in tests/support/."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.support.controlplane import control_plane, kube_namespace  # noqa: F401 - the real control plane
from tests.support.kubeapi import kube_api  # noqa: F401 - a fixture: the fake kube-apiserver
from tests.support.tools import STRICT_ENV, strict


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None]:
    """Under CI (``WEBHOOK_GATEWAY_TESTS_STRICT=1``, set by .ci/run) a skipped test is a failed test.

    Skips exist only so that the README's test command passes on a machine without the external
    tools (tests/support/tools.py); in CI they would hide a test, so they fail it instead.
    """
    outcome = yield
    report = outcome.get_result()
    if report.skipped and strict() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under {STRICT_ENV}=1 (CI runs every test): {reason}"
