"""Shared fixtures. Servers and clients the fixtures build live in tests/support/."""

from tests.support.controlplane import control_plane, kube_namespace  # noqa: F401 - the real control plane
from tests.support.kubeapi import kube_api  # noqa: F401 - a fixture: the fake kube-apiserver
