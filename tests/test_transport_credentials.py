"""Backend credentials from a kubeconfig-format file (TRN-10 lookup order, TRN-11 kinds, TRN-07)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import trustme

from gateway.config.model import ClientConfig, ServiceReference
from gateway.errors import ClientConfigError
from gateway.transport import CredentialStore, lookup_order, resolve_target


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        pytest.param(
            "a.b.svc",
            8443,
            ["a.b.svc:8443", "*.b.svc:8443", "*.svc:8443", "*"],
            id="TRN-10: exact host:port, then *. suffixes with port longest first, then *",
        ),
        pytest.param(
            "hook.ns.svc",
            443,
            ["hook.ns.svc:443", "*.ns.svc:443", "*.svc:443", "hook.ns.svc", "*.ns.svc", "*.svc", "*"],
            id="TRN-10: with port 443 the host without port and its suffixes follow",
        ),
        pytest.param(
            "localhost", 8080, ["localhost:8080", "*"], id="TRN-10: a single-label host has no suffix"
        ),
        pytest.param(
            "Policy.Example.COM",
            443,
            [
                "policy.example.com:443",
                "*.example.com:443",
                "*.com:443",
                "policy.example.com",
                "*.example.com",
                "*.com",
                "*",
            ],
            id="TRN-10: hosts are compared in lower case",
        ),
        pytest.param(
            "::1", 443, ["[::1]:443", "::1", "*"], id="TRN-10: IPv6 hosts are bracketed with a port"
        ),
    ],
)
def test_lookup_order(host: str, port: int, expected: list[str]) -> None:
    """The users names tried for a backend, first hit wins."""
    assert lookup_order(host, port) == expected


USERS = [
    "a.b.svc:8443",
    "*.b.svc:8443",
    "*.svc:8443",
    "a.b.svc",
    "*.b.svc",
    "*.svc",
    "*",
]


@pytest.mark.parametrize(
    ("present", "host", "port", "winner"),
    [
        pytest.param(USERS, "a.b.svc", 8443, "a.b.svc:8443", id="TRN-10 (1): the exact target wins"),
        pytest.param(
            USERS[1:], "a.b.svc", 8443, "*.b.svc:8443", id="TRN-10 (2): the longest suffix with port"
        ),
        pytest.param(
            USERS[2:], "a.b.svc", 8443, "*.svc:8443", id="TRN-10 (2): then shorter suffixes with port"
        ),
        pytest.param(
            USERS[3:], "a.b.svc", 8443, "*", id="TRN-10 (3): names without port only match port 443"
        ),
        pytest.param(USERS[3:], "a.b.svc", 443, "a.b.svc", id="TRN-10 (3): port 443 matches the bare host"),
        pytest.param(USERS[4:], "a.b.svc", 443, "*.b.svc", id="TRN-10 (3): then the bare suffixes"),
        pytest.param(
            ["*.svc", "*"], "a.b.svc", 443, "*.svc", id="TRN-10 (3): a shorter bare suffix before *"
        ),
        pytest.param(["*"], "x.example.com", 9000, "*", id="TRN-10 (4): * matches everything"),
        pytest.param(
            ["*.b.svc:8443"], "b.svc", 8443, "current", id="TRN-10 (5): else the current context's user"
        ),
    ],
)
def test_lookup_first_hit_wins(present: list[str], host: str, port: int, winner: str) -> None:
    """A store with some users answers with the first name in lookup order."""
    users = [{"name": name, "user": {"token": f"token-{name}"}} for name in present]
    users.append({"name": "current", "user": {"token": "token-current"}})
    store = CredentialStore.from_document(
        {"users": users, "contexts": [{"name": "c", "context": {"user": "current"}}], "current-context": "c"}
    )
    found = store.lookup(host, port)
    assert found is not None
    assert found.name == winner


def test_no_match_means_no_credentials() -> None:
    """TRN-10 (6): without a match and a current context, calls carry no credentials."""
    store = CredentialStore.from_document({"users": [{"name": "other.svc:443", "user": {"token": "t"}}]})
    assert store.lookup("hook.ns.svc", 443) is None


@pytest.fixture(scope="module")
def client_pems() -> tuple[bytes, bytes]:
    leaf = trustme.CA().issue_cert("client.example.com")
    return leaf.cert_chain_pems[0].bytes(), leaf.private_key_pem.bytes()


def test_credential_kinds(tmp_path: Path, client_pems: tuple[bytes, bytes]) -> None:
    """TRN-11: token, tokenFile, basic auth and client certificates (data or files) are read at load."""
    cert, key = client_pems
    (tmp_path / "token").write_text("file-token\n")
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    (tmp_path / "kubeconfig").write_text(
        f"""
apiVersion: v1
kind: Config
users:
- name: token.svc:443
  user: {{token: plain-token}}
- name: file.svc:443
  user: {{tokenFile: token}}
- name: basic.svc:443
  user: {{username: alice, password: s3cret}}
- name: certdata.svc:443
  user:
    client-certificate-data: {base64.b64encode(cert).decode()}
    client-key-data: {base64.b64encode(key).decode()}
- name: certfile.svc:443
  user: {{client-certificate: cert.pem, client-key: key.pem}}
"""
    )
    store = CredentialStore.load(tmp_path / "kubeconfig")
    found = {
        name: store.lookup(f"{name}.svc", 443) for name in ("token", "file", "basic", "certdata", "certfile")
    }
    assert {name: c.headers if c else None for name, c in found.items()} == {
        "token": ((b"authorization", b"Bearer plain-token"),),
        "file": ((b"authorization", b"Bearer file-token"),),
        "basic": ((b"authorization", b"Basic " + base64.b64encode(b"alice:s3cret")),),
        "certdata": (),
        "certfile": (),
    }
    certdata, certfile = found["certdata"], found["certfile"]
    assert certdata is not None
    assert certdata.client_cert is not None
    assert certfile is not None
    assert certfile.client_cert == certdata.client_cert
    assert certdata.client_cert.key_pem == key


@pytest.mark.parametrize(
    ("user", "message"),
    [
        pytest.param(
            {"token": "t", "username": "u", "password": "p"},
            "username/password or bearer token may be set, but not both",
            id="TRN-11: a token together with basic auth is refused at load",
        ),
        pytest.param(
            {"auth-provider": {"name": "gcp"}},
            "auth provider not supported",
            id="TRN-11: auth-provider is refused",
        ),
        pytest.param(
            {"exec": {"command": "get-token"}},
            "exec credential plugins are not supported",
            id="TRN-11: exec is refused",
        ),
        pytest.param(
            {"as": "admin"}, "impersonation is not supported", id="TRN-11: impersonation is refused"
        ),
        pytest.param(
            {"client-certificate-data": base64.b64encode(b"x").decode()},
            "client-certificate and client-key must be given together",
            id="TRN-11: a certificate without its key is refused",
        ),
        pytest.param(
            {"client-key-data": "%%%"},
            "client-key-data is not valid base64",
            id="TRN-11: bad base64 is refused",
        ),
        pytest.param(
            {"tokenFile": "/nonexistent/token"},
            "cannot read tokenFile",
            id="TRN-11: an unreadable tokenFile is refused",
        ),
    ],
)
def test_refused_entries(user: dict[str, object], message: str) -> None:
    """Entries the gateway cannot honour fail the load with a message naming the entry."""
    with pytest.raises(ClientConfigError, match=message) as info:
        CredentialStore.from_document({"users": [{"name": "hook.ns.svc", "user": user}]}, source="creds.yaml")
    assert 'creds.yaml: users[0] "hook.ns.svc"' in str(info.value)


def test_unknown_current_context_is_refused() -> None:
    """A current-context that names no context is a load error."""
    with pytest.raises(ClientConfigError, match='current-context "missing" not found'):
        CredentialStore.from_document({"current-context": "missing"})


def test_secrets_never_in_repr(client_pems: tuple[bytes, bytes]) -> None:
    """Credentials print their name, kinds and a digest, never the secret material."""
    cert, key = client_pems
    store = CredentialStore.from_document(
        {
            "users": [
                {
                    "name": "*",
                    "user": {
                        "username": "alice",
                        "password": "hunter2",
                        "client-certificate-data": base64.b64encode(cert).decode(),
                        "client-key-data": base64.b64encode(key).decode(),
                    },
                }
            ]
        }
    )
    found = store.lookup("x", 1)
    assert found is not None
    text = repr(found) + str(found) + repr(found.client_cert) + repr(store)
    assert "hunter2" not in text
    assert "alice" not in text
    assert "PRIVATE" not in text
    assert text.startswith("<Credentials '*' basic+client-certificate ")


def test_unusable_client_certificate_fails_resolution() -> None:
    """TRN-07: a client certificate that does not load makes resolution (every call) fail."""
    bogus = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").decode()
    store = CredentialStore.from_document(
        {"users": [{"name": "*", "user": {"client-certificate-data": bogus, "client-key-data": bogus}}]}
    )
    config = ClientConfig(service=ServiceReference(namespace="ns", name="hook"))
    with pytest.raises(ClientConfigError, match=r"^tls: "):
        resolve_target(config, store)


def test_token_file_wins_over_token(tmp_path: Path) -> None:
    """TRN-11: with both ``token`` and ``tokenFile``, the file's token is sent (as client-go does)."""
    (tmp_path / "token").write_text("from-file\n")
    store = CredentialStore.from_document(
        {"users": [{"name": "*", "user": {"token": "inline", "tokenFile": "token"}}]}, base_dir=tmp_path
    )
    found = store.lookup("hook.ns.svc", 443)
    assert found is not None
    assert found.headers == ((b"authorization", b"Bearer from-file"),)
