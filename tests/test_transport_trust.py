"""A backend trusted through a CA reference (issue 34 §1), over real sockets and real TLS.

The caller verifies a ``caFrom`` backend against the bundle the ``TrustStore`` holds for the reference:
never the system roots when it was never read, the last good bundle when a new value is refused, and
the new bundle for every call after a change, without rebuilding the caller. Connections opened under
the previous bundle are not used for new calls (the bundle's digest is part of the pool key).
"""

from __future__ import annotations

import trio
import trustme

from gateway.config.model import ClientConfig
from gateway.config.trust import CaReference
from gateway.errors import CallingWebhookError
from gateway.transport.caller import BackendCaller
from gateway.transport.pool import ClientPool
from gateway.transport.trust import TrustStore
from tests.support.httpservers import BackendServer, server_context

REFERENCE = CaReference(source="secret", namespace="team-a", name="policy-ca", key="ca.crt")
BODY = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}'


async def _post(caller: BackendCaller, client_config: ClientConfig) -> int | str:
    """The HTTP status, or the call error's reason."""
    try:
        reply = await caller.post(client_config, BODY, timeout_seconds=5)
    except CallingWebhookError as exc:
        return exc.reason
    return reply.status


async def test_a_reference_never_read_fails_the_call_and_never_falls_back_to_the_system_roots(
    nursery: trio.Nursery,
) -> None:
    backend = await nursery.start(BackendServer(server_context(trustme.CA(), "127.0.0.1")).serve)
    client_config = ClientConfig(url=backend.url("/allow"), ca_from=REFERENCE)
    async with ClientPool() as pool:
        caller = BackendCaller(pool, trust=TrustStore())
        assert await _post(caller, client_config) == (
            "could not get REST client: no CA bundle from secret team-a/policy-ca[ca.crt]: not read yet"
        )
        assert backend.connections == 0


async def test_the_trust_store_follows_a_ca_rotation_without_a_restart(nursery: trio.Nursery) -> None:
    """The owner rotates: the gateway keeps its last good CA through a bad value, and from the moment
    the new CA is accepted every new call verifies against it (and only it)."""
    old_ca, new_ca = trustme.CA(), trustme.CA()
    backend = await nursery.start(BackendServer(server_context(old_ca, "127.0.0.1")).serve)
    client_config = ClientConfig(url=backend.url("/allow"), ca_from=REFERENCE)
    trust = TrustStore()
    async with ClientPool() as pool:
        caller = BackendCaller(pool, trust=trust)
        trust.accept(REFERENCE, old_ca.cert_pem.bytes())
        assert await _post(caller, client_config) == 200
        assert backend.connections == 1

        trust.refuse(REFERENCE, 'the Secret has no key "ca.crt"')  # a bad value: the last good CA stays
        assert await _post(caller, client_config) == 200
        assert backend.connections == 1, "the pooled connection is still good"

        # the owner re-issues the backend's certificate from the new CA and publishes the new CA
        backend.ssl_context = server_context(new_ca, "127.0.0.1")
        assert trust.accept(REFERENCE, new_ca.cert_pem.bytes())
        assert await _post(caller, client_config) == 200
        assert backend.connections == 2, "new calls do not reuse the connection opened under the old CA"

        # and the old CA is no longer trusted: a backend still serving an old-CA certificate is refused
        stale = await nursery.start(BackendServer(server_context(old_ca, "127.0.0.1")).serve)
        failed = await _post(caller, ClientConfig(url=stale.url("/allow"), ca_from=REFERENCE))
        assert isinstance(failed, str)
        assert failed.endswith("x509: certificate signed by unknown authority"), failed


async def test_a_static_bundle_is_untouched_by_the_store(nursery: trio.Nursery) -> None:
    ca = trustme.CA()
    backend = await nursery.start(BackendServer(server_context(ca, "127.0.0.1")).serve)
    async with ClientPool() as pool:
        caller = BackendCaller(pool, trust=TrustStore())
        assert (
            await _post(caller, ClientConfig(url=backend.url("/allow"), ca_bundle=ca.cert_pem.bytes())) == 200
        )


async def test_the_expiry_of_each_backends_serving_certificate_is_exported(nursery: trio.Nursery) -> None:
    """Issue 34 §1: every TLS handshake with a backend exports when the certificate it presented
    expires, per TLS server name (webhook_gateway_backend_certificate_expiry_timestamp_seconds)."""
    from cryptography import x509

    from gateway.observability import Observability

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    context = server_context(ca, "127.0.0.1")
    leaf.configure_cert(context)
    backend = await nursery.start(BackendServer(context).serve)
    observer = Observability(review_log=False)
    async with ClientPool(on_peer_certificate=observer.backend_certificate_seen) as pool:
        caller = BackendCaller(pool)
        assert (
            await _post(caller, ClientConfig(url=backend.url("/allow"), ca_bundle=ca.cert_pem.bytes())) == 200
        )
    expected = x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).not_valid_after_utc.timestamp()
    assert observer.prometheus is not None
    assert set(observer.prometheus.backend_certificate_expiry.children) == {("127.0.0.1",)}
    assert observer.prometheus.backend_certificate_expiry.labels("127.0.0.1").value == expected


# --- serve, file mode: caFrom.file followed without a restart ------------------------------------------


async def test_serve_follows_a_ca_file_and_keeps_the_last_good_one(nursery: trio.Nursery, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 34 §1, file mode: the gateway verifies a backend with the CA file its caFrom names; when the
    backend's certificate changes CA and the file is rewritten, it follows within the poll interval;
    a file rewritten with junk is refused and the last good CA stays in force."""
    import json as _json
    from functools import partial

    import yaml
    from structlog.testing import capture_logs

    from gateway.devtools.backends import serve_backend
    from tests.support.gateway import gateway_client, review, send_review, start_gateway

    old_ca, new_ca = trustme.CA(), trustme.CA()
    backend_tls = server_context(old_ca, "127.0.0.1")  # the sample backends: real admission answers
    backend = await nursery.start(partial(serve_backend, ssl_context=backend_tls))
    ca_file = tmp_path / "backend-ca.pem"
    ca_file.write_bytes(old_ca.cert_pem.bytes())
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    doc = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "team-a", "annotations": {
            "webhook-gateway.io/backend-policy": _json.dumps({"*": {"caFrom": {"file": str(ca_file)}}})}},
        "webhooks": [{"name": "check.team-a.example.com", "clientConfig": {"url": backend.url("/allow")},
                      "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
                      "sideEffects": "None", "admissionReviewVersions": ["v1"], "failurePolicy": "Fail", "timeoutSeconds": 5}],
    }  # fmt: skip
    (config_dir / "a.yaml").write_text(yaml.safe_dump(doc))
    with capture_logs() as logs:
        running = await start_gateway(nursery, config_dir, "--config-poll-seconds", "0.05")
        client = await gateway_client(running)

        async def allowed() -> bool | str:
            answer = _json.loads((await send_review(client, "validate", review())).body)["response"]
            return True if answer["allowed"] else answer["status"]["message"]

        assert await allowed() is True

        new_ca.issue_cert("127.0.0.1").configure_cert(backend_tls)  # its certificate changes CA
        backend_connections = backend.connections
        ca_file.write_bytes(new_ca.cert_pem.bytes())
        while sum(1 for e in logs if e["event"] == "backend CA in force") < 2:
            await trio.sleep(0.02)
        assert await allowed() is True, "the new CA is in force, no restart"
        assert backend.connections == backend_connections + 1

        ca_file.write_bytes(b"junk")
        while not any(e["event"] == "backend CA refused; the last good one stays in force" for e in logs):
            await trio.sleep(0.02)
        assert await allowed() is True, "the last good CA stays in force"
        running.shutdown()
    (refused,) = [e for e in logs if e["event"] == "backend CA refused; the last good one stays in force"]
    assert refused["reason"] == f"file {ca_file}: no PEM certificate"


async def test_readiness_waits_for_the_references_at_start_up_only(nursery: trio.Nursery, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """At start-up the gateway is not ready until every reference was read (an API server it cannot
    reach keeps it unready); a reference added later by a reload that cannot be read does not take a
    running gateway out of its Service (which would fail every review of the cluster): only its own
    backends' calls fail, saying why."""
    from gateway.config.load import load_documents
    from gateway.sources.ca import CaSources
    from gateway.sources.kube import KubeClient, KubeConfig
    from gateway.sources.reflector import Backoff
    from tests.configs.builders import config, hook
    from tests.support.controlplane import free_port

    def snapshot(policy: str) -> object:
        doc = config(hook("a.b.c"))
        doc["metadata"]["annotations"] = {"webhook-gateway.io/backend-policy": policy}
        return load_documents([("a.yaml", doc)])

    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(trustme.CA().cert_pem.bytes())
    unreachable = KubeClient(KubeConfig(server=f"http://127.0.0.1:{free_port()}", ssl_context=None))
    updates: list[tuple[str, str]] = []

    def sources() -> CaSources:
        return CaSources(
            TrustStore(), unreachable, on_update=lambda r, result, _d: updates.append((r.describe(), result)),
            file_interval=0.05, backoff=lambda: Backoff(initial=0.01, maximum=0.05),
        )  # fmt: skip

    starting = sources()
    starting.watch_snapshot(snapshot('"*": {caFrom: {secret: {namespace: a, name: b}}}'))  # type: ignore[arg-type]
    await nursery.start(starting.run)
    await trio.sleep(0.3)  # several failed lists (connection refused), none succeeds
    assert not starting.synced
    assert not starting.ready, "not ready before the gateway knows its backends' CA"

    running = sources()
    running.watch_snapshot(snapshot(f'"*": {{caFrom: {{file: {ca_file}}}}}'))  # type: ignore[arg-type]
    await nursery.start(running.run)
    assert running.ready
    assert ("file " + str(ca_file), "changed") in updates
    running.watch_snapshot(snapshot('"*": {caFrom: {secret: {namespace: a, name: b}}}'))  # type: ignore[arg-type]
    await trio.sleep(0.3)
    assert not running.synced
    assert running.ready, "a reload's unreadable reference does not make a running gateway unready"


def test_expiry_gauges_are_not_added_up_over_workers() -> None:
    """With --workers, /metrics merges every worker's values: an expiry timestamp is the earliest any
    worker reports, never their sum (which would put every expiry decades away and silence the alerts)."""
    from gateway.observability.metrics import Metrics
    from gateway.server.workers import capture, merge

    workers = []
    for not_after in (1_900_000_000.0, 1_800_000_000.0):
        metrics = Metrics()
        metrics.serving_certificate_loaded(not_after)
        metrics.backend_certificate_seen("policy.team-a.svc", not_after)
        metrics.backend_ca_expiry.labels(
            "a.b.c", "validating", "caBundle", "CN=ca sha256:00"
        ).value = not_after
        workers.append(capture(metrics))
    merged = Metrics()
    merge(merged, workers)
    assert merged.serving_certificate_expiry.labels().value == 1_800_000_000.0
    assert merged.backend_certificate_expiry.labels("policy.team-a.svc").value == 1_800_000_000.0
    assert (
        merged.backend_ca_expiry.labels("a.b.c", "validating", "caBundle", "CN=ca sha256:00").value
        == 1_800_000_000.0
    )
