"""Benchmark: the HTTP/2 client's protocol work per call, outside the event loop (no sockets, no tasks).

Run: /work/venv/bin/python benchmarks/bench_h2_framer.py [--calls N] [--repeat R] [--old-root DIR]

One call = the request's frames built (HEADERS of a pool-shaped header list, an 8 KB body) and the
server's reply parsed (its WINDOW_UPDATEs, HEADERS, a 120-byte DATA), as the connection does it.
``h2wire`` is this tree's framer; ``h2 (old client)`` drives ``h2.H2Connection`` the way the
client did before the framer (its module is loaded from ``--old-root``, e.g. the output of
``git archive 60e6f77 gateway | tar -x -C DIR``). The server's bytes are recorded once per
client by an ``h2`` server and replayed, so only the client's CPU is timed (best of R).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import h2.config
import h2.connection
import h2.events

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.transport import h2wire  # noqa: E402

BODY = b"x" * 8192
REPLY = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"x","allowed":true}}'
HEADERS = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":authority", b"127.0.0.1:8443"),
    (b":path", b"/validate?timeout=10s"),
    (b"content-type", b"application/json"),
    (b"accept", b"application/json, */*"),
    (b"user-agent", b"webhook-gateway/0.1"),
    (b"content-length", b"8192"),
    (b"authorization", b"Bearer token"),
]


class Client(Protocol):
    def preface(self) -> bytes: ...
    def send(self) -> bytes: ...
    def receive(self, data: bytes) -> tuple[bytes, int | None]: ...


class NewClient:
    def __init__(self) -> None:
        self.core = h2wire.ClientConnection(stream_window=4 << 20, connection_window=16 << 20)
        self.stream: h2wire.Stream | None = None

    def preface(self) -> bytes:
        return self.core.data_to_send()

    def send(self) -> bytes:
        self.stream = stream = h2wire.Stream(1 << 24)
        self.core.open_stream(stream, HEADERS, end_stream=False)
        self.core.send_data(stream, memoryview(BODY), end_stream=True)
        return self.core.data_to_send()

    def receive(self, data: bytes) -> tuple[bytes, int | None]:
        self.core.receive(data)
        stream = self.stream
        done = stream.status if stream is not None and stream.done else None
        if done is not None:
            assert stream.response_body() == REPLY
        return self.core.data_to_send(), done


class OldClient:
    """The calls the client made on h2 before the framer (gateway/transport/http2.py at 60e6f77)."""

    def __init__(self, old: ModuleType) -> None:
        config = h2.config.H2Configuration(
            client_side=True, header_encoding=None, normalize_outbound_headers=False
        )
        self.old = old
        self.h2 = old._BackendH2(config=config)
        self.h2.encoder = old._LiteralEncoder()
        settings = h2.settings.SettingCodes
        self.h2.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                settings.ENABLE_PUSH: 0,
                settings.INITIAL_WINDOW_SIZE: 4 << 20,
                settings.MAX_CONCURRENT_STREAMS: 100,
                settings.MAX_HEADER_LIST_SIZE: 65536,
            },
        )
        old._keep_open_after_goaway(self.h2)
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window((16 << 20) - 65535)
        self.stream_id = 0
        self.status = 0
        self.body = bytearray()

    def preface(self) -> bytes:
        return bytes(self.h2.data_to_send())

    def send(self) -> bytes:
        self.stream_id = sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, self.old._outbound(HEADERS), end_stream=False)
        outbox = bytearray(self.h2.data_to_send())
        view = memoryview(BODY)
        window = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
        self.h2.send_data(sid, bytes(view[:window]), end_stream=True)
        outbox += self.h2.data_to_send()
        self.body = bytearray()
        return bytes(outbox)

    def receive(self, data: bytes) -> tuple[bytes, int | None]:
        done = None
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                self.body += event.data
            elif isinstance(event, h2.events.ResponseReceived):
                self.status = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.StreamEnded):
                done = self.status
                assert bytes(self.body) == REPLY
        return bytes(self.h2.data_to_send()), done


def record(client: Client, calls: int) -> tuple[bytes, list[bytes]]:
    """The server's preface and, per call, its bytes in reply (an h2 server, recorded once)."""
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    server_preface = server.data_to_send()
    server.receive_data(client.preface())
    client.receive(server_preface)
    replies = []
    for _ in range(calls):
        for event in server.receive_data(client.send()):
            if isinstance(event, h2.events.DataReceived):
                server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if isinstance(event, h2.events.StreamEnded):
                fields = [(b":status", b"200"), (b"content-type", b"application/json")]
                fields.append((b"content-length", str(len(REPLY)).encode()))
                server.send_headers(event.stream_id, fields)
                server.send_data(event.stream_id, REPLY, end_stream=True)
        reply = server.data_to_send()
        replies.append(reply)
        out, status = client.receive(reply)
        assert status == 200
        server.receive_data(out)
    return server_preface, replies


def timed(make: Any, calls: int, repeat: int) -> float:
    """Best-of-``repeat`` CPU µs per call for a fresh client replaying the recorded server."""
    server_preface, replies = record(make(), calls)
    best = float("inf")
    for _ in range(repeat):
        client = make()
        client.preface()
        client.receive(server_preface)
        start = time.process_time()
        for reply in replies:
            client.send()
            client.receive(reply)
        best = min(best, (time.process_time() - start) / calls * 1e6)
    return best


def load_old(root: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_http2", Path(root) / "gateway/transport/http2.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--old-root", help="a tree whose gateway/transport/http2.py drives h2")
    args = parser.parse_args()
    rows = [("h2wire", NewClient)]
    if args.old_root:
        old = load_old(args.old_root)
        rows.insert(0, ("h2 (old client)", lambda: OldClient(old)))
    for name, make in rows:
        print(f"{name:<18}{timed(make, args.calls, args.repeat):>8.1f} µs per call", flush=True)


if __name__ == "__main__":
    main()
