"""A fake kube-apiserver serving Namespaces on 127.0.0.1 over TLS, in the real wire format.

``NamespaceList`` with ``metadata.resourceVersion`` (and ``continue`` pagination), chunked watch
responses with one JSON ``WatchEvent`` per line, ``BOOKMARK`` events carrying only a
resourceVersion, ``ERROR`` events with a 410 ``Expired`` Status, HTTP 410 ``Gone``, and ``Status``
bodies for 401/403/404/500.
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
    # Other resources, for list requests only (audit): list path → (List kind, items). Add them with
    # ``add_object``; namespaced lists are served both per namespace and across all namespaces.
    objects: dict[str, tuple[str, list[dict[str, Any]]]] = field(default_factory=dict)
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
            self.objects.setdefault(path, (list_kind, []))[1].append(obj)

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
        obj = self._object(name)
        del self.namespaces[name]
        self.rv += 1
        obj["metadata"] = {**obj["metadata"], "resourceVersion": str(self.rv)}
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

    def compact(self) -> None:
        """etcd compaction: watching from any revision before the current one is now too old."""
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
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            assert request is not None
            await self.route(conn, stream, request)
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError, ssl.SSLError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def route(self, conn: h11.Connection, stream: trio.abc.Stream, request: h11.Request) -> None:
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
        if target.path in self.objects:
            await self.list_objects(conn, stream, target.path, query)
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
        list_kind, all_items = self.objects[path]
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
