"""The opt-in conversion cache: partial hits, order, the content key, invalidation, bounds, metrics.

Gateway-level tests run the real gateway and the sample conversion backend; the bounds are also
checked on ``ConversionCache`` itself with a clock the test moves. The property test runs the real
gateway per example and compares its (partly cached) answers with the backend's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config.model import ClientConfig, ConversionEntry
from gateway.conversion.cache import CacheSettings, ConversionCache
from gateway.devtools.conversion import convert_object
from tests.support.client import connect
from tests.support.conversion import CRD, conversion_review, crd, crontab, start_conversion, write_crds

V2 = "stable.example.com/v2"
CACHED = {"webhook-gateway.io/conversion-cache": "true"}


def sent_objects(call: Any) -> list[str]:
    return [o["metadata"]["name"] for o in call.review["request"]["objects"]]


def converted_names(answer: dict[str, Any]) -> list[str]:
    return [o["metadata"]["name"] for o in answer["response"]["convertedObjects"]]


async def cached_setup(
    nursery: trio.Nursery, tmp_path: Path, *args: str, annotations: dict[str, str] | None = None
) -> Any:
    return await start_conversion(
        nursery,
        tmp_path,
        [crd(url="__backend__/convert", annotations=annotations or CACHED)],
        gateway_args=args,
    )


@pytest.mark.parametrize("caller", ["v1", "v1beta1"], ids=["inbound v1", "inbound v1beta1"])
async def test_partial_hits_send_only_misses_and_keep_the_order(nursery, tmp_path, caller):
    setup = await cached_setup(nursery, tmp_path)
    a, b, c, d = (crontab(n) for n in "abcd")
    first = (await setup.send(conversion_review([a, b], version=caller))).json
    assert converted_names(first) == ["a", "b"]
    second = (await setup.send(conversion_review([c, a, d, b], version=caller))).json
    assert second["response"]["result"] == {"status": "Success"}
    assert second["response"]["convertedObjects"] == [convert_object(o, V2) for o in (c, a, d, b)]
    assert [sent_objects(call) for call in setup.backend.calls] == [["a", "b"], ["c", "d"]]
    third = (await setup.send(conversion_review([b, a], version=caller))).json
    assert converted_names(third) == ["b", "a"]
    assert len(setup.backend.calls) == 2  # all hits: no call
    metrics = setup.metrics()
    assert f'webhook_gateway_conversion_cache_hits_total{{crd_name="{CRD}"}} 4.0' in metrics
    assert f'webhook_gateway_conversion_cache_misses_total{{crd_name="{CRD}"}} 4.0' in metrics
    assert "webhook_gateway_conversion_cache_entries 4.0" in metrics
    assert "webhook_gateway_conversion_cache_bytes 0.0" not in metrics


@pytest.mark.parametrize(
    ("second", "desired", "hit"),
    [
        pytest.param(crontab("a"), V2, True, id="the same bytes hit"),
        pytest.param(crontab("a", cron="*/5 * * * *"), V2, False, id="new content under the same uid misses"),
        pytest.param(
            {**crontab("a"), "metadata": {**crontab("a")["metadata"], "resourceVersion": "2"}},
            V2,
            False,
            id="any byte of difference misses",
        ),
        pytest.param(crontab("a"), "stable.example.com/v3", False, id="another desired apiVersion misses"),
    ],
)
async def test_the_key_is_the_exact_input_and_the_desired_version(nursery, tmp_path, second, desired, hit):
    setup = await cached_setup(nursery, tmp_path)
    await setup.send(conversion_review([crontab("a")]))
    answer = (await setup.send(conversion_review([second], desired=desired))).json
    assert answer["response"]["convertedObjects"] == [convert_object(second, desired)]
    assert len(setup.backend.calls) == (1 if hit else 2)


@pytest.mark.parametrize(
    "annotations",
    [
        pytest.param({}, id="no annotation: no cache"),
        pytest.param({"webhook-gateway.io/conversion-cache": "false"}, id="cache false: no cache"),
    ],
)
async def test_the_cache_is_opt_in(nursery, tmp_path, annotations):
    setup = await cached_setup(nursery, tmp_path, annotations=annotations or {"x.example.com/y": "z"})
    for _ in range(2):
        await setup.send(conversion_review([crontab("a")]))
    assert len(setup.backend.calls) == 2
    assert "conversion_cache_hits_total{" not in setup.metrics()


async def test_failed_conversions_are_not_cached(nursery, tmp_path):
    setup = await start_conversion(
        nursery, tmp_path, [crd(url="__backend__/convert/wrong-kind", annotations=CACHED)]
    )
    for _ in range(2):
        answer = (await setup.send(conversion_review([crontab("a")]))).json
        assert answer["response"]["result"]["status"] == "Failure"
    assert len(setup.backend.calls) == 2


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(
            {"webhook-gateway.io/conversion-cache-generation": "2"},
            id="a new cache generation drops the CRD's entries",
        ),
        pytest.param({"path": "/convert/sleep/0"}, id="a changed conversion entry drops the CRD's entries"),
    ],
)
async def test_invalidation(nursery, tmp_path, change):
    setup = await cached_setup(nursery, tmp_path, "--config-poll-seconds", "0.05")
    base = setup.backend.url("").rstrip("/")
    await setup.send(conversion_review([crontab("a")]))
    await setup.send(conversion_review([crontab("a")]))
    assert len(setup.backend.calls) == 1
    annotations = {**CACHED, **{k: v for k, v in change.items() if k != "path"}}
    doc = crd(url=base + change.get("path", "/convert"), annotations=annotations)
    write_crds(tmp_path, [doc], ".next.yaml").rename(tmp_path / "crds.yaml")
    with trio.fail_after(5):
        while setup.running.app.snapshot().generation < 2:  # type: ignore[union-attr]
            await trio.sleep(0.05)
    await setup.send(conversion_review([crontab("a")]))
    assert len(setup.backend.calls) == 2
    assert f'webhook_gateway_conversion_cache_evictions_total{{crd_name="{CRD}"}} 1.0' in setup.metrics()


async def test_entry_bound_evicts_through_the_gateway(nursery, tmp_path):
    setup = await cached_setup(nursery, tmp_path, "--conversion-cache-max-entries", "2")
    await setup.send(conversion_review([crontab(n) for n in "abc"]))
    await setup.send(conversion_review([crontab("a")]))  # evicted: the least recently used
    assert [sent_objects(call) for call in setup.backend.calls] == [["a", "b", "c"], ["a"]]
    metrics = setup.metrics()
    assert "webhook_gateway_conversion_cache_entries 2.0" in metrics
    assert f'webhook_gateway_conversion_cache_evictions_total{{crd_name="{CRD}"}} 2.0' in metrics


# --- bounds on the cache itself ----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(identity: str = "one") -> ConversionEntry:
    return ConversionEntry(
        crd_name=CRD,
        client_config=ClientConfig(url="https://x"),
        conversion_review_versions=("v1",),
        cache_identity=identity,
    )


@pytest.mark.parametrize(
    ("cache_settings", "steps", "expected_hits"),
    [
        pytest.param(
            CacheSettings(ttl_seconds=10),
            [("put", b"a"), ("wait", 9.0), ("get", b"a")],
            [True],
            id="entries live for the TTL",
        ),
        pytest.param(
            CacheSettings(ttl_seconds=10),
            [("put", b"a"), ("wait", 10.0), ("get", b"a")],
            [False],
            id="entries expire after the TTL",
        ),
        pytest.param(
            CacheSettings(max_entries=2),
            [
                ("put", b"a"),
                ("put", b"b"),
                ("get", b"a"),
                ("put", b"c"),
                ("get", b"b"),
                ("get", b"a"),
                ("get", b"c"),
            ],
            [True, False, True, True],
            id="the entry bound evicts the least recently used",
        ),
        pytest.param(
            CacheSettings(max_bytes=2 * (100 + 160)),
            [("put", b"a"), ("put", b"b"), ("put", b"c"), ("get", b"a"), ("get", b"c")],
            [False, True],
            id="the byte bound evicts the least recently used",
        ),
        pytest.param(
            CacheSettings(max_bytes=200),
            [("put", b"a"), ("get", b"a")],
            [False],
            id="an object larger than the byte bound is not kept",
        ),
        pytest.param(
            CacheSettings(),
            [("put", b"a"), ("identity", "two"), ("get", b"a")],
            [False],
            id="a new entry identity drops the CRD's objects",
        ),
    ],
)
def test_bounds(cache_settings, steps, expected_hits):
    clock = Clock()
    cache = ConversionCache(cache_settings, clock)
    current = entry()
    cache.sync(current)
    hits = []
    for op, arg in steps:
        if op == "put":
            cache.put_many(current, V2, [(arg, arg * 100)])
        elif op == "wait":
            clock.now += arg
        elif op == "identity":
            current = entry(arg)
            cache.sync(current)
        else:
            (found,), _ = cache.get_many(current, V2, [arg])
            hits.append(found is not None)
            assert found in (None, arg * 100)
    assert hits == expected_hits
    assert cache.bytes <= cache_settings.max_bytes
    assert len(cache) <= cache_settings.max_entries


# --- property: a cached answer equals the backend's ------------------------------------------------


NAMES = st.sampled_from(["a", "b", "c", "d", "e"])
OBJECTS = st.builds(
    lambda name, cron, version, extra: {
        **crontab(name, version=version, cron=cron),
        **({"status": extra} if extra else {}),
    },
    NAMES,
    st.sampled_from(["0 1 * * *", "*/5 * * * *", "@daily"]),
    st.sampled_from(["v1", "v2"]),
    st.dictionaries(st.sampled_from(["x", "y"]), st.integers(0, 3), max_size=2),
)


async def _compare(
    tmp: Path, warm: list[list[dict[str, Any]]], final: list[dict[str, Any]], desired: str
) -> None:
    async with trio.open_nursery() as nursery:
        setup = await cached_setup(nursery, tmp)
        for objects in warm:
            await setup.send(conversion_review(objects, desired=desired))
        review = conversion_review(final, desired=desired)
        via_gateway = (await setup.send(review)).json["response"]
        direct_client = await connect("127.0.0.1", setup.backend.port, protocol="http1")
        direct = await direct_client.post("/convert", json.dumps(review).encode())
        assert direct is not None
        from_backend = direct.json["response"]
        assert via_gateway["result"] == from_backend["result"] == {"status": "Success"}
        assert via_gateway["convertedObjects"] == from_backend["convertedObjects"]
        await direct_client.aclose()
        nursery.cancel_scope.cancel()  # the gateway and the backend


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    warm=st.lists(st.lists(OBJECTS, max_size=4), max_size=3),
    final=st.lists(OBJECTS, max_size=6),
    desired=st.sampled_from(["stable.example.com/v1", V2]),
)
async def test_a_cached_answer_equals_the_backends(tmp_path_factory, warm, final, desired):
    await _compare(tmp_path_factory.mktemp("cache"), warm, final, desired)
