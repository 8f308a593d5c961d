"""A fake kube-apiserver serving Namespaces and EndpointSlices on 127.0.0.1 over TLS, in the real wire format.

Also a small object store under ``/apis/`` (Leases, webhook configurations, Deployments): GET,
POST (201, or 409 ``AlreadyExists``), PUT (409 ``Conflict`` when ``metadata.resourceVersion`` is
not the stored one), JSON merge PATCH and DELETE, each write bumping the resourceVersion.

``NamespaceList`` with ``metadata.resourceVersion`` (and ``continue`` pagination), chunked watch
responses with one JSON ``WatchEvent`` per line, ``BOOKMARK`` events carrying only a
resourceVersion, ``ERROR`` events with a 410 ``Expired`` Status, HTTP 410 ``Gone``, and ``Status``
bodies for 401/403/404/500. ``discovery.k8s.io/v1`` EndpointSlices are listed and watched per
namespace with a ``kubernetes.io/service-name=<service>`` label selector, in the same revision space.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
import trustme

# --- the fake kube-apiserver ---------------------------------------------------------------------


def status_doc(code: int, reason: str, message: str, details: dict[str, str] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        status["details"] = details
    return status


@dataclass
class FakeKubeAPI:
    """A kube-apiserver serving only namespaces; mutate it with put/delete/compact/drop_watches."""

    token: str = "token-1"
    namespaces: dict[str, dict[str, Any]] = field(default_factory=dict)
    rv: int = 1000
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    compacted: int = 0  # watches from a resourceVersion below this get an ERROR 410 event
    silent: bool = False  # mutations go to history only (as if they happened while disconnected)
    watch_gone_http: int = 0  # answer this many next watch requests with HTTP 410
    fail_lists: int = 0  # answer this many next list requests with HTTP 500
    stall_watches: bool = False  # send the response head, then nothing
    watch_seconds_cap: float | None = None
    forbidden: bool = False
    requests: list[tuple[str, dict[str, str], dict[str, str]]] = field(default_factory=list)
    port: int = 0
    ca: trustme.CA = field(default_factory=trustme.CA)
    _watchers: list[trio.MemorySendChannel[dict[str, Any]]] = field(default_factory=list)
    _watch_scopes: list[trio.CancelScope] = field(default_factory=list)
    _pages: dict[str, tuple[int, list[dict[str, Any]]]] = field(default_factory=dict)
    slices: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (namespace, name)
    slice_history: list[tuple[int, str, str, dict[str, Any]]] = field(default_factory=list)
    _slice_watchers: list[tuple[str, str, trio.MemorySendChannel[dict[str, Any]]]] = field(
        default_factory=list
    )
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)  # object path -> object
    writes: list[tuple[str, str, int]] = field(default_factory=list)  # (method, path, status)
    interfere: dict[str, int] = field(default_factory=dict)  # path -> next PUTs raced by another writer
    # Other resources, for list requests only (audit): list path → (List kind, items). Add them with
    # ``add_object``; namespaced lists are served both per namespace and across all namespaces.
    listed: dict[str, tuple[str, list[dict[str, Any]]]] = field(default_factory=dict)
    methods: list[str] = field(default_factory=list)  # every request's method, in order

    def add_object(self, prefix: str, resource: str, obj: dict[str, Any]) -> None:
        """Serve ``obj`` in the lists of ``prefix`` (``/api/v1``, ``/apis/apps/v1``) and ``resource``."""
        self.rv += 1
        obj = {
            **obj,
            "metadata": {"resourceVersion": str(self.rv), "uid": f"uid-{self.rv}", **obj["metadata"]},
        }
        list_kind = obj["kind"] + "List"
        paths = [f"{prefix}/{resource}"]
        namespace = obj["metadata"].get("namespace")
        if namespace:
            paths.append(f"{prefix}/namespaces/{namespace}/{resource}")
        for path in paths:
            self.listed.setdefault(path, (list_kind, []))[1].append(obj)

    # -- state changes, as the apiserver would record them --

    def _object(self, name: str) -> dict[str, Any]:
        meta = self.namespaces[name]
        return {"kind": "Namespace", "apiVersion": "v1", **meta}

    def put(self, name: str, labels: dict[str, str]) -> None:
        kind = "MODIFIED" if name in self.namespaces else "ADDED"
        self.rv += 1
        self.namespaces[name] = {
            "metadata": {
                "name": name,
                "uid": f"uid-{name}",
                "resourceVersion": str(self.rv),
                "creationTimestamp": "2024-05-01T10:00:00Z",
                # the apiserver adds this label to every namespace
                "labels": {"kubernetes.io/metadata.name": name, **labels},
            },
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }
        self._record(kind, self._object(name))

    def delete(self, name: str) -> None:
        """As kube-apiserver does: the namespace turns Terminating (MODIFIED, labels kept), and is
        DELETED only once the namespace controller has emptied and finalized it."""
        obj = self._object(name)
        self.rv += 1
        obj["metadata"] = {
            **obj["metadata"],
            "resourceVersion": str(self.rv),
            "deletionTimestamp": "2024-05-01T10:05:00Z",
        }
        obj["status"] = {"phase": "Terminating"}
        self._record("MODIFIED", json.loads(json.dumps(obj)))
        del self.namespaces[name]
        self.rv += 1
        obj["metadata"] = {**obj["metadata"], "resourceVersion": str(self.rv)}
        obj["spec"] = {"finalizers": []}
        self._record("DELETED", obj)

    def _record(self, kind: str, obj: dict[str, Any]) -> None:
        event = {"type": kind, "object": obj}
        self.history.append((self.rv, kind, event))
        if not self.silent:
            for channel in self._watchers:
                channel.send_nowait(event)

    def bookmark(self, advance: int = 0) -> None:
        """Send every watcher a BOOKMARK (other resources may have moved the revision on)."""
        self.rv += advance
        event = {
            "type": "BOOKMARK",
            "object": {
                "kind": "Namespace",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv), "creationTimestamp": None},
            },
        }
        for channel in self._watchers:
            channel.send_nowait(event)
        for _, _, channel in self._slice_watchers:
            slice_mark = {**event, "object": {**event["object"], "kind": "EndpointSlice"}}
            channel.send_nowait({**slice_mark, "object": {**slice_mark["object"], "apiVersion": SLICE_API}})

    # -- EndpointSlices (discovery.k8s.io/v1) --

    def put_slice(
        self,
        namespace: str,
        name: str,
        service: str,
        port: int,
        endpoints: list[tuple[str, bool, bool]],
        *,
        address_type: str = "IPv4",
    ) -> None:
        """Create or replace a slice of ``service`` whose ``endpoints`` are (address, ready, terminating)."""
        kind = "MODIFIED" if (namespace, name) in self.slices else "ADDED"
        self.rv += 1
        self.slices[(namespace, name)] = {
            "kind": "EndpointSlice",
            "apiVersion": SLICE_API,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"uid-{namespace}-{name}",
                "resourceVersion": str(self.rv),
                "generation": 1,
                "creationTimestamp": "2024-05-01T10:00:00Z",
                "labels": {
                    "kubernetes.io/service-name": service,
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                },
            },
            "addressType": address_type,
            "endpoints": [
                {
                    "addresses": [address],
                    "conditions": {
                        "ready": ready,
                        "serving": ready or terminating,
                        "terminating": terminating,
                    },
                    "nodeName": "node-1",
                    "targetRef": {"kind": "Pod", "namespace": namespace, "name": f"pod-{address}"},
                }
                for address, ready, terminating in endpoints
            ],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        }
        self._record_slice(kind, self.slices[(namespace, name)])

    def delete_slice(self, namespace: str, name: str) -> None:
        obj = self.slices.pop((namespace, name))
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        self._record_slice("DELETED", obj)

    def _record_slice(self, kind: str, obj: dict[str, Any]) -> None:
        event = {"type": kind, "object": obj}
        meta = obj["metadata"]
        service = meta["labels"]["kubernetes.io/service-name"]
        self.slice_history.append((self.rv, meta["namespace"], service, event))
        if not self.silent:
            for namespace, selected, channel in self._slice_watchers:
                if namespace == meta["namespace"] and selected == service:
                    channel.send_nowait(event)

    def slice_requests(self, *, watch: bool) -> list[dict[str, str]]:
        return [q for p, q, _ in self.requests if p.endswith("/endpointslices") and ("watch" in q) == watch]

    def compact(self) -> None:
        """A watch from any revision before the current one is now too old: what kube-apiserver does
        after a restart (its watch cache starts afresh) or, without the watch cache, after etcd
        compaction. With the watch cache, compaction alone expires nothing (tests/test_kube_reflector.py)."""
        self.compacted = self.rv

    def drop_watches(self) -> None:
        """Break every open watch connection mid-stream (no terminating chunk)."""
        for scope in self._watch_scopes:
            scope.cancel()

    # -- what the client sent --

    def watches(self) -> list[dict[str, str]]:
        return [q for p, q, _ in self.requests if p == "/api/v1/namespaces" and "watch" in q]

    def lists(self) -> list[dict[str, str]]:
        return [q for p, q, _ in self.requests if p == "/api/v1/namespaces" and "watch" not in q]

    def gets(self, name: str) -> int:
        return sum(1 for p, _, _ in self.requests if p == f"/api/v1/namespaces/{name}")

    # -- the HTTP side --

    async def handle(self, stream: trio.abc.Stream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            request = None
            body = bytearray()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            assert request is not None
            await self.route(conn, stream, request, bytes(body))
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError, ssl.SSLError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def route(
        self, conn: h11.Connection, stream: trio.abc.Stream, request: h11.Request, body: bytes = b""
    ) -> None:
        target = urllib.parse.urlsplit(request.target.decode())
        query = dict(urllib.parse.parse_qsl(target.query))
        headers = {k.decode().lower(): v.decode() for k, v in request.headers}
        self.requests.append((target.path, query, headers))
        self.methods.append(request.method.decode())
        if headers.get("authorization") != f"Bearer {self.token}":
            await self.reply(conn, stream, 401, status_doc(401, "Unauthorized", "Unauthorized"))
            return
        if self.forbidden:
            name = target.path.rsplit("/", 1)[-1]
            msg = (
                f'namespaces "{name}" is forbidden: User "system:serviceaccount:webhook-gateway:'
                f'webhook-gateway" cannot get resource "namespaces" in API group "" at the cluster scope'
            )
            await self.reply(conn, stream, 403, status_doc(403, "Forbidden", msg))
            return
        if target.path in self.listed:
            await self.list_objects(conn, stream, target.path, query)
            return
        if target.path.startswith(SLICES_PREFIX) and target.path.endswith("/endpointslices"):
            namespace = target.path.removeprefix(SLICES_PREFIX).removesuffix("/endpointslices")
            service = query.get("labelSelector", "").removeprefix("kubernetes.io/service-name=")
            if query.get("watch") in ("1", "true"):
                await self.watch_slices(conn, stream, query, namespace, service)
            else:
                await self.list_slices(conn, stream, namespace, service)
            return
        if target.path.startswith("/apis/"):
            code, reply = self.store(request.method.decode(), target.path, body, headers)
            self.writes.append(
                (request.method.decode(), target.path, code)
            ) if request.method != b"GET" else None
            await self.reply(conn, stream, code, reply)
            return
        if target.path == "/api/v1/namespaces":
            if query.get("watch") in ("1", "true"):
                await self.watch(conn, stream, query)
                return
            await self.list(conn, stream, query)
            return
        if target.path.startswith("/api/v1/namespaces/"):
            name = target.path.removeprefix("/api/v1/namespaces/")
            if name in self.namespaces:
                await self.reply(conn, stream, 200, self._object(name))
                return
            body = status_doc(
                404, "NotFound", f'namespaces "{name}" not found', {"name": name, "kind": "namespaces"}
            )
            await self.reply(conn, stream, 404, body)
            return
        await self.reply(conn, stream, 404, status_doc(404, "NotFound", "the server could not find it"))
        return

    # -- the object store under /apis/ --

    def store(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
        parts = path.strip("/").split("/")  # apis, group, version, [namespaces, ns,] resource[, name]
        group = parts[1]
        resource = parts[-1] if method == "POST" else parts[-2]
        qualified = f"{resource}.{group}"
        if method == "POST":
            obj = json.loads(body)
            name = obj["metadata"]["name"]
            key = f"{path}/{name}"
            if key in self.objects:
                return 409, status_doc(409, "AlreadyExists", f'{qualified} "{name}" already exists',
                                       {"name": name, "group": group, "kind": resource})  # fmt: skip
            return 201, self._save(key, obj)
        name = parts[-1]
        current = self.objects.get(path)
        if current is None:
            return 404, status_doc(404, "NotFound", f'{qualified} "{name}" not found',
                                   {"name": name, "group": group, "kind": resource})  # fmt: skip
        if method == "GET":
            return 200, current
        if method == "DELETE":
            del self.objects[path]
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name}}
        if method == "PUT":
            if self.interfere.get(path):
                self.interfere[path] -= 1
                current = self._save(path, current)  # someone else wrote between our GET and PUT
            obj = json.loads(body)
            if obj.get("metadata", {}).get("resourceVersion") != current["metadata"]["resourceVersion"]:
                message = (
                    f'Operation cannot be fulfilled on {qualified} "{name}": the object has been modified; '
                    "please apply your changes to the latest version and try again"
                )
                return 409, status_doc(
                    409, "Conflict", message, {"name": name, "group": group, "kind": resource}
                )
            return 200, self._save(path, obj)
        if method == "PATCH":
            if headers.get("content-type") != "application/merge-patch+json":
                return 415, status_doc(
                    415, "UnsupportedMediaType", "the body of the request was in an unknown format"
                )
            return 200, self._save(path, merge_patch(current, json.loads(body)))
        return 405, status_doc(405, "MethodNotAllowed", f"{method} is not allowed")

    def _save(self, key: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.rv)
        meta.setdefault("uid", f"uid-{self.rv}")
        meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        self.objects[key] = obj
        return obj

    async def reply(self, conn: h11.Connection, stream: trio.abc.Stream, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        head = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        await stream.send_all(conn.send(h11.Response(status_code=code, headers=head)) or b"")
        await stream.send_all(conn.send(h11.Data(data=data)) or b"")
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")

    async def list(self, conn: h11.Connection, stream: trio.abc.Stream, query: dict[str, str]) -> None:
        if self.fail_lists:
            self.fail_lists -= 1
            await self.reply(
                conn, stream, 500, status_doc(500, "InternalError", "etcdserver: leader changed")
            )
            return
        if "continue" in query:
            rv, items = self._pages.pop(query["continue"])
        else:
            rv = self.rv
            items = [
                {k: v for k, v in self._object(n).items() if k not in ("kind", "apiVersion")}
                for n in sorted(self.namespaces)
            ]
        limit = int(query.get("limit", "0")) or len(items) or 1
        page, rest = items[:limit], items[limit:]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if rest:
            token = base64.b64encode(f"page-{len(self._pages)}-{rv}".encode()).decode()
            self._pages[token] = (rv, rest)
            meta["continue"] = token
            meta["remainingItemCount"] = len(rest)
        body = {"kind": "NamespaceList", "apiVersion": "v1", "metadata": meta, "items": page}
        await self.reply(conn, stream, 200, body)

    async def list_objects(
        self, conn: h11.Connection, stream: trio.abc.Stream, path: str, query: dict[str, str]
    ) -> None:
        list_kind, all_items = self.listed[path]
        start = int(query.get("continue", "0") or 0)
        limit = int(query.get("limit", "0")) or len(all_items) or 1
        items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in all_items]
        page = items[start : start + limit]
        meta: dict[str, Any] = {"resourceVersion": str(self.rv)}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        api_version = all_items[0]["apiVersion"] if all_items else "v1"
        await self.reply(
            conn, stream, 200, {"kind": list_kind, "apiVersion": api_version, "metadata": meta, "items": page}
        )

    async def watch(self, conn: h11.Connection, stream: trio.abc.Stream, query: dict[str, str]) -> None:
        # HTTP 410 to a watch request is a fault: kube-apiserver 1.36 answers 200 and an ERROR event
        # (the ``compacted`` path below); HTTP 410 is what a list at a too old version gets.
        if self.watch_gone_http:
            self.watch_gone_http -= 1
            msg = f"too old resource version: {query['resourceVersion']} ({self.rv})"
            await self.reply(conn, stream, 410, status_doc(410, "Gone", msg))
            return
        head = [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")]
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=head)) or b"")

        async def send(event: dict[str, Any]) -> None:
            await stream.send_all(conn.send(h11.Data(data=json.dumps(event).encode() + b"\n")) or b"")

        since = int(query["resourceVersion"])
        if since < self.compacted:
            msg = f"too old resource version: {since} ({self.compacted})"
            await send({"type": "ERROR", "object": status_doc(410, "Expired", msg)})
            await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
            return
        sender, receiver = trio.open_memory_channel[dict[str, Any]](1000)
        scope = trio.CancelScope()
        self._watchers.append(sender)
        self._watch_scopes.append(scope)
        try:
            with scope:
                if self.stall_watches:
                    await trio.sleep_forever()
                for rv, _, event in self.history:
                    if rv > since:
                        await send(event)
                seconds = float(query.get("timeoutSeconds", "1800"))
                with trio.move_on_after(min(seconds, self.watch_seconds_cap or seconds)):
                    async for event in receiver:
                        await send(event)
                # timeoutSeconds passed: the apiserver ends the stream cleanly
                await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        finally:
            self._watchers.remove(sender)
            self._watch_scopes.remove(scope)

    async def list_slices(
        self, conn: h11.Connection, stream: trio.abc.Stream, namespace: str, service: str
    ) -> None:
        if self.fail_lists:
            self.fail_lists -= 1
            await self.reply(
                conn, stream, 500, status_doc(500, "InternalError", "etcdserver: leader changed")
            )
            return
        items = [
            {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
            for (ns, _), obj in sorted(self.slices.items())
            if ns == namespace and obj["metadata"]["labels"]["kubernetes.io/service-name"] == service
        ]
        body = {
            "kind": "EndpointSliceList",
            "apiVersion": SLICE_API,
            "metadata": {"resourceVersion": str(self.rv)},
            "items": items,
        }
        await self.reply(conn, stream, 200, body)

    async def watch_slices(
        self,
        conn: h11.Connection,
        stream: trio.abc.Stream,
        query: dict[str, str],
        namespace: str,
        service: str,
    ) -> None:
        if self.watch_gone_http:
            self.watch_gone_http -= 1
            msg = f"too old resource version: {query['resourceVersion']} ({self.rv})"
            await self.reply(conn, stream, 410, status_doc(410, "Gone", msg))
            return
        head = [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")]
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=head)) or b"")

        async def send(event: dict[str, Any]) -> None:
            await stream.send_all(conn.send(h11.Data(data=json.dumps(event).encode() + b"\n")) or b"")

        since = int(query["resourceVersion"])
        if since < self.compacted:
            msg = f"too old resource version: {since} ({self.compacted})"
            await send({"type": "ERROR", "object": status_doc(410, "Expired", msg)})
            await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
            return
        sender, receiver = trio.open_memory_channel[dict[str, Any]](1000)
        scope = trio.CancelScope()
        watcher = (namespace, service, sender)
        self._slice_watchers.append(watcher)
        self._watch_scopes.append(scope)
        try:
            with scope:
                for rv, ns, svc, event in self.slice_history:
                    if rv > since and ns == namespace and svc == service:
                        await send(event)
                seconds = float(query.get("timeoutSeconds", "1800"))
                with trio.move_on_after(min(seconds, self.watch_seconds_cap or seconds)):
                    async for event in receiver:
                        await send(event)
                await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        finally:
            self._slice_watchers.remove(watcher)
            self._watch_scopes.remove(scope)


SLICE_API = "discovery.k8s.io/v1"
SLICES_PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def write_kubeconfig(api: FakeKubeAPI, path: Path, user: dict[str, Any] | None = None) -> Path:
    ca = base64.b64encode(api.ca.cert_pem.bytes()).decode()
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "gw"}}],
        "clusters": [
            {
                "name": "fake",
                "cluster": {"server": f"https://127.0.0.1:{api.port}", "certificate-authority-data": ca},
            }
        ],
        "users": [{"name": "gw", "user": user if user is not None else {"token": api.token}}],
    }
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


@pytest.fixture
async def kube_api(nursery: trio.Nursery) -> FakeKubeAPI:
    api = FakeKubeAPI()
    for name, labels in [("default", {}), ("team-a", {"team": "a"}), ("kube-system", {})]:
        api.put(name, labels)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    api.ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    listeners = await trio.open_ssl_over_tcp_listeners(0, server_ctx, host="127.0.0.1")
    await nursery.start(trio.serve_listeners, api.handle, listeners)
    api.port = listeners[0].transport_listener.socket.getsockname()[1]
    return api
