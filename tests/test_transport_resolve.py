"""Resolving a backend's clientConfig into a call target (TRN-01..08, FPT-06, TRN-07)."""

from __future__ import annotations

import traceback

import pytest
import trustme

from gateway.config.model import ClientConfig, ServiceReference
from gateway.errors import ClientConfigError
from gateway.transport import CredentialStore, Targets, go_duration, normalize_path, resolve_target
from gateway.transport.resolve import is_loopback_host


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        pytest.param(1, "1s", id="FPT-06: one second is 1s"),
        pytest.param(10, "10s", id="FPT-06: the v1 default of 10 seconds is 10s"),
        pytest.param(59, "59s", id="FPT-06: 59 seconds stay in seconds"),
        pytest.param(60, "1m0s", id="FPT-06: a minute is 1m0s"),
        pytest.param(61, "1m1s", id="FPT-06: 61 seconds are 1m1s"),
        pytest.param(3599, "59m59s", id="FPT-06: just under an hour is 59m59s"),
        pytest.param(3600, "1h0m0s", id="FPT-06: an hour is 1h0m0s"),
        pytest.param(3725, "1h2m5s", id="FPT-06: hours, minutes and seconds"),
        pytest.param(0, "0s", id="FPT-06: zero is 0s"),
    ],
)
def test_go_duration(seconds: int, expected: str) -> None:
    """Whole seconds are written in Go's duration format."""
    assert go_duration(seconds) == expected


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        pytest.param(10, "10s", id="FPT-06: a 10 s limit is sent as ?timeout=10s"),
        pytest.param(2.3, "3s", id="FPT-06: 2.3 s left rounds up to 3s"),
        pytest.param(0.001, "1s", id="FPT-06: a millisecond left rounds up to 1s"),
        pytest.param(30.0, "30s", id="FPT-06: exactly 30 s stays 30s"),
        pytest.param(60.5, "1m1s", id="FPT-06: 60.5 s rounds up to 1m1s"),
    ],
)
def test_timeout_query_parameter(timeout: float, expected: str) -> None:
    """The remaining time is rounded up and is the only query parameter (FPT-06, TRN-04)."""
    config = ClientConfig(service=ServiceReference(namespace="security", name="policy", path="/validate"))
    target = resolve_target(config, None)
    assert target.url_for(timeout) == f"https://policy.security.svc:443/validate?timeout={expected}"
    assert target.request_target(timeout) == f"/validate?timeout={expected}"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param("", "/", id="TRN-03: an empty path becomes /"),
        pytest.param("/", "/", id="TRN-03: / stays /"),
        pytest.param("/validate/", "/validate", id="TRN-03: a trailing / is removed"),
        pytest.param("validate", "/validate", id="TRN-03: a leading / is ensured"),
        pytest.param("/a//b///c", "/a/b/c", id="TRN-03: repeated / collapse"),
        pytest.param("/a/./b/.", "/a/b", id="TRN-03: . segments resolve"),
        pytest.param("/a/b/../c", "/a/c", id="TRN-03: .. removes the previous segment"),
        pytest.param("/../../a", "/a", id="TRN-03: .. never climbs above the root"),
        pytest.param("//x", "/x", id="TRN-03: a leading // collapses too"),
    ],
)
def test_normalize_path(path: str, expected: str) -> None:
    """Request paths are normalised like POSIX paths."""
    assert normalize_path(path) == expected


@pytest.mark.parametrize(
    ("config", "url", "server_hostname", "http2"),
    [
        pytest.param(
            ClientConfig(service=ServiceReference(namespace="ns", name="hook")),
            "https://hook.ns.svc:443/?timeout=10s",
            "hook.ns.svc",
            False,
            id="TRN-01/09, GW-14: a service is called by its DNS name, port 443 and path / by default",
        ),
        pytest.param(
            ClientConfig(service=ServiceReference(namespace="ns", name="hook", port=8443, path="/v/")),
            "https://hook.ns.svc:8443/v?timeout=10s",
            "hook.ns.svc",
            False,
            id="TRN-01/03: a service's port and normalised path are used",
        ),
        pytest.param(
            ClientConfig(url="https://Policy.Example.com/validate"),
            "https://Policy.Example.com/validate?timeout=10s",
            "policy.example.com",
            False,
            id="TRN-02/06: a url is called as written and verified against its host",
        ),
        pytest.param(
            ClientConfig(url="https://policy.example.com:9443/a/../b/"),
            "https://policy.example.com:9443/b?timeout=10s",
            "policy.example.com",
            False,
            id="TRN-02/03: a url keeps its port and gets a normalised path",
        ),
        pytest.param(
            ClientConfig(url="https://127.0.0.1:8443"),
            "https://127.0.0.1:8443/?timeout=10s",
            "127.0.0.1",
            True,
            id="TRN-08: a loopback IPv4 url may speak HTTP/2",
        ),
        pytest.param(
            ClientConfig(url="https://[::1]:8443/x"),
            "https://[::1]:8443/x?timeout=10s",
            "::1",
            True,
            id="TRN-08: the IPv6 loopback url may speak HTTP/2",
        ),
        pytest.param(
            ClientConfig(url="http://LocalHost:8080/hook"),
            "http://LocalHost:8080/hook?timeout=10s",
            None,
            True,
            id="CFG-15/TRN-08: plain http to localhost has no TLS and may speak HTTP/2",
        ),
    ],
)
def test_resolve_target(config: ClientConfig, url: str, server_hostname: str | None, http2: bool) -> None:
    """Service references and urls resolve to URL, TLS server name and HTTP/2 permission."""
    target = resolve_target(config, None)
    assert target.url_for(10) == url
    assert target.server_hostname == server_hostname
    assert target.http2_allowed is http2
    assert (target.ssl_context is None) is (server_hostname is None)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        pytest.param("localhost", True, id="TRN-08: localhost is loopback"),
        pytest.param("LOCALHOST", True, id="TRN-08: localhost in any case is loopback"),
        pytest.param("127.0.0.1", True, id="TRN-08: 127.0.0.1 is loopback"),
        pytest.param("127.255.0.9", True, id="TRN-08: all of 127.0.0.0/8 is loopback"),
        pytest.param("::1", True, id="TRN-08: ::1 is loopback"),
        pytest.param("128.0.0.1", False, id="TRN-08: 128.0.0.1 is not loopback"),
        pytest.param("localhost.example.com", False, id="TRN-08: a name containing localhost is not"),
        pytest.param("hook.ns.svc", False, id="TRN-08: a service name is not loopback"),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    """Only loopback hosts may be offered HTTP/2."""
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize(
    "ca_bundle",
    [
        pytest.param(b"not a certificate", id="TRN-07: a caBundle without PEM is unusable"),
        pytest.param(
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            id="TRN-07: a caBundle with a broken PEM block is unusable",
        ),
        pytest.param("é".encode(), id="TRN-07: a caBundle that is not ASCII is unusable"),
    ],
)
def test_unusable_ca_bundle(ca_bundle: bytes) -> None:
    """An unusable caBundle fails resolution with ClientConfigError, on every call, each a new error."""
    config = ClientConfig(url="https://hook.example.com/", ca_bundle=ca_bundle)
    for _ in range(2):
        with pytest.raises(ClientConfigError, match="unable to load root certificates"):
            resolve_target(config, None)
    targets = Targets(None)
    errors = []
    for _ in range(3):
        with pytest.raises(ClientConfigError, match="unable to load root certificates") as info:
            targets.get(config)
        errors.append(info.value)
    # TRN-07: a fresh value per call; a re-raised stored error would grow its traceback each time.
    assert len({id(error) for error in errors}) == 3
    assert len({len(traceback.extract_tb(error.__traceback__)) for error in errors}) == 1


def test_targets_and_contexts_are_built_once(ca: trustme.CA) -> None:
    """A caller's table resolves the same config once; equal TLS settings share one SSLContext."""
    bundle = ca.cert_pem.bytes()
    targets = Targets(None)
    first = targets.get(ClientConfig(url="https://a.example.com/x", ca_bundle=bundle))
    again = targets.get(ClientConfig(url="https://a.example.com/x", ca_bundle=bundle))
    other_path = targets.get(ClientConfig(url="https://b.example.com/y", ca_bundle=bundle))
    assert again is first
    assert other_path.ssl_context is first.ssl_context


def test_targets_live_as_long_as_their_snapshot(ca: trustme.CA) -> None:
    """``retain`` keeps the targets of the new snapshot's configs and forgets every other one."""
    kept = ClientConfig(url="https://a.example.com/x", ca_bundle=ca.cert_pem.bytes())
    dropped = ClientConfig(url="https://b.example.com/y")
    targets = Targets(None)
    first = targets.get(kept)
    targets.get(dropped)
    targets.retain([kept])
    assert targets.client_configs() == [kept]
    assert targets.get(kept).ssl_context is first.ssl_context  # a context still in use is kept


def test_origin_key_separates_tls_settings_and_credentials(ca: trustme.CA) -> None:
    """Connections are pooled per (scheme, host, port, TLS settings, credentials) (TRN-08)."""
    store = CredentialStore.from_document({"users": [{"name": "a.example.com", "user": {"token": "secret"}}]})
    plain = resolve_target(ClientConfig(url="https://a.example.com/x"), None)
    same_origin = resolve_target(ClientConfig(url="https://a.example.com:443/y"), None)
    other_ca = resolve_target(
        ClientConfig(url="https://a.example.com/x", ca_bundle=ca.cert_pem.bytes()), None
    )
    with_token = resolve_target(ClientConfig(url="https://a.example.com/x"), store)
    assert plain.origin == same_origin.origin
    assert len({plain.origin, other_ca.origin, with_token.origin}) == 3
    assert with_token.auth_headers == ((b"authorization", b"Bearer secret"),)
    assert "secret" not in repr(with_token)
