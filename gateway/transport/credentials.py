"""Per-backend credentials from a kubeconfig-format file (``--backend-kubeconfig``, TRN-10/11).

Loaded once at start (and on reload) into an immutable ``CredentialStore``; ``resolve`` asks it for
the entry of a backend's ``host:port`` and turns the result into request headers and a TLS client
certificate. The file is parsed by the one kubeconfig parser, ``gateway.wire.kubeconfig``; secrets
never appear in ``repr``/``str`` or in errors, so they cannot leak into logs.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path

from gateway.errors import ClientConfigError
from gateway.wire.kubeconfig import Credentials, Header, Kubeconfig, KubeconfigError

__all__ = ["CredentialStore", "Credentials", "Header", "lookup_order"]


def lookup_order(host: str, port: int) -> list[str]:
    """The ``users`` names tried for a backend at host:port, first hit wins (TRN-10 steps 1–4).

    ``a.b.svc:8443`` → ``a.b.svc:8443``, ``*.b.svc:8443``, ``*.svc:8443``, ``*``; with port 443 the
    host without port and its ``*.`` suffixes follow the ported names.
    """
    bare = host.lower()
    hostport = f"[{bare}]:{port}" if _is_ipv6(bare) else f"{bare}:{port}"
    names = [hostport]
    names += [f"*.{suffix}:{port}" for suffix in _dot_suffixes(bare)]
    if port == 443:
        names.append(bare)
        names += [f"*.{suffix}" for suffix in _dot_suffixes(bare)]
    names.append("*")
    return names


def _dot_suffixes(host: str) -> list[str]:
    # upstream: apiserver pkg/util/webhook/authentication.go resolve — drops one leading label at a time.
    if _is_ipv6(host):
        return []
    labels = host.split(".")
    return [".".join(labels[i:]) for i in range(1, len(labels))]


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


class CredentialStore:
    """The parsed ``users`` of a backend kubeconfig; immutable after loading."""

    def __init__(
        self,
        users: Mapping[str, Credentials],
        default: Credentials | None = None,
        files: tuple[Path, ...] = (),
    ) -> None:
        self._users = dict(users)
        self._default = default
        self.files = files  # the kubeconfig and every file it references: watched for rotation

    @classmethod
    def load(cls, path: str | Path) -> CredentialStore:
        """Read a kubeconfig-format file; every problem is a ``ClientConfigError`` naming the entry."""
        try:
            kubeconfig = Kubeconfig.load(path)
        except KubeconfigError as exc:
            raise ClientConfigError(str(exc)) from None
        store = cls._from(kubeconfig)
        store.files = (Path(path), *store.files)
        return store

    @classmethod
    def from_document(
        cls, document: object, *, base_dir: Path | None = None, source: str = "kubeconfig"
    ) -> CredentialStore:
        """A store from a decoded kubeconfig mapping; relative file names resolve in ``base_dir``."""
        try:
            return cls._from(Kubeconfig(document, base_dir=base_dir, source=source))
        except KubeconfigError as exc:
            raise ClientConfigError(str(exc)) from None

    @classmethod
    def _from(cls, kubeconfig: Kubeconfig) -> CredentialStore:
        try:
            users = kubeconfig.users()
            return cls(users, kubeconfig.current_user(users), kubeconfig.files())
        except KubeconfigError as exc:
            raise ClientConfigError(str(exc)) from None

    def lookup(self, host: str, port: int) -> Credentials | None:
        """The credentials for a backend at host:port, per the TRN-10 order, or None."""
        for name in lookup_order(host, port):
            found = self._users.get(name)
            if found is not None:
                return found
        return self._default

    def __repr__(self) -> str:
        return f"<CredentialStore users={len(self._users)} default={'yes' if self._default else 'no'}>"
