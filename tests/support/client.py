"""A tiny HTTP client for tests: one connection, HTTP/1.1 (h11) or HTTP/2 (h2), optional TLS.

Written directly on h11/h2 so that tests see exactly what goes over the wire.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any

import h2.config
import h2.connection
import h2.events
import h11
import trio


@dataclass
class Resp:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    """One connection to a backend; ``post`` returns None when the server closed without answering."""

    def __init__(self, stream: trio.abc.Stream, protocol: str, authority: str) -> None:
        self.stream = stream
        self.protocol = protocol
        self.authority = authority.encode()
        self.h11 = h11.Connection(h11.CLIENT)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.started = False
        self.extra_headers: list[tuple[str, str]] = []  # sent with every request

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def post(self, path: str, body: bytes, method: str = "POST") -> Resp | None:
        with trio.fail_after(10):
            if self.protocol == "http1":
                return await self._post_h11(path, body, method)
            return await self._post_h2(path, body, method)

    async def _post_h11(self, path: str, body: bytes, method: str) -> Resp | None:
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        headers = [
            ("host", self.authority.decode()),
            ("content-type", "application/json"),
            *self.extra_headers,
        ]
        headers.append(("content-length", str(len(body))))
        data = self.h11.send(h11.Request(method=method, target=path, headers=headers))
        data += self.h11.send(h11.Data(data=body)) if body else b""
        data += self.h11.send(h11.EndOfMessage())
        await self.stream.send_all(data)
        resp: h11.Response | None = None
        chunks: list[bytes] = []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                try:
                    received = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    received = b""
                self.h11.receive_data(received)
                if not received and resp is None:
                    return None
                continue
            if isinstance(event, h11.Response):
                resp = event
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        assert resp is not None
        hdrs = {k.decode().lower(): v.decode() for k, v in resp.headers}
        return Resp(resp.status_code, hdrs, b"".join(chunks))

    async def _post_h2(self, path: str, body: bytes, method: str) -> Resp | None:
        conn = self.h2
        if not self.started:
            conn.initiate_connection()
            self.started = True
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [
                (b":method", method.encode()),
                (b":scheme", b"https"),
                (b":authority", self.authority),
                (b":path", path.encode()),
                (b"content-type", b"application/json"),
                *((k.encode(), v.encode()) for k, v in self.extra_headers),
            ],
            end_stream=not body,
        )
        if body:
            conn.send_data(sid, body, end_stream=True)
        await self.stream.send_all(conn.data_to_send())
        status = 0
        headers: dict[str, str] = {}
        chunks: list[bytes] = []
        while True:
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            if not data:
                return None
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                    for k, v in ev.headers:
                        if k == b":status":
                            status = int(v)
                        else:
                            headers[k.decode()] = v.decode()
                elif isinstance(ev, h2.events.DataReceived):
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    if ev.stream_id == sid:
                        chunks.append(ev.data)
                elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                    await self.stream.send_all(conn.data_to_send())
                    return Resp(status, headers, b"".join(chunks))
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    return None
            out = conn.data_to_send()
            if out:
                await self.stream.send_all(out)


async def connect(
    host: str,
    port: int,
    *,
    protocol: str = "http1",
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str = "localhost",
) -> Client:
    """Open one connection (TLS when ``ssl_context``; ALPN offers only the chosen protocol)."""
    stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
    if ssl_context is not None:
        ssl_context.set_alpn_protocols(["h2"] if protocol == "h2" else ["http/1.1"])
        tls = trio.SSLStream(stream, ssl_context, server_hostname=server_hostname)
        await tls.do_handshake()
        stream = tls
    return Client(stream, protocol, f"{host}:{port}")
