"""Namespace label sources (GW-01, MAT-16/17, MAT-33): file mode, and the faults of cluster mode.

Lists, watch events, relabelling, deletion and expiry run against the real kube-apiserver in
tests/test_kube_reflector.py. Here the fake apiserver stays for what the real one cannot be made to
do on demand (each test says which): 5xx answers, HTTP 410 to a watch, a bookmark now, a watch that
goes silent, request counting, credentials as sent. The fake speaks the Kubernetes list/watch wire format over TLS: ``NamespaceList`` with
``metadata.resourceVersion`` (and ``continue`` pagination), chunked watch responses with one JSON
``WatchEvent`` per line, ``BOOKMARK`` events carrying only a resourceVersion, ``ERROR`` events with
a 410 ``Expired`` Status, HTTP 410 ``Gone``, and ``Status`` bodies for 401/403/404/500.
"""

from __future__ import annotations

import base64
import json
import random
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from gateway.config.model import Snapshot
from gateway.errors import NamespaceLookupError
from gateway.sources.configdir import ConfigStore
from gateway.sources.kube import (
    KubeAPIError,
    KubeClient,
    KubeConfigError,
    in_cluster_config,
    load_kubeconfig,
)
from gateway.sources.namespaces import (
    NOT_FOUND,
    Backoff,
    ClusterNamespaces,
    FileNamespaces,
)
from tests.support.kubeapi import FakeKubeAPI, write_kubeconfig


@pytest.fixture
def client(kube_api: FakeKubeAPI, tmp_path: Path) -> KubeClient:
    return KubeClient(load_kubeconfig(write_kubeconfig(kube_api, tmp_path / "kubeconfig")), request_timeout=5)


def _fast_backoff() -> Backoff:
    return Backoff(initial=0.01, maximum=0.05, rng=random.Random(6))


async def _until(predicate: Callable[[], bool]) -> None:
    """Wait (bounded) until ``predicate()`` holds; the bound only turns a hang into a failure."""
    with trio.fail_after(10):
        while not predicate():
            await trio.sleep(0.005)


async def _started(nursery: trio.Nursery, client: KubeClient, **kwargs: Any) -> ClusterNamespaces:
    source = ClusterNamespaces(client, backoff=_fast_backoff(), **kwargs)
    await nursery.start(source.run)
    return source


# --- cluster mode --------------------------------------------------------------------------------


async def test_ready_after_first_successful_list(
    kube_api: FakeKubeAPI, client: KubeClient, nursery: trio.Nursery
) -> None:
    """GW-01/MAT-33: readiness waits for the first list, retried with back-off after list errors.

    Fake: the real apiserver does not answer lists with 500 on demand."""
    kube_api.fail_lists = 2
    source = await _started(nursery, client)
    assert not source.ready
    await source.wait_synced()
    assert source.ready
    assert len(kube_api.lists()) == 3
    assert dict(await source.labels("team-a")) == {"kubernetes.io/metadata.name": "team-a", "team": "a"}
    assert dict(await source.labels("default")) == {"kubernetes.io/metadata.name": "default"}
    assert kube_api.gets("team-a") == 0, "a synced namespace is answered from memory"
    await _until(lambda: len(kube_api.watches()) == 1)
    assert kube_api.watches()[0] == {
        "watch": "1",
        "resourceVersion": str(kube_api.rv),
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "300",
    }


async def test_a_watch_answered_http_410_relists(
    kube_api: FakeKubeAPI, client: KubeClient, nursery: trio.Nursery
) -> None:
    """GW-01: a watch request answered with HTTP 410 re-lists, and the new list replaces the cache whole.

    Fake: kube-apiserver 1.36 answers an expired watch with 200 and an ERROR event (that path runs
    against the real one in tests/test_kube_reflector.py); HTTP 410 is what a list gets, and what a
    proxy or an older apiserver may send to a watch."""
    source = await _started(nursery, client)
    await source.wait_synced()
    await _until(lambda: len(kube_api._watchers) == 1)
    synced_rv = source.resource_version
    kube_api.silent = True  # these changes happen while the watch is broken
    kube_api.delete("team-a")
    kube_api.put("team-c", {"team": "c"})
    kube_api.watch_gone_http = 1
    kube_api.silent = False
    kube_api.drop_watches()
    await _until(lambda: source.lists == 2 and len(kube_api._watchers) == 1)
    watches = kube_api.watches()
    assert [w["resourceVersion"] for w in watches] == [synced_rv, synced_rv, str(kube_api.rv)]
    assert len(kube_api.lists()) == 2
    assert dict(await source.labels("team-c"))["team"] == "c"
    assert kube_api.gets("team-c") == 0, "the re-list, not a GET, brought team-c"
    assert await source.labels("team-a") is NOT_FOUND


async def test_bookmark_advances_resource_version(
    kube_api: FakeKubeAPI, client: KubeClient, nursery: trio.Nursery
) -> None:
    """GW-01: a BOOKMARK moves the resourceVersion the next watch starts from.

    Fake: the real apiserver sends bookmarks on its own schedule (about once a minute)."""
    source = await _started(nursery, client)
    await source.wait_synced()
    await _until(lambda: len(kube_api._watchers) == 1)
    kube_api.bookmark(advance=40)
    await _until(lambda: source.resource_version == str(kube_api.rv))
    kube_api.drop_watches()
    await _until(lambda: len(kube_api.watches()) == 2)
    assert kube_api.watches()[1]["resourceVersion"] == str(kube_api.rv)
    assert len(kube_api.lists()) == 1


async def test_watch_end_and_idle_reconnect(
    kube_api: FakeKubeAPI, client: KubeClient, nursery: trio.Nursery
) -> None:
    """GW-01: a watch ended by timeoutSeconds, or silent past the idle deadline, is re-opened, no re-list.

    Fake: a watch that goes silent while its connection stays open is a fault the real one lacks."""
    kube_api.watch_seconds_cap = 0.05
    source = await _started(nursery, client, idle_timeout=0.2)
    await source.wait_synced()
    await _until(lambda: len(kube_api.watches()) >= 3)
    kube_api.watch_seconds_cap = None
    kube_api.stall_watches = True
    stalled = len(kube_api.watches())
    await _until(lambda: len(kube_api.watches()) >= stalled + 2)
    assert len(kube_api.lists()) == 1
    assert source.ready


async def test_cache_miss_does_one_live_get(kube_api: FakeKubeAPI, client: KubeClient) -> None:
    """GW-01/MAT-16: a miss is one live GET (404 → NOT_FOUND), cached; concurrent misses share it.

    Fake: it counts the requests each name cost, which the real apiserver does not report."""
    source = ClusterNamespaces(client)  # never listed: every name is a miss
    results: dict[str, Any] = {}

    async def lookup(key: str, name: str) -> None:
        results[key] = await source.labels(name)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(lookup, f"a{i}", "team-a")
            nursery.start_soon(lookup, f"x{i}", "missing")
    assert dict(results["a0"])["team"] == "a"
    assert results["a0"] == results["a1"] == results["a2"]
    assert results["x0"] is results["x1"] is results["x2"] is NOT_FOUND
    assert await source.labels("team-a") == results["a0"]
    assert await source.labels("missing") is NOT_FOUND
    assert (kube_api.gets("team-a"), kube_api.gets("missing")) == (1, 1)
    assert not source.ready


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        pytest.param(
            "forbidden",
            'namespaces "team-a" is forbidden: User "system:serviceaccount:webhook-gateway:webhook-gateway"'
            ' cannot get resource "namespaces" in API group "" at the cluster scope',
            id="MAT-17: a 403 from the API server carries the Status message",
        ),
        pytest.param(
            "bad-token", "Unauthorized", id="MAT-17: a 401 (wrong token) carries the Status message"
        ),
        pytest.param(
            "unreachable",
            'Get "https://127.0.0.1:{port}/api/v1/namespaces/team-a": ',
            id="MAT-17: an unreachable API server names the GET that failed",
        ),
    ],
)
async def test_lookup_failures_raise(
    kube_api: FakeKubeAPI, tmp_path: Path, breakage: str, expected: str
) -> None:
    """A lookup that fails for any reason but 404 raises NamespaceLookupError with a clear message."""
    config = write_kubeconfig(kube_api, tmp_path / "kubeconfig")
    port = kube_api.port
    if breakage == "forbidden":
        kube_api.forbidden = True
    elif breakage == "bad-token":
        kube_api.token = "another-token"
    else:
        with trio.socket.socket() as sock:  # a port nobody listens on
            await sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        config.write_text(config.read_text().replace(str(kube_api.port), str(port)))
    source = ClusterNamespaces(KubeClient(load_kubeconfig(config), connect_timeout=5))
    with pytest.raises(NamespaceLookupError) as caught:
        await source.labels("team-a")
    assert str(caught.value).startswith(expected.format(port=port))
    assert len(str(caught.value)) > len(expected.format(port=port)) or breakage != "unreachable"


async def test_in_cluster_token_is_sent_and_reread(kube_api: FakeKubeAPI, tmp_path: Path) -> None:
    """GW-01: in-cluster config sends the service-account bearer token and re-reads it when rotated."""
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "ca.crt").write_bytes(kube_api.ca.cert_pem.bytes())
    (sa / "token").write_text("token-1\n")
    (sa / "namespace").write_text("webhook-gateway")
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(kube_api.port)}
    config = in_cluster_config(env, sa)
    assert config.namespace == "webhook-gateway"
    client = KubeClient(config)
    await client.get("/api/v1/namespaces/default")
    (sa / "token.new").write_text("token-2-rotated\n")
    (sa / "token.new").rename(sa / "token")  # the kubelet swaps the file atomically
    kube_api.token = "token-2-rotated"
    await client.get("/api/v1/namespaces/default")
    sent = [h["authorization"] for _, _, h in kube_api.requests]
    assert sent == ["Bearer token-1", "Bearer token-2-rotated"]
    assert all(h["user-agent"].startswith("webhook-gateway/") for _, _, h in kube_api.requests)


def test_in_cluster_config_needs_the_environment(tmp_path: Path) -> None:
    """Outside a pod (no KUBERNETES_SERVICE_HOST) in-cluster configuration is refused clearly."""
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster_config({}, tmp_path)


@pytest.mark.parametrize(
    ("user", "outcome"),
    [
        pytest.param(
            "client-cert-data", "ok", id="kubeconfig: client-certificate-data/client-key-data authenticate"
        ),
        pytest.param(
            "client-cert-files", "ok", id="kubeconfig: relative client-certificate/client-key files"
        ),
        pytest.param("token-file", "ok", id="kubeconfig: tokenFile relative to the kubeconfig"),
        pytest.param(
            "exec", "exec credential plugins are not supported", id="kubeconfig: exec credentials are refused"
        ),
        pytest.param(
            "cert-without-key",
            "client-certificate and client-key must be given together",
            id="kubeconfig: a lone cert",
        ),
    ],
)
async def test_kubeconfig_users(
    kube_api: FakeKubeAPI, tmp_path: Path, nursery: trio.Nursery, user: str, outcome: str
) -> None:
    """kubeconfig user entries the gateway supports reach the API server; the others are refused."""
    leaf = kube_api.ca.issue_cert("gateway@example.com")
    cert, key = b"".join(b.bytes() for b in leaf.cert_chain_pems), leaf.private_key_pem.bytes()
    (tmp_path / "c.crt").write_bytes(cert)
    (tmp_path / "c.key").write_bytes(key)
    (tmp_path / "tok").write_text(kube_api.token)
    entries: dict[str, dict[str, Any]] = {
        "client-cert-data": {
            "client-certificate-data": base64.b64encode(cert).decode(),
            "client-key-data": base64.b64encode(key).decode(),
            "token": kube_api.token,
        },
        "client-cert-files": {"client-certificate": "c.crt", "client-key": "c.key", "token": kube_api.token},
        "token-file": {"tokenFile": "tok"},
        "exec": {"exec": {"command": "aws", "apiVersion": "client.authentication.k8s.io/v1"}},
        "cert-without-key": {"client-certificate": "c.crt"},
    }
    path = write_kubeconfig(kube_api, tmp_path / "kubeconfig", entries[user])
    if outcome != "ok":
        with pytest.raises(KubeConfigError, match=outcome):
            load_kubeconfig(path)
        return
    # This server demands a client certificate only for the certificate rows.
    mtls = user.startswith("client-cert")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    kube_api.ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    if mtls:
        kube_api.ca.configure_trust(server_ctx)
        server_ctx.verify_mode = ssl.CERT_REQUIRED
    listeners = await trio.open_ssl_over_tcp_listeners(0, server_ctx, host="127.0.0.1")
    await nursery.start(trio.serve_listeners, kube_api.handle, listeners)
    port = listeners[0].transport_listener.socket.getsockname()[1]
    path.write_text(path.read_text().replace(f"127.0.0.1:{kube_api.port}", f"127.0.0.1:{port}"))
    body = await KubeClient(load_kubeconfig(path)).get("/api/v1/namespaces/team-a")
    assert json.loads(body)["metadata"]["labels"]["team"] == "a"


async def test_api_error_carries_status(client: KubeClient) -> None:
    """A non-2xx reply raises KubeAPIError with the Status code, reason and message."""
    with pytest.raises(KubeAPIError) as caught:
        await client.get("/api/v1/namespaces/nope")
    assert (caught.value.code, caught.value.reason, str(caught.value)) == (
        404,
        "NotFound",
        'namespaces "nope" not found',
    )


# --- file mode -----------------------------------------------------------------------------------

_SNAPSHOT = Snapshot(namespaces={"team-a": {"team": "a"}, "bare": {}})


@pytest.mark.parametrize(
    ("unknown", "name", "expected"),
    [
        pytest.param("notFound", "team-a", {"team": "a"}, id="GW-01: a Namespace object's labels are served"),
        pytest.param("notFound", "bare", {}, id="GW-01: a Namespace without labels has the empty set"),
        pytest.param(
            "notFound", "other", NOT_FOUND, id="GW-01: unknownNamespace notFound (default) → MAT-16"
        ),
        pytest.param("emptyLabels", "other", {}, id="GW-01: unknownNamespace emptyLabels → no labels"),
    ],
)
async def test_file_namespaces(unknown: Any, name: str, expected: Any) -> None:
    """File mode answers from the snapshot's Namespace objects, and is ready at once."""
    source = FileNamespaces(_SNAPSHOT, unknown_namespace=unknown)
    assert source.ready
    await source.wait_synced()
    result = await source.labels(name)
    assert result is NOT_FOUND if expected is NOT_FOUND else dict(result) == expected  # type: ignore[arg-type]


async def test_file_namespaces_follow_the_store() -> None:
    """GW-01/CFG-25: given a ConfigStore, file mode answers from whichever snapshot is current."""
    store = ConfigStore(_SNAPSHOT)
    source = FileNamespaces(store)
    assert await source.labels("team-z") is NOT_FOUND
    store.replace(Snapshot(namespaces={"team-z": {"team": "z"}}, generation=2))
    assert dict(await source.labels("team-z")) == {"team": "z"}  # type: ignore[arg-type]


# --- back-off ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "low", "high"),
    [
        pytest.param(0, 0.8, 1.6, id="first retry waits initial x [1, 1+jitter)"),
        pytest.param(3, 6.4, 12.8, id="each failure doubles the wait"),
        pytest.param(10, 30.0, 60.0, id="the wait is bounded by the maximum (times the jitter)"),
        pytest.param(5000, 30.0, 60.0, id="the wait stays bounded after thousands of failures"),
    ],
)
def test_backoff_bounds(failures: int, low: float, high: float) -> None:
    """Back-off grows exponentially with jitter, is bounded, and resets after success."""
    for seed in range(50):
        backoff = Backoff(rng=random.Random(seed))
        for _ in range(failures):
            backoff.next_delay()
        assert low <= backoff.next_delay() < high
        backoff.reset()
        assert 0.8 <= backoff.next_delay() < 1.6
