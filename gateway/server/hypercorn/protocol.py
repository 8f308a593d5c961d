"""``ConnectionProtocol`` replaces hypercorn's ``ProtocolWrapper``: which protocol serves a
connection (HTTP/1.1, or HTTP/2 by ALPN or prior knowledge; never by an ``Upgrade: h2c``, which
``GatewayH11Protocol`` ignores).

Reason: hypercorn's wrapper builds ``H11Protocol``/``H2Protocol`` by their module-level names, so
using the gateway's classes through it meant reassigning those names for the whole process. This
wrapper builds the gateway's classes (``GatewayH11Protocol``, ``GuardedH2Protocol``) explicitly,
for the connections of the gateway's own listener only; hypercorn's modules stay as released.

Byte-level tests: tests/test_server_http11.py (HTTP/1.1), tests/test_server_inbound.py (HTTP/2 by
prior knowledge and the HTTP/2 guards over real sockets) and tests/test_server_framing.py
(``Upgrade: h2c`` is ignored).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from hypercorn.events import Event, RawData
from hypercorn.protocol.h11 import H2ProtocolAssumedError

from gateway.server.hypercorn.http2 import GuardedH2Protocol
from gateway.server.hypercorn.http11 import GatewayH11Protocol

__all__ = ["ConnectionProtocol"]


class ConnectionProtocol:
    """The protocol of one connection: ``protocol`` is the one serving it right now."""

    __slots__ = ("_args", "protocol")

    def __init__(  # noqa: PLR0917 - hypercorn's ProtocolWrapper signature
        self,
        app: Any,
        config: Any,
        context: Any,
        task_group: Any,
        state: Any,
        ssl: bool,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
        send: Callable[[Event], Awaitable[None]],
        alpn_protocol: str | None = None,
    ) -> None:
        self._args = (app, config, context, task_group, state, ssl, client, server, send)
        self.protocol: GatewayH11Protocol | GuardedH2Protocol
        if alpn_protocol == "h2":
            self.protocol = GuardedH2Protocol(*self._args)
        else:
            self.protocol = GatewayH11Protocol(*self._args)

    def release(self) -> None:
        """The connection has closed: break the references back to it (``GatewayTCPServer._release``)."""
        self._args = ()  # type: ignore[assignment]
        self.protocol.release()

    async def initiate(self) -> None:
        await self.protocol.initiate()

    async def handle(self, event: Event) -> None:
        try:
            await self.protocol.handle(event)
        except H2ProtocolAssumedError as error:  # the HTTP/2 preface on an HTTP/1.1 connection
            self.protocol = GuardedH2Protocol(*self._args)
            await self.protocol.initiate()
            if error.data != b"":
                await self.protocol.handle(RawData(data=error.data))
