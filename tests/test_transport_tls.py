"""TLS and credentials on real connections: caBundle trust, SAN names, client certificates, auth headers.

Covers TRN-06 (trust and hostname), TRN-10/11 (credentials on the wire) and ERR-06 (`certificate`).
"""

from __future__ import annotations

import base64
import datetime
import ssl

import pytest
import trio
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.config.model import ClientConfig, ServiceReference
from gateway.errors import TransportError
from gateway.transport import ClientPool, CredentialStore, resolve_target
from tests.support.httpservers import BackendServer, server_context


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def other_ca() -> trustme.CA:
    return trustme.CA()


def _cn_only_context() -> tuple[ssl.SSLContext, bytes]:
    """A server context whose certificate names `localhost` only in its CN (no subjectAltName)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cn-only test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with trustme.Blob(
        leaf.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    ).tempfile() as path:
        context.load_cert_chain(path)
    return context, ca_cert.public_bytes(serialization.Encoding.PEM)


async def _call(pool: ClientPool, config: ClientConfig, store: CredentialStore | None = None) -> int:
    response = await pool.post(resolve_target(config, store), body=b"{}", timeout_seconds=5)
    return response.status


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        pytest.param("trusted url", None, id="TRN-06: a url host certified by the caBundle is trusted"),
        pytest.param("trusted service", None, id="TRN-06: a service certified for <name>.<namespace>.svc"),
        pytest.param(
            "other CA",
            "tls: failed to verify certificate: x509: certificate signed by unknown authority",
            id="TRN-06/ERR-06: a certificate from another CA fails with `certificate`",
        ),
        pytest.param(
            "system roots",
            "tls: failed to verify certificate: x509: certificate signed by unknown authority",
            id="TRN-06: without caBundle the system roots decide (and do not know the test CA)",
        ),
        pytest.param(
            "wrong service name",
            "tls: failed to verify certificate: x509: certificate is not valid for hook.ns.svc",
            id="TRN-06: a certificate for another service name fails",
        ),
    ],
)
async def test_server_verification(
    nursery: trio.Nursery, ca: trustme.CA, other_ca: trustme.CA, case: str, cause: str | None
) -> None:
    """The server certificate is verified against caBundle (or system roots) and the SAN names."""
    names = ("other.ns.svc",) if case == "wrong service name" else ("hook.ns.svc", "localhost")
    server: BackendServer = await nursery.start(BackendServer(ssl_context=server_context(ca, *names)).serve)
    bundle = {"other CA": other_ca.cert_pem.bytes(), "system roots": b""}.get(case, ca.cert_pem.bytes())
    if "service" in case:
        config = ClientConfig(service=ServiceReference(namespace="ns", name="hook"), ca_bundle=bundle)
    else:
        config = ClientConfig(url=server.url("/", host="localhost"), ca_bundle=bundle)
    async with ClientPool(connect_override={"hook.ns.svc": ("127.0.0.1", server.port)}) as pool:
        if cause is None:
            assert await _call(pool, config) == 200
        else:
            with pytest.raises(TransportError) as info:
                await _call(pool, config)
            assert info.value.cause == cause
            assert server.requests == []


async def test_certificate_without_san_fails(nursery: trio.Nursery) -> None:
    """TRN-06: hostnames are checked against subjectAltName only; a CN-only certificate fails."""
    context, ca_pem = _cn_only_context()
    server: BackendServer = await nursery.start(BackendServer(ssl_context=context).serve)
    config = ClientConfig(url=server.url("/", host="localhost"), ca_bundle=ca_pem)
    async with ClientPool() as pool:
        with pytest.raises(TransportError, match="certificate"):
            await _call(pool, config)


def _store(name: str, user: dict[str, str]) -> CredentialStore:
    return CredentialStore.from_document({"users": [{"name": name, "user": user}]})


async def test_client_certificate_authentication(nursery: trio.Nursery, ca: trustme.CA) -> None:
    """TRN-11: a matched client certificate is presented; without one the server refuses the call."""
    client_ca = trustme.CA()
    leaf = client_ca.issue_cert("gateway.example.com")
    context = server_context(ca, "localhost", client_ca=client_ca)
    server: BackendServer = await nursery.start(BackendServer(ssl_context=context).serve)
    config = ClientConfig(url=server.url("/", host="localhost"), ca_bundle=ca.cert_pem.bytes())
    store = _store(
        f"localhost:{server.port}",
        {
            "client-certificate-data": base64.b64encode(leaf.cert_chain_pems[0].bytes()).decode(),
            "client-key-data": base64.b64encode(leaf.private_key_pem.bytes()).decode(),
        },
    )
    async with ClientPool() as pool:
        assert await _call(pool, config, store) == 200
        # (The test server drops the connection without a TLS alert, so only the failure is checked.)
        with pytest.raises(TransportError):
            await _call(pool, config, None)
    [seen] = server.requests
    assert seen.client_cert is not None
    assert seen.client_cert["subjectAltName"] == (("DNS", "gateway.example.com"),)


@pytest.mark.parametrize(
    ("user", "authorization"),
    [
        pytest.param({"token": "t0ken"}, "Bearer t0ken", id="TRN-11: a token is sent as a bearer token"),
        pytest.param(
            {"username": "alice", "password": "s3cret"},
            "Basic " + base64.b64encode(b"alice:s3cret").decode(),
            id="TRN-11: username/password are sent as basic auth",
        ),
        pytest.param({}, None, id="TRN-11: an entry without secrets sends no Authorization"),
    ],
)
async def test_authorization_header(
    nursery: trio.Nursery, ca: trustme.CA, user: dict[str, str], authorization: str | None
) -> None:
    """TRN-10/11: the credentials matched for hook.ns.svc:443 reach the server on every call."""
    server: BackendServer = await nursery.start(
        BackendServer(ssl_context=server_context(ca, "hook.ns.svc")).serve
    )
    config = ClientConfig(
        service=ServiceReference(namespace="ns", name="hook"), ca_bundle=ca.cert_pem.bytes()
    )
    store = _store("*.ns.svc", user)
    async with ClientPool(connect_override={"hook.ns.svc": ("127.0.0.1", server.port)}) as pool:
        for _ in range(2):
            assert await _call(pool, config, store) == 200
    assert [r.headers.get("authorization") for r in server.requests] == [authorization] * 2
    assert server.connections == 1
