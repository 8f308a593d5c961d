"""Codec micro-benchmarks: the per-review and per-backend-call costs on the hot path.

Run: /work/venv/bin/python -m pytest benchmarks/bench_codec.py --benchmark-only

- decode an ~8 KB v1 inbound review (once per review);
- encode it as a v1beta1 backend request (once per backend call), against a plain Struct encoding
  of the same request to show what the per-review template saves;
- decode and verify a typical backend reply (once per backend call).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from pytest_benchmark.fixture import BenchmarkFixture

from gateway.admission import GroupVersionKind, GroupVersionResource
from gateway.review import decode_backend_response, decode_inbound, encode_backend_request
from gateway.review.types import UserInfo

GOLDEN = Path(__file__).parent.parent / "tests" / "golden"
INBOUND = json.dumps(
    json.loads((GOLDEN / "inbound" / "create-pod.v1.json").read_bytes()), separators=(",", ":")
).encode()
UID = "11111111-2222-4333-8444-555555555555"
REPLY = (
    b'{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","response":{"uid":"'
    + UID.encode()
    + b'","allowed":true,"patchType":"JSONPatch",'
    b'"patch":"W3sib3AiOiJhZGQiLCJwYXRoIjoiL21ldGFkYXRhL2xhYmVscy90ZWFtIiwidmFsdWUiOiJwYXltZW50cyJ9XQ==",'
    b'"auditAnnotations":{"team":"payments"},"warnings":["tag :latest is discouraged"]}}'
)


def test_inbound_is_about_8_kib() -> None:
    """The benchmark input has the advertised size."""
    assert 7_000 < len(INBOUND) < 9_000


def test_decode_inbound_8k(benchmark: BenchmarkFixture) -> None:
    """Decode and validate the caller's ~8 KB v1 review into attributes."""
    result = benchmark(decode_inbound, INBOUND)
    assert result.uid


def test_encode_backend_request_v1beta1(benchmark: BenchmarkFixture) -> None:
    """Encode the review as a v1beta1 backend request (template built on the first call, then reused)."""
    inbound = decode_inbound(INBOUND)
    obj = inbound.attributes.object
    body = benchmark(lambda: encode_backend_request(inbound, version="v1beta1", uid=UID, object=obj))
    assert len(body) > len(INBOUND) - 200


def test_encode_backend_request_first_call(benchmark: BenchmarkFixture) -> None:
    """The first backend request of a review, which also builds the review's template."""
    inbound = decode_inbound(INBOUND)
    obj = inbound.attributes.object

    def first() -> bytes:
        inbound._template = None  # forget the template, as a new review would not have it
        return encode_backend_request(inbound, version="v1beta1", uid=UID, object=obj)

    benchmark(first)


class _Request(msgspec.Struct, rename="camel", omit_defaults=True, kw_only=True):
    uid: str
    kind: GroupVersionKind
    resource: GroupVersionResource
    sub_resource: str = ""
    request_kind: GroupVersionKind | None = None
    request_resource: GroupVersionResource | None = None
    request_sub_resource: str = ""
    name: str = ""
    namespace: str = ""
    operation: str
    user_info: UserInfo
    object: msgspec.Raw
    old_object: msgspec.Raw
    dry_run: bool
    options: msgspec.Raw


class _Review(msgspec.Struct, rename="camel"):
    api_version: str
    kind: str
    request: _Request


_encoder = msgspec.json.Encoder()


def test_baseline_struct_encoding_v1beta1(benchmark: BenchmarkFixture) -> None:
    """Baseline for comparison: build and encode a full request Struct per call (no template)."""
    inbound = decode_inbound(INBOUND)
    r = inbound.request
    obj = inbound.attributes.object
    assert obj is not None

    def plain() -> bytes:
        return _encoder.encode(
            _Review(
                api_version="admission.k8s.io/v1beta1",
                kind="AdmissionReview",
                request=_Request(
                    uid=UID,
                    kind=r.kind,
                    resource=r.resource,
                    sub_resource=r.sub_resource,
                    request_kind=r.request_kind,
                    request_resource=r.request_resource,
                    request_sub_resource=r.request_sub_resource or "",
                    name=r.name,
                    namespace=r.namespace,
                    operation=r.operation,
                    user_info=r.user_info,
                    object=obj,
                    old_object=r.old_object,
                    dry_run=bool(r.dry_run),
                    options=r.options,
                ),
            )
        )

    assert plain() == encode_backend_request(inbound, version="v1beta1", uid=UID, object=obj)
    benchmark(plain)


def test_decode_backend_reply(benchmark: BenchmarkFixture) -> None:
    """Decode and verify a typical mutating v1beta1 reply (patch, annotation, warning)."""
    result = benchmark(lambda: decode_backend_response(REPLY, version="v1beta1", sent_uid=UID, mutating=True))
    assert result.patch is not None
