"""The HTTP/2 client's header encoder (plain literals, memoised per connection) produces blocks any
HPACK decoder reads back exactly: across calls, with long values, with credentials marked never
indexed (TRN-05 headers must reach the backend unchanged; credentials stay out of compression state)."""

from __future__ import annotations

import hpack
import pytest

from gateway.transport.http2 import _LiteralEncoder

CALL = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"127.0.0.1:8443"),
    (b":path", b"/validate?timeout=10s"),
    (b"content-type", b"application/json"),
    (b"content-length", b"8123"),
]


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(CALL, id="a backend call's headers decode unchanged"),
        pytest.param([*CALL, (b"x-long", b"v" * 20000)], id="a value longer than one length byte"),
        pytest.param([(b"n" * 127, b"v" * 126)], id="lengths at the 7-bit prefix boundary"),
        pytest.param(
            [*CALL, hpack.NeverIndexedHeaderTuple(b"authorization", b"Bearer secret")],
            id="credentials are sent as never-indexed literals",
        ),
    ],
)
def test_blocks_decode_to_the_same_headers_on_every_call(headers: list[tuple[bytes, bytes]]) -> None:
    encoder, decoder = _LiteralEncoder(), hpack.Decoder(max_header_list_size=1 << 20)
    decoder.max_allowed_table_size = encoder.header_table_size
    for _ in range(3):  # the second and third blocks come from the memo
        got = decoder.decode(encoder.encode(headers), raw=True)
        assert [(n, v) for n, v in got] == [(h[0], h[1]) for h in headers]
        for sent, received in zip(headers, got, strict=True):
            if isinstance(sent, hpack.HeaderTuple) and not sent.indexable:
                assert not received.indexable
    assert decoder.header_table_size == 4096 and len(decoder.header_table.dynamic_entries) == 0


def test_a_peers_new_table_size_is_signalled_and_the_memo_is_bounded() -> None:
    encoder, decoder = _LiteralEncoder(), hpack.Decoder()
    encoder.header_table_size = 1024  # the peer's SETTINGS_HEADER_TABLE_SIZE
    decoder.max_allowed_table_size = 1024
    assert decoder.decode(encoder.encode(CALL), raw=True) == CALL
    assert decoder.header_table_size == 1024
    for n in range(2 * _LiteralEncoder.MEMO_FIELDS):
        fields = [(b"content-length", str(n).encode())]
        assert decoder.decode(encoder.encode(fields), raw=True) == fields
    assert len(encoder._memo) <= _LiteralEncoder.MEMO_FIELDS
