"""``GatewayHTTPStream`` replaces hypercorn's ``HTTPStream`` (the ASGI bridge of one request) for
HTTP/1.1 requests; HTTP/2 streams and upgrades keep hypercorn's own.

Reason: **measured speed.** The scope is built as hypercorn builds it (the same keys and values)
without the intermediate ``Request`` event, and a response the app sends as one head and one final
body goes out in one write through ``GatewayH11Protocol.finish_response``: the HTTP/1.1 inbound
rows of docs/performance.md (``none`` 343 → ~270 µs with the other cuts of that row; the head
written with its body, −32 µs).

Byte-level tests: tests/test_server_http11.py (the scope and the replies compared with plain
hypercorn's, over real sockets; a whole reply is one write).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from time import time
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from hypercorn.protocol.events import Response, StreamClosed
from hypercorn.protocol.h11 import STREAM_ID
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.utils import build_and_validate_headers, suppress_body, valid_server_name

if TYPE_CHECKING:
    from gateway.server.hypercorn.http11 import GatewayH11Protocol

__all__ = ["GatewayHTTPStream"]


class _Head:
    """What hypercorn's ``valid_server_name`` reads of a request: its headers."""

    __slots__ = ("headers",)

    def __init__(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.headers = headers


class GatewayHTTPStream(HTTPStream):
    """hypercorn's ASGI bridge for one HTTP/1.1 request, with the per-request work cut.

    Anything the app does beyond one head and one final body (a streamed body, trailers, an app
    that ends early) takes hypercorn's own path.
    """

    app_put: Any = None  # hypercorn reads it on close, also when no app was started

    def __init__(self, protocol: GatewayH11Protocol) -> None:
        super().__init__(
            protocol.app,
            protocol.config,
            protocol.context,
            protocol.task_group,
            protocol.ssl,
            protocol.client,
            protocol.server,
            protocol.stream_send,
            STREAM_ID,
        )
        self.protocol = protocol
        self._head_pending = False

    async def start(
        self,
        method: bytes,
        target: bytes,
        http_version: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        scope_headers: list[tuple[bytes, bytes]],
        *,
        inline: bool = False,
        on_first_receive: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """The request head arrived: build the ASGI scope and start the app.

        ``headers`` with lower-case names; ``scope_headers`` the list the app is given (names as
        sent with ``h11_pass_raw_headers``); ``inline``: the caller runs the app itself
        (``GatewayTaskGroup.run_inline``) once it has queued the body; ``on_first_receive``: awaited
        when the app first reads the request (the 100 Continue of ``Expect: 100-continue``).
        """
        self.start_time = time()
        config = self.config
        path, _, query_string = target.partition(b"?")
        self.scope = {
            "type": "http",
            "http_version": http_version.decode(),
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": method.decode("ascii"),  # as sent: a lower-case one never gets here (framing_error)
            "scheme": self.scheme,
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query_string,
            "root_path": config.root_path,
            "headers": scope_headers,
            "client": self.client,
            "server": self.server,
            "state": self.protocol.connection_state.copy(),  # type: ignore[typeddict-item]
            "extensions": {},
        }
        if config.server_names and not valid_server_name(config, _Head(headers)):  # type: ignore[arg-type]
            await self._send_error_response(404)
            self.closed = True
            return
        task_group: Any = self.task_group
        self.app_put = task_group.start_request(
            self.app,
            config,
            self.scope,
            self.app_send,
            stream_id=self.stream_id,
            http11=True,
            inline=inline,
            on_first_receive=on_first_receive,
        )

    async def body(self, data: bytes, *, end: bool) -> None:
        """A body chunk for the app; ``end``: it is the last."""
        if not self.closed:
            await self.app_put({"type": "http.request", "body": data, "more_body": not end})

    async def app_send(self, message: Any) -> None:
        if message is not None and not self.closed:
            kind = message["type"]
            if kind == "http.response.start" and self.state is ASGIHTTPState.REQUEST:
                if int(message["status"]) >= 200:
                    self.response = message  # goes out with the body (finish_response) or below
                    self.state = ASGIHTTPState.RESPONSE
                    self._head_pending = True
                    return
            elif (
                kind == "http.response.body"
                and self._head_pending
                and not message.get("more_body", False)
                and not self.response.get("trailers", False)
            ):
                self._head_pending = False
                status = int(self.response["status"])
                body = b"" if suppress_body(self.scope["method"], status) else bytes(message.get("body", b""))
                await self.protocol.finish_response(status, list(self.response.get("headers", ())), body)
                self.state = ASGIHTTPState.CLOSED
                if self.config.accesslog is not None:  # hypercorn's own access log (off in the gateway)
                    await self.config.log.access(self.scope, self.response, time() - self.start_time)
                await self.send(StreamClosed(stream_id=self.stream_id))
                return
        if self._head_pending:  # anything else: the head goes out the ordinary way first
            self._head_pending = False
            await self.send(
                Response(
                    stream_id=self.stream_id,
                    headers=build_and_validate_headers(self.response.get("headers", [])),
                    status_code=int(self.response["status"]),
                )
            )
        await super().app_send(message)
