"""External tools some tests need: found, or the test skips with one line naming how to get it.

``python -m pytest`` must pass on a fresh machine with only the Python extras installed, so a test
that needs ``kubectl``, ``promtool``, ``prometheus``, ``nginx`` or the real control plane
(``KUBEBUILDER_ASSETS``) skips with one line saying what to install. CI installs all of them, and
``.ci/run`` sets ``WEBHOOK_GATEWAY_TESTS_STRICT=1``, under which tests/conftest.py turns every skip
into a failure: in CI a missing tool can never hide a test.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

STRICT_ENV = "WEBHOOK_GATEWAY_TESTS_STRICT"

# name -> how to get it (Debian package; the README's test command needs none of them to pass)
DEBIAN_PACKAGES = {
    "kubectl": "kubernetes-client",
    "promtool": "prometheus",
    "prometheus": "prometheus",
    "nginx": "nginx-light",
}
_SBIN = (Path("/usr/sbin"), Path("/usr/local/sbin"))  # nginx lives here, outside a user's PATH


def strict() -> bool:
    """True under CI (.ci/run): every skip is a failure."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for directory in _SBIN:
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def require_tool(name: str) -> str:
    """The tool's path, or skip this test with one line naming the Debian package that brings it."""
    found = find_tool(name)
    if found is None:
        package = DEBIAN_PACKAGES.get(name, name)
        pytest.skip(f"{name} is not installed (Debian: apt-get install {package}; .ci/run installs it)")
    return found


KUBE_ASSETS_ENV = "KUBEBUILDER_ASSETS"
KUBE_BINARIES = ("etcd", "kube-apiserver", "kubectl")


def require_kube_assets() -> Path:
    """The directory holding etcd, kube-apiserver and kubectl (envtest's layout), or skip with how to get it."""
    value = os.environ.get(KUBE_ASSETS_ENV, "")
    hint = (
        f"set {KUBE_ASSETS_ENV} to a directory with etcd, kube-apiserver and kubectl "
        "(envtest: KUBEBUILDER_ASSETS=$(setup-envtest use 1.36 -p path); .ci/run sets it)"
    )
    if not value:
        pytest.skip(f"the real control plane is not available: {hint}")
    directory = Path(value)
    missing = [b for b in KUBE_BINARIES if not (directory / b).is_file()]
    if missing:
        pytest.skip(f"{KUBE_ASSETS_ENV}={value} lacks {', '.join(missing)}: {hint}")
    return directory
