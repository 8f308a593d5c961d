"""The one reflector (gateway/sources/reflector.py) and the namespace labels it feeds, against the
real kube-apiserver: pages, watch events, relabelling, delete and recreate, and the two ways a watch
expires in a real cluster (an apiserver restart empties its watch cache; etcd compaction removes
the revision an uncached watch resumes from), each followed by a re-list.
"""

from __future__ import annotations

import dataclasses
import functools
import ssl
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import trio

from gateway.sources.kube import KubeClient, load_kubeconfig
from gateway.sources.namespaces import NOT_FOUND, ClusterNamespaces
from gateway.sources.reflector import Backoff, Change, Collection, ObjectMeta, Reflector
from tests.support.controlplane import ControlPlane, control_plane_running
from tests.support.netproxy import TCPProxy


class ConfigMap(msgspec.Struct):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    data: dict[str, str] | None = None


def _client(plane: ControlPlane) -> KubeClient:
    return KubeClient(load_kubeconfig(plane.kubeconfig), request_timeout=10)


def _fast() -> Backoff:
    return Backoff(initial=0.05, maximum=0.2)


async def _api(plane: ControlPlane, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """The plane's blocking HTTPS call, off the event loop the reflector runs on."""
    return await trio.to_thread.run_sync(functools.partial(plane.api, method, path, body))


async def _until(predicate: Callable[[], bool], *, seconds: float = 15) -> None:
    """Wait for the reflector to reach a state; the bound only turns a hang into a failure."""
    with trio.fail_after(seconds):
        while not predicate():
            await trio.sleep(0.01)


class Recorder:
    """What ``on_change`` and ``on_event`` reported, in order."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, str]] = []
        self.events: list[str] = []

    def change(self, changes: tuple[Change[Any], ...]) -> None:
        self.changes += [(c.type, c.key) for c in changes]

    def event(self, kind: str) -> None:
        self.events.append(kind)


async def test_pages_then_watch_report_every_change_once(
    control_plane: ControlPlane, kube_namespace: str, nursery: trio.Nursery
) -> None:
    """A list in pages of 2 (the apiserver's continue tokens), then ADDED/MODIFIED/DELETED events."""
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    for i in range(5):
        assert (await _api(control_plane, "POST", path, {"metadata": {"name": f"c{i}"}}))[0] == 201
    seen = Recorder()
    reflector = Reflector(
        _client(control_plane), Collection(path), ConfigMap,
        on_change=seen.change, on_event=seen.event, page_size=2, backoff=_fast(),
    )  # fmt: skip
    await nursery.start(reflector.run)
    await reflector.wait_synced()
    assert sorted(reflector.store) == [f"{kube_namespace}/c{i}" for i in range(5)]
    assert seen.changes == [("ADDED", f"{kube_namespace}/c{i}") for i in range(5)]
    assert reflector.lists == 1

    del seen.changes[:]
    assert (await _api(control_plane, "POST", path, {"metadata": {"name": "c5"}}))[0] == 201
    assert (await _api(control_plane, "PUT", f"{path}/c0", {"metadata": {"name": "c0"}, "data": {"k": "v"}}))[
        0
    ] == 200
    assert (await _api(control_plane, "DELETE", f"{path}/c1"))[0] == 200
    await _until(lambda: len(seen.changes) == 3)
    assert seen.changes == [
        ("ADDED", f"{kube_namespace}/c5"),
        ("MODIFIED", f"{kube_namespace}/c0"),
        ("DELETED", f"{kube_namespace}/c1"),
    ]
    assert reflector.store[f"{kube_namespace}/c0"].data == {"k": "v"}
    assert reflector.lists == 1, "no re-list while the watch holds"


async def test_label_selector_keeps_only_matching_objects(
    control_plane: ControlPlane, kube_namespace: str, nursery: trio.Nursery
) -> None:
    """An object relabelled out of the selector is reported DELETED by the apiserver; back in, ADDED."""
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    await _api(control_plane, "POST", path, {"metadata": {"name": "sel", "labels": {"app": "a"}}})
    seen = Recorder()
    reflector = Reflector(
        _client(control_plane), Collection(path, label_selector="app=a"), ConfigMap, on_change=seen.change
    )
    await nursery.start(reflector.run)
    await reflector.wait_synced()
    for labels, change in (({"app": "b"}, "DELETED"), ({"app": "a"}, "ADDED")):
        await _api(control_plane, "PUT", f"{path}/sel", {"metadata": {"name": "sel", "labels": labels}})
        await _until(lambda change=change: seen.changes[-1] == (change, f"{kube_namespace}/sel"))
    assert list(reflector.store) == [f"{kube_namespace}/sel"]


async def test_namespace_relabel_delete_and_recreate(
    control_plane: ControlPlane, nursery: trio.Nursery
) -> None:
    """GW-01: the labels follow the cluster; a deleted namespace is gone once finalized, and a
    recreated one comes back with its new labels."""
    source = ClusterNamespaces(_client(control_plane), backoff=_fast())
    await nursery.start(source.run)
    await source.wait_synced()
    name = await trio.to_thread.run_sync(lambda: control_plane.create_namespace(labels={"tier": "a"}))
    await _until(lambda: source.labels_now(name) is not None)
    assert dict(source.labels_now(name) or {}) == {"kubernetes.io/metadata.name": name, "tier": "a"}

    await trio.to_thread.run_sync(
        lambda: control_plane.kubectl("label", "--overwrite", "namespace", name, "tier=b")
    )
    await _until(lambda: dict(source.labels_now(name) or {}).get("tier") == "b")

    await trio.to_thread.run_sync(control_plane.delete_namespace, name)
    await _until(lambda: source.labels_now(name) is None)
    assert await source.labels(name) is NOT_FOUND  # one live GET: 404

    await trio.to_thread.run_sync(lambda: control_plane.create_namespace(name, labels={"tier": "c"}))
    await _until(lambda: source.labels_now(name) not in (None, NOT_FOUND))
    assert dict(source.labels_now(name) or {}).get("tier") == "c", "the watch's word replaces the 404"
    await trio.to_thread.run_sync(control_plane.delete_namespace, name)


async def test_a_broken_watch_resumes_from_its_resource_version_without_a_relist(
    control_plane: ControlPlane, nursery: trio.Nursery
) -> None:
    """GW-01: a connection cut mid-watch is resumed where it stopped: what changed meanwhile arrives
    as watch events, and nothing is listed again."""
    await trio.to_thread.run_sync(lambda: control_plane.create_namespace("followed"))
    try:
        source, seen, proxy = await _following(control_plane, nursery)
        await _relabel(control_plane, "1")
        await _until(lambda: _label(source) == "1")
        proxy.partition()
        await _relabel(control_plane, "2")  # missed by the cut watch
        proxy.heal()
        await _until(lambda: _label(source) == "2")
        assert (source.lists, seen.events.count("expired")) == (1, 0)
        assert "error" in seen.events
    finally:
        await trio.to_thread.run_sync(control_plane.delete_namespace, "followed")


# --- expiry: a plane of its own, restarted ------------------------------------------------------------


@pytest.fixture(scope="module")
def restartable_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A second plane these tests may restart and compact without disturbing the shared one."""
    with control_plane_running(tmp_path_factory.mktemp("restartable")) as plane:
        yield plane


async def _following(
    plane: ControlPlane, nursery: trio.Nursery, **kwargs: Any
) -> tuple[ClusterNamespaces, Recorder, TCPProxy]:
    """Namespace labels followed through a proxy the test can partition."""
    proxy = TCPProxy(int(plane.url.rsplit(":", 1)[1]))
    await nursery.start(proxy.serve)
    config = dataclasses.replace(load_kubeconfig(plane.kubeconfig), server=f"https://127.0.0.1:{proxy.port}")
    seen = Recorder()
    source = ClusterNamespaces(
        KubeClient(config, request_timeout=10), backoff=_fast(), on_event=seen.event, **kwargs
    )
    await nursery.start(source.run)
    await source.wait_synced()
    return source, seen, proxy


async def _relabel(plane: ControlPlane, value: str) -> None:
    await trio.to_thread.run_sync(
        lambda: plane.kubectl("label", "--overwrite", "namespace", "followed", f"v={value}")
    )


def _label(source: ClusterNamespaces) -> str | None:
    labels = source.labels_now("followed")
    return None if labels is None or labels is NOT_FOUND else dict(labels).get("v")


async def _watch_expires(plane: ControlPlane, resource_version: str) -> None:
    """Until a watch from ``resource_version`` is answered 410 (a restarted apiserver serves watches
    from etcd until its watch cache is initialised; only then is the old version too old)."""

    def answer() -> str:
        url = f"/api/v1/namespaces?watch=1&resourceVersion={resource_version}&timeoutSeconds=1"
        req = urllib.request.Request(plane.url + url, headers={"Authorization": f"Bearer {plane.token}"})
        context = ssl.create_default_context(cafile=str(plane.ca_path))
        with urllib.request.urlopen(req, context=context, timeout=10) as resp:
            return str(resp.read().decode())

    with trio.fail_after(30):
        while '"code":410' not in await trio.to_thread.run_sync(answer):
            await trio.sleep(0.1)


async def test_after_an_apiserver_restart_the_watch_expires_and_a_relist_recovers_what_it_missed(
    restartable_plane: ControlPlane, nursery: trio.Nursery
) -> None:
    """The restarted apiserver's watch cache starts at etcd's current revision: resuming the watch
    gets ``ERROR`` 410 ``too old resource version``; the re-list brings what changed meanwhile."""
    plane = restartable_plane
    await trio.to_thread.run_sync(lambda: plane.create_namespace("followed"))
    source, seen, proxy = await _following(plane, nursery)
    await _relabel(plane, "1")
    await _until(lambda: _label(source) == "1")
    proxy.partition()
    await _relabel(plane, "2")  # missed; the restarted cache will start after this revision
    await trio.to_thread.run_sync(plane.restart_apiserver)
    await _watch_expires(plane, source.resource_version)
    proxy.heal()
    await _until(lambda: _label(source) == "2")
    assert (source.lists, seen.events.count("expired")) == (2, 1)
    await _relabel(plane, "3")
    await _until(lambda: _label(source) == "3")


async def test_after_etcd_compaction_an_uncached_watch_expires_and_a_relist_recovers_what_it_missed(
    restartable_plane: ControlPlane, nursery: trio.Nursery
) -> None:
    """Without the watch cache (``--watch-cache=false``) a watch is served by etcd: once etcd has
    compacted past the revision the reflector resumes from, the apiserver answers ``ERROR`` 410 and
    the reflector re-lists. (With the cache the old revision is served from memory instead.)"""
    plane = restartable_plane
    await trio.to_thread.run_sync(plane.restart_apiserver, "--watch-cache=false")
    source, seen, proxy = await _following(plane, nursery)
    proxy.partition()
    await _relabel(plane, "4")  # missed: and etcd moves past resourceVersion + 1, where a watch resumes
    await _api(
        plane, "POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"generateName": "bump-"}}
    )
    await trio.to_thread.run_sync(plane.compact)
    proxy.heal()
    await _until(lambda: _label(source) == "4")
    assert (source.lists, seen.events.count("expired")) == (2, 1)
    await _relabel(plane, "5")
    await _until(lambda: _label(source) == "5")
