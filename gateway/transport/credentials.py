"""Per-backend credentials from a kubeconfig-format file (``--backend-kubeconfig``, TRN-10/11).

Loaded once at start (and on reload) into an immutable ``CredentialStore``; ``resolve`` asks it for
the entry of a backend's ``host:port`` and turns the result into request headers and a TLS client
certificate. Secrets never appear in ``repr``/``str`` so they cannot leak into logs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from gateway.errors import ClientConfigError
from gateway.transport.tls import ClientCertificate

Header = tuple[bytes, bytes]

_REFUSED_FIELDS = {
    "auth-provider": "auth provider not supported",
    "exec": "exec credential plugins are not supported",
    "as": "impersonation is not supported",
    "as-groups": "impersonation is not supported",
    "as-uid": "impersonation is not supported",
    "as-user-extra": "impersonation is not supported",
}


@dataclass(frozen=True, slots=True, repr=False)
class Credentials:
    """What one ``users`` entry provides: a bearer token, basic auth and/or a client certificate."""

    name: str
    token: str | None = None
    username: str | None = None
    password: str | None = None
    client_cert: ClientCertificate | None = None

    @property
    def headers(self) -> tuple[Header, ...]:
        """The ``Authorization`` header this entry adds to every call (empty for certificates only)."""
        if self.token is not None:
            return ((b"authorization", b"Bearer " + self.token.encode()),)
        if self.username is not None or self.password is not None:
            pair = f"{self.username or ''}:{self.password or ''}".encode()
            return ((b"authorization", b"Basic " + base64.b64encode(pair)),)
        return ()

    @property
    def identity(self) -> str:
        """A digest naming these credentials, safe to log and used in pool origin keys (TRN-08)."""
        digest = hashlib.sha256()
        for part in (self.token, self.username, self.password):
            digest.update(b"\0" + (part.encode() if part is not None else b"-"))
        digest.update(b"\0" + (self.client_cert.identity.encode() if self.client_cert else b"-"))
        return digest.hexdigest()[:16]

    @property
    def kinds(self) -> tuple[str, ...]:
        kinds = []
        if self.token is not None:
            kinds.append("token")
        if self.username is not None or self.password is not None:
            kinds.append("basic")
        if self.client_cert is not None:
            kinds.append("client-certificate")
        return tuple(kinds)

    def __repr__(self) -> str:
        return f"<Credentials {self.name!r} {'+'.join(self.kinds) or 'none'} {self.identity}>"

    __str__ = __repr__


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


_FILE_FIELDS = ("tokenFile", "client-certificate", "client-key")


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
        path = Path(path)
        try:
            document = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ClientConfigError(f"{path}: cannot read kubeconfig: {exc}") from exc
        store = cls.from_document(document, base_dir=path.parent, source=str(path))
        store.files = (path, *store.files)
        return store

    @classmethod
    def from_document(
        cls, document: object, *, base_dir: Path | None = None, source: str = "kubeconfig"
    ) -> CredentialStore:
        """A store from a decoded kubeconfig mapping; relative file names resolve in ``base_dir``."""
        if document is None:
            document = {}
        if not isinstance(document, dict):
            raise ClientConfigError(f"{source}: a kubeconfig must be a mapping")
        base = base_dir or Path()
        users: dict[str, Credentials] = {}
        files: list[Path] = []
        for index, entry in enumerate(document.get("users") or []):
            where = f"{source}: users[{index}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ClientConfigError(f"{where}: each entry needs a name")
            name = entry["name"]
            user = entry.get("user")
            if isinstance(user, dict):
                files += [base / str(user[k]) for k in _FILE_FIELDS if isinstance(user.get(k), str)]
            if name in users:
                raise ClientConfigError(f'{where} "{name}": duplicate name')
            users[name] = _parse_user(name, entry.get("user") or {}, base, f'{where} "{name}"')
        default = None
        current = document.get("current-context")
        if current:
            contexts = {
                c.get("name"): c.get("context") or {}
                for c in document.get("contexts") or []
                if isinstance(c, dict)
            }
            if current not in contexts:
                raise ClientConfigError(f'{source}: current-context "{current}" not found in contexts')
            user_name = contexts[current].get("user")
            if user_name:
                if user_name not in users:
                    raise ClientConfigError(f'{source}: context "{current}" names unknown user "{user_name}"')
                default = users[user_name]
        return cls(users, default, tuple(files))

    def lookup(self, host: str, port: int) -> Credentials | None:
        """The credentials for a backend at host:port, per the TRN-10 order, or None."""
        for name in lookup_order(host, port):
            found = self._users.get(name)
            if found is not None:
                return found
        return self._default

    def __repr__(self) -> str:
        return f"<CredentialStore users={len(self._users)} default={'yes' if self._default else 'no'}>"


def _parse_user(name: str, user: object, base: Path, where: str) -> Credentials:
    if not isinstance(user, dict):
        raise ClientConfigError(f"{where}: user must be a mapping")
    for field, message in _REFUSED_FIELDS.items():
        if user.get(field):
            raise ClientConfigError(f"{where}: {message} ({field})")
    token = _string(user, "token", where)
    token_file = _string(user, "tokenFile", where)
    if token is None and token_file is not None:
        token = _read(base / token_file, where, "tokenFile").decode("utf-8", "replace").strip()
    username = _string(user, "username", where)
    password = _string(user, "password", where)
    if token is not None and (username is not None or password is not None):
        raise ClientConfigError(f"{where}: username/password or bearer token may be set, but not both")
    cert = _pem(user, "client-certificate", base, where)
    key = _pem(user, "client-key", base, where)
    if (cert is None) != (key is None):
        raise ClientConfigError(f"{where}: client-certificate and client-key must be given together")
    client_cert = ClientCertificate(cert, key) if cert is not None and key is not None else None
    return Credentials(name, token=token, username=username, password=password, client_cert=client_cert)


def _string(user: dict[str, object], field: str, where: str) -> str | None:
    value = user.get(field)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ClientConfigError(f"{where}: {field} must be a string")
    return value


def _pem(user: dict[str, object], field: str, base: Path, where: str) -> bytes | None:
    data = _string(user, f"{field}-data", where)
    if data is not None:
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ClientConfigError(f"{where}: {field}-data is not valid base64") from exc
    path = _string(user, field, where)
    return None if path is None else _read(base / path, where, field)


def _read(path: Path, where: str, field: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ClientConfigError(f"{where}: cannot read {field} {str(path)!r}: {exc.strerror}") from exc
