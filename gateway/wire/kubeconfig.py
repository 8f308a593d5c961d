"""The one kubeconfig-format parser: backend credentials (TRN-10/11) and the cluster client (GW-01).

``Kubeconfig.load`` reads a file; ``users`` gives every ``users`` entry as ``Credentials`` (the
backend credential store looks them up by host), ``context`` the cluster and user of one context
(the Kubernetes API client). The same rules apply to both: ``exec``, ``auth-provider`` and
impersonation are refused, a token never goes with basic auth, a certificate never without its key.

Credential files hold secrets, so no error ever quotes the file: YAML syntax errors name the line
and column only (never the parser's context lines), values are never echoed, and URLs lose their
user information. Every error is one line naming the file and the field.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.errors import GatewayError
from gateway.wire.redact import redact_url
from gateway.wire.tls import ClientCertificate

__all__ = ["Cluster", "Context", "Credentials", "Kubeconfig", "KubeconfigError", "redact_url"]

Header = tuple[bytes, bytes]

_REFUSED_FIELDS = {
    "auth-provider": "auth provider not supported",
    "exec": "exec credential plugins are not supported",
    "as": "impersonation is not supported",
    "as-groups": "impersonation is not supported",
    "as-uid": "impersonation is not supported",
    "as-user-extra": "impersonation is not supported",
}
_FILE_FIELDS = ("tokenFile", "client-certificate", "client-key")


class KubeconfigError(GatewayError):
    """A kubeconfig-format file cannot be used: one line naming file and field, never a secret."""


@dataclass(frozen=True, slots=True, repr=False)
class Credentials:
    """What one ``users`` entry provides: a bearer token, basic auth and/or a client certificate.

    ``token_file`` is where the token came from (read at load into ``token``); a client that must
    follow rotation re-reads it.
    """

    name: str
    token: str | None = None
    username: str | None = None
    password: str | None = None
    client_cert: ClientCertificate | None = None
    token_file: Path | None = None

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


@dataclass(frozen=True, slots=True)
class Cluster:
    """A ``clusters`` entry: where the API server is and how to trust it."""

    server: str
    ca_pem: bytes | None = None
    insecure: bool = False
    tls_server_name: str | None = None


@dataclass(frozen=True, slots=True)
class Context:
    """A context resolved to its cluster and user (``user`` None: anonymous)."""

    name: str
    cluster: Cluster
    user: Credentials | None
    namespace: str


class Kubeconfig:
    """A decoded kubeconfig document; relative file names resolve in ``base_dir``."""

    def __init__(self, document: object, *, base_dir: Path | None = None, source: str = "kubeconfig") -> None:
        if document is None:
            document = {}
        if not isinstance(document, dict):
            raise KubeconfigError(f"{source}: a kubeconfig must be a mapping")
        self.document: dict[str, Any] = document
        self.base = base_dir or Path()
        self.source = source

    @classmethod
    def load(cls, path: str | Path) -> Kubeconfig:
        """Read a kubeconfig-format file (YAML or JSON)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            problem = f"not UTF-8 text (byte {exc.start})"
            raise KubeconfigError(f"{path}: cannot read kubeconfig: {problem}") from None
        except OSError as exc:
            raise KubeconfigError(f"{path}: cannot read kubeconfig: {exc.strerror or exc}") from None
        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            # Never str(exc): PyYAML quotes the lines around the error, which may hold a token.
            raise KubeconfigError(f"{path}: cannot read kubeconfig: {_yaml_problem(exc)}") from None
        return cls(document, base_dir=path.parent, source=str(path))

    def files(self) -> tuple[Path, ...]:
        """Every file the ``users`` entries reference (tokens, certificates, keys)."""
        files: list[Path] = []
        for entry in self._entries("users"):
            user = entry.get("user")
            if isinstance(user, dict):
                files += [self.base / str(user[k]) for k in _FILE_FIELDS if isinstance(user.get(k), str)]
        return tuple(files)

    def users(self) -> dict[str, Credentials]:
        """Every ``users`` entry by name; any unusable entry fails the whole file."""
        users: dict[str, Credentials] = {}
        for index, entry in enumerate(self.document.get("users") or []):
            where = f"{self.source}: users[{index}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise KubeconfigError(f"{where}: each entry needs a name")
            name = entry["name"]
            if name in users:
                raise KubeconfigError(f'{where} "{name}": duplicate name')
            users[name] = self._user(name, entry.get("user") or {}, f'{where} "{name}"')
        return users

    def current_user(self, users: Mapping[str, Credentials]) -> Credentials | None:
        """The user of ``current-context``, if it names one."""
        current = self.document.get("current-context")
        if not current:
            return None
        context = self._context(str(current))
        user_name = context.get("user")
        if not user_name:
            return None
        if user_name not in users:
            raise KubeconfigError(f'{self.source}: context "{current}" names unknown user "{user_name}"')
        return users[user_name]

    def context(self, name: str | None = None) -> Context:
        """The cluster and user of context ``name`` (default: ``current-context``)."""
        chosen_by = "context" if name else "current-context"
        name = name or str(self.document.get("current-context") or "")
        context = self._context(name, chosen_by)
        cluster_name = str(context.get("cluster", ""))
        cluster = self._named("clusters", "cluster", cluster_name)
        where = f'{self.source}: clusters "{cluster_name}"'
        server = cluster.get("server")
        if not isinstance(server, str) or urlsplit(server).scheme not in ("https", "http"):
            shown = redact_url(server) if isinstance(server, str) else ""
            raise KubeconfigError(f'{where}: server "{shown}" must be an https URL')
        user_name = str(context.get("user") or "")
        user = None
        if user_name:
            entry = self._named("users", "user", user_name)
            user = self._user(user_name, entry, f'{self.source}: users "{user_name}"')
        tls_server_name = cluster.get("tls-server-name")
        return Context(
            name=name,
            cluster=Cluster(
                server=server.rstrip("/"),
                ca_pem=_pem(cluster, "certificate-authority", self.base, where),
                insecure=bool(cluster.get("insecure-skip-tls-verify")),
                tls_server_name=str(tls_server_name) if tls_server_name else None,
            ),
            user=user,
            namespace=str(context.get("namespace") or "default"),
        )

    def _entries(self, section: str) -> list[dict[str, Any]]:
        return [entry for entry in self.document.get(section) or () if isinstance(entry, dict)]

    def _context(self, name: str, chosen_by: str = "current-context") -> dict[str, Any]:
        for entry in self._entries("contexts"):
            if entry.get("name") == name:
                context = entry.get("context") or {}
                if not isinstance(context, dict):
                    raise KubeconfigError(f'{self.source}: contexts "{name}": context must be a mapping')
                return context
        raise KubeconfigError(f'{self.source}: {chosen_by} "{name}" not found in contexts')

    def _named(self, section: str, key: str, name: str) -> dict[str, Any]:
        for entry in self._entries(section):
            if entry.get("name") == name and isinstance(entry.get(key), dict):
                return entry[key]  # type: ignore[no-any-return]
        raise KubeconfigError(f'{self.source}: no {key} named "{name}" in {section}')

    def _user(self, name: str, user: object, where: str) -> Credentials:
        if not isinstance(user, dict):
            raise KubeconfigError(f"{where}: user must be a mapping")
        for field, message in _REFUSED_FIELDS.items():
            if user.get(field):
                raise KubeconfigError(f"{where}: {message} ({field})")
        token = _string(user, "token", where)
        token_file_name = _string(user, "tokenFile", where)
        token_file = self.base / token_file_name if token_file_name is not None else None
        if token_file is not None:  # as in client-go, the file's token wins over ``token``
            token = _read(token_file, where, "tokenFile").decode("utf-8", "replace").strip()
        username = _string(user, "username", where)
        password = _string(user, "password", where)
        if token is not None and (username is not None or password is not None):
            raise KubeconfigError(
                f"{where}: username/password or bearer token may be set, but not both (token, username)"
            )
        cert = _pem(user, "client-certificate", self.base, where)
        key = _pem(user, "client-key", self.base, where)
        if (cert is None) != (key is None):
            raise KubeconfigError(
                f"{where}: client-certificate and client-key must be given together"
                f" ({'client-key' if cert is not None else 'client-certificate'} missing)"
            )
        client_cert = ClientCertificate(cert, key) if cert is not None and key is not None else None
        return Credentials(
            name,
            token=token,
            username=username,
            password=password,
            client_cert=client_cert,
            token_file=token_file,
        )


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        return f"{where}{exc.problem or exc.context or 'invalid YAML'}"
    return "invalid YAML"


def _string(entry: dict[str, Any], field: str, where: str) -> str | None:
    value = entry.get(field)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise KubeconfigError(f"{where}: {field} must be a string")
    return value


def _pem(entry: dict[str, Any], field: str, base: Path, where: str) -> bytes | None:
    data = _string(entry, f"{field}-data", where)
    if data is not None:
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise KubeconfigError(f"{where}: {field}-data is not valid base64") from None
    path = _string(entry, field, where)
    return None if path is None else _read(base / path, where, field)


def _read(path: Path, where: str, field: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KubeconfigError(f"{where}: cannot read {field} {str(path)!r}: {exc.strerror}") from None
