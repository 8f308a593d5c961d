"""The load-test tool (loadtests/): statistics, the open-loop scheduler's intended-time accounting,
answer verification, scenario expectations and configs, the backend fleet driven directly, and a
--quick smoke run against a real gateway when one exists."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import yaml
from prometheus_client import generate_latest

from gateway.observability import Metrics
from loadtests.__main__ import parse_rates
from loadtests.drive import arrival_offsets, drive_closed_loop, drive_open_loop
from loadtests.fixtures import SLOW_LABEL, review_templates
from loadtests.report import describe, table
from loadtests.runner import Options, RunResult, run
from loadtests.scenarios import SCENARIOS, Expectation, build, expect_direct, expect_gateway, write_configs
from loadtests.soak import ConfigChurn, reload_counts, summarize_rss
from loadtests.stats import (
    BucketPercentiles,
    LatencySummary,
    PhaseResult,
    Recorder,
    bucket_percentiles,
    counter_total,
    histogram_buckets,
    median_result,
    percentile,
    summarize,
)
from loadtests.verify import INJECTED, OK, Verifier

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------------------
# Statistics


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        pytest.param([1.0, 2.0, 3.0, 4.0], 50, 2.0, id="p50 of four values is the second (nearest rank)"),
        pytest.param(list(range(1, 101)), 99, 99, id="p99 of 1..100 is 99"),
        pytest.param(list(range(1, 1001)), 99.9, 999, id="p99.9 of 1..1000 is 999"),
        pytest.param([5.0], 99.9, 5.0, id="any percentile of one value is that value"),
        pytest.param([1.0, 9.0], 100, 9.0, id="p100 is the maximum"),
        pytest.param([1.0, 9.0], 0, 1.0, id="p0 is the minimum"),
    ],
)
def test_percentile(values: list[float], q: float, expected: float) -> None:
    """Percentiles use the nearest-rank method on sorted values."""
    assert percentile(values, q) == expected


def test_percentile_of_nothing_is_nan() -> None:
    """An empty sample has no percentile (NaN), not an exception."""
    assert math.isnan(percentile([], 50))


def test_summary_counts_only_correct_answers_as_throughput() -> None:
    """Errors are reported by kind and never add to throughput or latency."""
    rec = Recorder(started=10.0, finished=12.0)
    for ms in (1, 2, 3, 4):
        rec.ok(ms / 1000)
    rec.error("wrong-uid")
    rec.error("wrong-uid")
    rec.error("http-500")
    result = summarize("gateway", rec)
    assert (result.ok, result.throughput_rps, result.errors) == (4, 2.0, {"wrong-uid": 2, "http-500": 1})
    assert (result.latency.count, result.latency.p50_ms, result.latency.max_ms) == (4, 2.0, 4.0)
    assert result.by_class == {}


def test_summary_splits_latency_classes() -> None:
    """With more than one latency class (slow-ignore), each class gets its own percentiles."""
    rec = Recorder(started=0.0, finished=1.0)
    rec.ok(0.001, "fast")
    rec.ok(1.0, "slow")
    result = summarize("gateway", rec)
    assert result.by_class["fast"].p50_ms == 1.0
    assert result.by_class["slow"].p50_ms == 1000.0
    assert result.latency.count == 2


def _phase(rps: float, p50: float, errors: dict[str, int]) -> PhaseResult:
    lat = LatencySummary(10, p50, p50, p50, p50, p50, p50)
    return PhaseResult("gateway", 1.0, 10, errors, 0, rps, lat, {}, cpu_us_per_review=rps / 10)


def test_median_of_repeats() -> None:
    """--repeat reports the median of each figure and the sum of all errors."""
    med = median_result([_phase(100, 3, {}), _phase(300, 1, {"x": 1}), _phase(200, 2, {"x": 2})])
    assert (med.throughput_rps, med.latency.p50_ms, med.cpu_us_per_review) == (200, 2, 20)
    assert med.errors == {"x": 3}


def _exposition(counts: dict[str, int], name: str = "webhook_gateway_review_duration_seconds") -> str:
    """A Prometheus text exposition of one histogram, split over two label sets."""
    lines = [f"# TYPE {name} histogram"]
    for endpoint, share in (("validating", 1), ("mutating", 0)):
        for le, n in counts.items():
            lines.append(f'{name}_bucket{{endpoint="{endpoint}",le="{le}"}} {float(n * share)}')
    return "\n".join(lines) + "\n"


INF = math.inf
OWN_VIEWS = [
    pytest.param(
        {"0.001": 0, "0.005": 0, "+Inf": 0},
        {"0.001": 900, "0.005": 995, "+Inf": 1000},
        BucketPercentiles(1000, 1.0, 5.0, INF),
        id="each percentile is the bound of the bucket holding it; past the last finite bound it is infinite",
    ),
    pytest.param(
        {"0.001": 500, "0.005": 500, "+Inf": 500},
        {"0.001": 510, "0.005": 600, "+Inf": 600},
        BucketPercentiles(100, 5.0, 5.0, 5.0),
        id="only what was observed between the two scrapes counts (the warm-up is left out)",
    ),
    pytest.param(
        {"0.001": 7, "+Inf": 7},
        {"0.001": 7, "+Inf": 7},
        None,
        id="nothing observed between the scrapes: no view",
    ),
    pytest.param({}, {}, None, id="a gateway that does not expose the histogram: no view"),
]


@pytest.mark.parametrize(("before", "after", "expected"), OWN_VIEWS)
def test_gateway_view_from_two_scrapes(
    before: dict[str, int], after: dict[str, int], expected: BucketPercentiles | None
) -> None:
    name = "webhook_gateway_review_duration_seconds"
    old, new = histogram_buckets(_exposition(before), name), histogram_buckets(_exposition(after), name)
    assert bucket_percentiles(old, new) == expected


def test_histogram_buckets_sum_label_sets_and_read_only_the_named_histogram() -> None:
    text = (
        'webhook_gateway_review_duration_seconds_bucket{decision="allowed",endpoint="validating",le="0.001"} 3.0\n'
        'webhook_gateway_review_duration_seconds_bucket{decision="denied",endpoint="validating",le="0.001"} 4.0\n'
        'webhook_gateway_review_duration_seconds_bucket{decision="denied",endpoint="validating",le="+Inf"} 5.0\n'
        'webhook_gateway_review_overhead_seconds_bucket{endpoint="validating",le="0.001"} 99.0\n'
        "webhook_gateway_review_duration_seconds_count 5.0\n"
    )
    assert histogram_buckets(text, "webhook_gateway_review_duration_seconds") == {0.001: 7.0, INF: 5.0}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("webhook_gateway_inbound_connections_unused", 7.0, id="a counter without labels is its value"),
        pytest.param("webhook_gateway_inbound_handshakes_failed", 5.0, id="a counter with labels is summed over them"),
        pytest.param("webhook_gateway_reviews_shed", 0.0, id="a counter not exposed is 0"),
    ],
)  # fmt: skip
def test_counter_total_reads_only_the_named_counter(name: str, expected: float) -> None:
    text = (
        "# TYPE webhook_gateway_inbound_connections_unused_total counter\n"
        "webhook_gateway_inbound_connections_unused_total 7.0\n"
        "# TYPE webhook_gateway_inbound_handshakes_failed_total counter\n"
        'webhook_gateway_inbound_handshakes_failed_total{reason="client_gone"} 2.0\n'
        'webhook_gateway_inbound_handshakes_failed_total{reason="refused"} 3.0\n'
    )
    assert counter_total(text, name) == expected


def test_counter_total_reads_the_gateways_own_exposition() -> None:
    """What the load tool scrapes (shed reviews, unused connections) as the gateway renders it."""
    metrics = Metrics()
    metrics.reviews_shed.labels("in_flight").value += 2
    metrics.reviews_shed.labels("event_loop_lag").value += 3
    metrics.inbound_connection_unused()
    text = generate_latest(metrics.registry).decode()
    assert counter_total(text, "webhook_gateway_reviews_shed") == 5
    assert counter_total(text, "webhook_gateway_inbound_connections_unused") == 1


def test_median_of_repeats_keeps_the_gateway_view_on_bucket_bounds() -> None:
    """With an even number of runs the median of two bounds is the higher bound, never between them."""
    views = [BucketPercentiles(10, 1.0, 2.5, 5.0), BucketPercentiles(12, 1.0, 5.0, 10.0)]
    runs = [dataclasses.replace(_phase(100, 1, {}), gateway_review=view) for view in views]
    assert median_result(runs).gateway_review == BucketPercentiles(11, 1.0, 5.0, 10.0)


# ------------------------------------------------------------------------------------------------
# Load shapes


def test_constant_arrivals_are_evenly_spaced() -> None:
    """A constant rate of 4/s over 1 s intends sends at 0, 0.25, 0.5, 0.75 s."""
    assert arrival_offsets(4, 1.0) == [0.0, 0.25, 0.5, 0.75]


def test_arrivals_are_bounded_by_count() -> None:
    """``limit`` caps the number of arrivals whatever the duration."""
    assert len(arrival_offsets(1000, 60, limit=7)) == 7


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    """Poisson arrivals are reproducible per seed, increasing, and stay inside the duration."""
    a = arrival_offsets(100, 2.0, poisson=True, seed=3)
    assert a == arrival_offsets(100, 2.0, poisson=True, seed=3)
    assert a != arrival_offsets(100, 2.0, poisson=True, seed=4)
    assert all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] < 2.0
    assert 100 < len(a) < 300


async def test_open_loop_measures_from_the_intended_time(autojump_clock: trio.testing.MockClock) -> None:
    """A 100 ms stall of the only worker shows up in the latency of every request scheduled during it."""
    latencies: list[float] = []
    sends: list[float] = []

    async def handle(worker: int, intended: float) -> None:
        sends.append(trio.current_time() - start)
        await trio.sleep(0.1 if not sends[:-1] else 0.001)  # the first request stalls
        latencies.append(round(trio.current_time() - intended, 6))

    start = trio.current_time()
    await drive_open_loop([0.0, 0.01, 0.02, 0.2], 1, handle)
    # Requests 2 and 3 were due at 10 and 20 ms but could only start at 100 and 101 ms.
    assert [round(s, 6) for s in sends] == [0.0, 0.1, 0.101, 0.2]
    assert latencies == [0.1, 0.091, 0.082, 0.001]


async def test_open_loop_does_not_wait_for_answers(autojump_clock: trio.testing.MockClock) -> None:
    """With enough workers, arrivals go out on schedule even though every answer takes 1 s."""
    sends: list[float] = []

    async def handle(worker: int, intended: float) -> None:
        sends.append(round(trio.current_time() - start, 6))
        await trio.sleep(1)

    start = trio.current_time()
    await drive_open_loop([0.0, 0.1, 0.2], 3, handle)
    assert sends == [0.0, 0.1, 0.2]


async def test_closed_loop_is_bounded_by_count(autojump_clock: trio.testing.MockClock) -> None:
    """The closed loop issues exactly ``max_requests`` requests across its workers."""
    seen: list[int] = []

    async def handle(worker: int, intended: float) -> None:
        seen.append(worker)
        await trio.sleep(0.01)

    await drive_closed_loop(4, 1000.0, 10, handle)
    assert len(seen) == 10
    assert set(seen) == {0, 1, 2, 3}


async def test_closed_loop_is_bounded_by_duration(autojump_clock: trio.testing.MockClock) -> None:
    """The closed loop stops issuing once its duration has passed."""
    count = 0

    async def handle(worker: int, intended: float) -> None:
        nonlocal count
        count += 1
        await trio.sleep(0.125)  # exact in binary, so the count is exact

    await drive_closed_loop(2, 1.0, None, handle)
    assert count == 16


# ------------------------------------------------------------------------------------------------
# Verification

TEMPLATE = review_templates(2)[0]
UID = "uid-1"


def reply(
    response: dict[str, Any] | None = None, api_version: str = "admission.k8s.io/v1", uid: str = UID
) -> bytes:
    doc: dict[str, Any] = {"apiVersion": api_version, "kind": "AdmissionReview"}
    if response is not None:
        doc["response"] = {"uid": uid, **response}
    return json.dumps(doc).encode()


def patch(ops: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "allowed": True,
        "patchType": "JSONPatch",
        "patch": base64.b64encode(json.dumps(ops).encode()).decode(),
    }


ADD_M0 = [{"op": "add", "path": "/metadata/labels/loadtest-m0", "value": "true"}]
ALLOW = Expectation(allowed=True)
LABEL_M0 = Expectation(allowed=True, labels=("loadtest-m0",))
DENY_DEAD = Expectation(allowed=False, message_contains='failed calling webhook "dead"')
DENIAL = {
    "allowed": False,
    "status": {"code": 500, "message": 'Internal error occurred: failed calling webhook "dead": x'},
}

VERDICTS = [
    pytest.param(200, reply({"allowed": True}), ALLOW, 0.0, OK, id="an expected allow is correct"),
    pytest.param(
        200,
        reply(patch(ADD_M0)),
        LABEL_M0,
        0.0,
        OK,
        id="a patch adding exactly the expected label is correct",
    ),
    pytest.param(
        200, reply(DENIAL), DENY_DEAD, 0.0, OK, id="an expected denial naming the backend is correct"
    ),
    pytest.param(500, b"boom", ALLOW, 0.0, "http-500", id="REV-09: a non-200 status is an error"),
    pytest.param(
        200, b"<html>", ALLOW, 0.0, "undecodable-body", id="REV-08: a body that is not JSON is an error"
    ),
    pytest.param(
        200,
        reply({"allowed": True}, "admission.k8s.io/v1beta1"),
        ALLOW,
        0.0,
        "wrong-api-version-or-kind",
        id="REV-02: a reply in another version is an error",
    ),
    pytest.param(
        200, reply(None), ALLOW, 0.0, "no-response", id="REV-12: a reply without response is an error"
    ),
    pytest.param(
        200,
        reply({"allowed": True}, uid="other"),
        ALLOW,
        0.0,
        "wrong-uid",
        id="REV-02: another uid is an error",
    ),
    pytest.param(
        200,
        reply({"allowed": False}),
        ALLOW,
        0.0,
        "wrong-decision",
        id="a denial where allow is due is an error",
    ),
    pytest.param(
        200,
        reply({"allowed": False, "status": {"message": "other"}}),
        DENY_DEAD,
        0.0,
        "wrong-denial-message",
        id="ERR-02: a denial not naming the failing backend is an error",
    ),
    pytest.param(
        200, reply({"allowed": True}), LABEL_M0, 0.0, "patch-missing", id="MUT: a missing patch is an error"
    ),
    pytest.param(
        200, reply(patch(ADD_M0)), ALLOW, 0.0, "unexpected-patch", id="MUT: an unexpected patch is an error"
    ),
    pytest.param(
        200,
        reply(patch([{"op": "remove", "path": "/metadata/nope"}])),
        LABEL_M0,
        0.0,
        "patch-does-not-apply",
        id="MUT: a patch that does not apply is an error",
    ),
    pytest.param(
        200,
        reply(patch([{"op": "add", "path": "/metadata/labels/other", "value": "true"}])),
        LABEL_M0,
        0.0,
        "patch-wrong-result",
        id="MUT: a patch adding the wrong label is an error",
    ),
    pytest.param(
        200,
        reply({"allowed": True, "patchType": "JSONPatch", "patch": "!!"}),
        LABEL_M0,
        0.0,
        "patch-undecodable",
        id="MUT: a patch that is not base64 is an error",
    ),
    pytest.param(
        200,
        reply(DENIAL),
        ALLOW,
        0.1,
        INJECTED,
        id="with --error-rate a fail-closed denial is counted as injected",
    ),
    pytest.param(
        200,
        reply(DENIAL),
        ALLOW,
        0.0,
        "wrong-decision",
        id="without --error-rate the same denial is an error",
    ),
]


@pytest.mark.parametrize(("status", "body", "expect", "error_rate", "verdict"), VERDICTS)
def test_verifier(status: int, body: bytes, expect: Expectation, error_rate: float, verdict: str) -> None:
    """Every answer is classified: correct, injected failure, or an error of a named kind."""
    assert Verifier(error_rate).check(status, body, UID, TEMPLATE, expect) == verdict


def test_direct_injected_error_is_tolerated() -> None:
    """In the direct baseline an injected HTTP 500 from the backend counts as injected, not wrong."""
    expect = expect_direct(build("passthrough").validating[0])
    assert Verifier(0.2).check(500, b"injected backend error\n", UID, TEMPLATE, expect) == INJECTED


# ------------------------------------------------------------------------------------------------
# Scenarios


EXPECTATIONS = [
    pytest.param("passthrough", "validate", "fast", Expectation(allowed=True), id="passthrough allows"),
    pytest.param(
        "mutating3",
        "mutate",
        "fast",
        Expectation(allowed=True, labels=("loadtest-m0", "loadtest-m1", "loadtest-m2")),
        id="mutating3 adds the three labels in order",
    ),
    pytest.param(
        "dead-fail",
        "validate",
        "fast",
        Expectation(
            allowed=False, message_contains='failed calling webhook "dead.loadtest.webhook-gateway.dev"'
        ),
        id="FPT-01: a dead backend under Fail denies, naming it",
    ),
    pytest.param(
        "slow-ignore",
        "validate",
        "slow",
        Expectation(allowed=True),
        id="FPT-02: a slow backend under Ignore allows",
    ),
    pytest.param(
        "slow-ignore",
        "validate",
        "fast",
        Expectation(allowed=True),
        id="the slow backend does not select fast reviews",
    ),
    pytest.param("none", "validate", "fast", Expectation(allowed=True), id="no matching backend allows"),
]


@pytest.mark.parametrize(("name", "endpoint", "cls", "expected"), EXPECTATIONS)
def test_expectations(name: str, endpoint: str, cls: str, expected: Expectation) -> None:
    """Each scenario states the gateway answer it verifies."""
    assert expect_gateway(build(name), endpoint, cls) == expected


def test_mixed_goes_through_mutate_then_validate() -> None:
    """The mixed scenario sends each review to /mutate and then to /validate, as kube-apiserver does."""
    scenario = build("mixed")
    assert scenario.endpoints == ("mutate", "validate")
    assert (len(scenario.mutating), len(scenario.validating)) == (3, 5)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_configs_are_webhook_configurations(name: str, tmp_path: Path) -> None:
    """Generated configs are admissionregistration.k8s.io/v1 objects naming every backend by URL."""
    scenario = build(name)
    urls = {b.name: f"https://127.0.0.1:{1000 + k}/allow" for k, b in enumerate(scenario.backends)}
    paths = write_configs(scenario, urls, b"-----BEGIN CERTIFICATE-----\n", tmp_path)
    hooks = []
    for path in paths:
        doc = yaml.safe_load(path.read_text())
        assert doc["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert doc["kind"] in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration")
        hooks += doc["webhooks"]
    assert sorted(h["name"] for h in hooks) == sorted(urls)
    assert all(h["clientConfig"]["url"] == urls[h["name"]] and h["clientConfig"]["caBundle"] for h in hooks)
    slow = [h for h in hooks if "objectSelector" in h]
    assert [h["objectSelector"]["matchLabels"] for h in slow] == (
        [{SLOW_LABEL: "true"}] if name == "slow-ignore" else []
    )


@pytest.mark.parametrize("size_kb", [2, 8, 30])
def test_review_fixtures(size_kb: int) -> None:
    """Review templates are realistic Pod CREATE/UPDATE reviews of roughly the asked size with a uid slot."""
    create, update = review_templates(size_kb)
    for t in (create, update):
        doc = json.loads(t.body("u-123"))
        assert doc["request"]["uid"] == "u-123"
        assert doc["request"]["object"]["kind"] == "Pod"
        assert size_kb * 1024 * 0.8 < t.size < max(size_kb * 1024 * 1.25, 5000)
    assert json.loads(create.body("x"))["request"]["oldObject"] is None
    assert json.loads(update.body("x"))["request"]["oldObject"]["kind"] == "Pod"


# ------------------------------------------------------------------------------------------------
# The fleet and generator end to end, without a gateway (direct mode)

DIRECT_RUNS = [
    pytest.param("passthrough", "http1", True, id="HTTP/1.1 over TLS to a validating backend"),
    pytest.param("mutating3", "h2", True, id="HTTP/2 over TLS to a mutating backend: patches verified"),
    pytest.param("passthrough", "h2", False, id="h2c to a validating backend"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "protocol", "tls"), DIRECT_RUNS)
async def test_direct_mode_answers_are_verified(name: str, protocol: str, tls: bool) -> None:
    """The backend fleet (a separate process) answers the generator correctly: no errors, some throughput."""
    opts = Options(
        duration=0.5, warmup=0.1, concurrency=4, protocol=protocol, tls=tls, progress=False, gateway=False
    )
    result = await run(build(name), opts, lambda _msg: None)
    (direct,) = result.points[0]["direct"]
    assert result.points[0]["gateway"] == []
    assert direct.errors == {}
    assert direct.ok > 0
    assert direct.backend_cpu_us_per_review is not None


RATES = [
    pytest.param("800,200", ([200.0, 800.0], []), id="--rate in reviews/s: a sweep, lowest first"),
    pytest.param("50%", ([], [0.5]), id="--rate 50%: half of the capacity probed before each repeat"),
    pytest.param("75%, 25%", ([], [0.25, 0.75]), id="--rate as shares of capacity: a sweep, lowest first"),
    pytest.param(None, ([], []), id="no --rate: closed loop"),
]


@pytest.mark.parametrize(("text", "expected"), RATES)
def test_rates_are_reviews_per_second_or_shares_of_capacity(
    text: str | None, expected: tuple[list[float], list[float]]
) -> None:
    assert parse_rates(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "200,50%", "every rate in reviews/s, or every rate as a %", id="mixed units are refused"
        ),
        pytest.param("0%", "above zero", id="a zero share is refused"),
        pytest.param("-5", "above zero", id="a negative rate is refused"),
        pytest.param("half", "not a number", id="a word is refused"),
    ],
)
def test_bad_rates_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_rates(text)


@pytest.mark.slow
async def test_a_share_of_capacity_follows_the_capacity_probed_before_each_repeat() -> None:
    """``--rate 50%``: before every repeat a closed loop measures the capacity, and the phases of that
    repeat are offered exactly half of it (so a slower machine gets a lower load, not a higher share)."""
    opts = Options(
        duration=0.5,
        warmup=0.1,
        repeat=2,
        capacity_shares=[0.5],
        poisson=True,
        concurrency=16,
        progress=False,
        gateway=False,
        tls=False,
    )
    result = await run(build("passthrough"), opts, lambda _msg: None)
    (probed,) = result.capacities
    runs = result.points[0]["direct"]
    assert len(probed) == len(runs) == 2
    assert all(capacity > 0 for capacity in probed)
    assert [r.offered_rps for r in runs] == [0.5 * capacity for capacity in probed]
    assert all(r.errors == {} and r.ok > 0 for r in runs)
    assert "open loop at 50% of capacity Poisson" in describe(result)


@pytest.mark.slow
async def test_direct_open_loop_with_injected_errors() -> None:
    """Open-loop Poisson load with injected backend errors: failures count as injected, not wrong."""
    opts = Options(
        duration=0.5,
        warmup=0,
        rates=[200],
        poisson=True,
        error_rate=0.5,
        progress=False,
        gateway=False,
        tls=False,
    )
    result = await run(build("passthrough"), opts, lambda _msg: None)
    (direct,) = result.points[0]["direct"]
    assert direct.errors == {}
    assert direct.injected > 0
    assert direct.offered_rps == 200


# ------------------------------------------------------------------------------------------------
# Against a real gateway


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["passthrough"], id="passthrough over HTTP/1.1 + TLS"),
        pytest.param(["mixed", "--protocol", "h2"], id="mixed over HTTP/2"),
        pytest.param(["dead-fail", "--no-tls"], id="FPT-01: dead backend under Fail, plaintext"),
        pytest.param(["slow-ignore"], id="FPT-02: slow backend under Ignore"),
        pytest.param(["none"], id="no matching backend"),
        pytest.param(
            ["passthrough", "--rate", "50%", "--poisson"],
            id="Poisson arrivals at half of the gateway's capacity, probed in the same run",
        ),
        pytest.param(
            ["passthrough", "--generator", "go"],
            id="passthrough called by the apiserver's own Go client (--generator go)",
        ),
        pytest.param(
            ["passthrough", "--rate", "50%", "--poisson", "--generator", "go"],
            id="Poisson arrivals from the Go client at half of the capacity it probed",
        ),
    ],
)
def test_quick_smoke_against_the_gateway(args: list[str], tmp_path: Path) -> None:
    """``python -m loadtests <scenario> --quick`` exits 0: every answer the gateway gave was correct."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtests",
            *args,
            "--quick",
            "--duration",
            "1",
            "--no-progress",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    gateway = doc["points"][0]["median"]["gateway"]
    assert gateway["ok"] > 0
    assert gateway["errors"] == {}
    # The gateway's own /metrics saw the measured phase (not the warm-up): as many reviews as answered.
    assert gateway["gateway_review"]["count"] == gateway["ok"] * len(build(args[0]).endpoints)
    assert "gateway's own /metrics: reviews p50" in proc.stdout
    if "50%" in args:  # the gateway's own capacity, probed in this run, sets the offered load
        (probed,) = doc["capacities"]
        assert gateway["offered_rps"] == probed[0] / 2


@pytest.mark.parametrize(
    "attack",
    [
        pytest.param("slowloris", id="abuse: slowloris beside well-behaved load, every answer correct"),
        pytest.param("h2-settings-flood", id="abuse: HTTP/2 SETTINGS flood beside well-behaved load"),
    ],
)
def test_abuse_quick_keeps_well_behaved_callers_served(attack: str, tmp_path: Path) -> None:
    """``python -m loadtests.abuse <attack> --quick`` exits 0: well-behaved reviews answered in every phase."""
    out = tmp_path / "abuse.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.abuse", attack, "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    phases = json.loads(out.read_text())[attack]
    assert [p["name"] for p in phases] == ["before", "during", "after"]
    assert all(p["ok"] > 0 and p["errors"] == 0 and p["fds"] > 0 for p in phases)


# ------------------------------------------------------------------------------------------------
# Soak mode: configuration churn, reload counting and the resident-set series

RSS_SUMMARIES = [
    pytest.param(
        [(0, 60.0), (150, 70.0), (300, 75.0), (900, 76.5), (1800, 78.0)],
        {"first_mb": 60.0, "last_mb": 78.0, "max_mb": 78.0, "baseline_s": 300, "baseline_mb": 75.0}
        | {"end_s": 1800, "growth_mb": 3.0, "growth_pct": 4.0},
        id="a 30-minute run grows from the sample at 5 minutes, not from the cold start",
    ),
    pytest.param(
        [(0, 50.0), (240, 64.0), (330, 80.0), (600, 72.0)],
        {"first_mb": 50.0, "last_mb": 72.0, "max_mb": 80.0, "baseline_s": 240, "baseline_mb": 64.0}
        | {"end_s": 600, "growth_mb": 8.0, "growth_pct": 12.5},
        id="the baseline is the last sample at or before 5 minutes; a peak after it is the max only",
    ),
    pytest.param(
        [(0, 80.0), (300, 80.0), (600, 76.0)],
        {"first_mb": 80.0, "last_mb": 76.0, "max_mb": 80.0, "baseline_s": 300, "baseline_mb": 80.0}
        | {"end_s": 600, "growth_mb": -4.0, "growth_pct": -5.0},
        id="memory given back shows as negative growth",
    ),
    pytest.param(
        [(0, 40.0), (1, 41.0), (3, 42.0)],
        {"first_mb": 40.0, "last_mb": 42.0, "max_mb": 42.0, "baseline_s": 0, "baseline_mb": 40.0}
        | {"end_s": 3, "growth_mb": 2.0, "growth_pct": 5.0},
        id="a run shorter than 5 minutes grows from its first sample",
    ),
    pytest.param([], None, id="no samples: no summary"),
]


@pytest.mark.parametrize(("samples", "expected"), RSS_SUMMARIES)
def test_rss_series_summary(samples: list[tuple[float, float]], expected: dict[str, float] | None) -> None:
    assert summarize_rss(samples) == expected


METRICS = [
    pytest.param(
        "# TYPE webhook_gateway_config_reloads_total counter\n"
        'webhook_gateway_config_reloads_total{result="success"} 7.0\n'
        'webhook_gateway_config_reloads_total{result="failure"} 2.0\n'
        "webhook_gateway_config_generation 6.0\n",
        (7, 2),
        id="success and failure are read from config_reloads_total",
    ),
    pytest.param(
        'webhook_gateway_config_reloads_total{result="success"} 1\n', (1, 0), id="a missing result is 0"
    ),
    pytest.param(
        'webhook_gateway_serving_certificate_reloads_total{result="success"} 3.0\n',
        (0, 0),
        id="certificate reloads are not configuration reloads",
    ),
]


@pytest.mark.parametrize(("text", "expected"), METRICS)
def test_reload_counts_from_metrics(text: str, expected: tuple[int, int]) -> None:
    assert reload_counts(text) == expected


@pytest.mark.parametrize("name", ["passthrough", "mixed", "slow-ignore", "dead-fail", "backend-down"])
def test_config_churn_changes_the_files_but_no_pod_rule(name: str, tmp_path: Path) -> None:
    """Every rewrite is a valid configuration that differs from the last (so the gateway reloads it);
    the scenario's webhooks keep their rules, and the webhook added every other time matches no Pod."""
    from gateway.config.load import load_directory

    scenario = build(name)
    urls = {b.name: f"https://127.0.0.1:{1000 + k}/allow" for k, b in enumerate(scenario.backends)}
    write_configs(scenario, urls, None, tmp_path)
    original = load_directory(tmp_path)
    churn = ConfigChurn(tmp_path)
    seen = {tuple(sorted(p.read_text() for p in tmp_path.glob("*.yaml")))}
    for k in range(1, 5):
        churn.rewrite()
        seen.add(tuple(sorted(p.read_text() for p in tmp_path.glob("*.yaml"))))
        snapshot = load_directory(tmp_path)
        hooks = {h.name: h for h in (*snapshot.validating, *snapshot.mutating)}
        for h in (*original.validating, *original.mutating):
            assert hooks.pop(h.name).rules == h.rules
        extra = list(hooks.values())
        assert len(extra) == k % 2
        assert all("pods" not in r.resources for h in extra for r in h.rules)
        assert not list(tmp_path.glob(".*")), "no temporary file is left behind"
    assert len(seen) == 5


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["passthrough"], id="reloads every second under load are all applied, no wrong answer"),
        pytest.param(
            ["mixed", "--protocol", "h2"],
            id="reloads under mutate-then-validate over HTTP/2 change no answer",
        ),
    ],
)
def test_soak_reloads_are_applied_and_rss_is_sampled(args: list[str], tmp_path: Path) -> None:
    """``--reload-every 1`` during a 3 s gateway phase: the gateway applies every rewrite (its
    config_reloads_total), refuses none, every answer stays correct; ``--rss-every 1`` puts the
    gateway's resident-set series and its summary into the JSON."""
    out = tmp_path / "result.json"
    soak = ["--duration", "3", "--warmup", "0.3", "--reload-every", "1", "--rss-every", "1", "--no-direct"]
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests", *args, *soak, "--no-progress", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    gateway = doc["points"][0]["median"]["gateway"]
    assert gateway["ok"] > 0
    assert gateway["errors"] == {}
    # The gateway's own /metrics saw the measured phase (not the warm-up): as many reviews as answered.
    assert gateway["gateway_review"]["count"] == gateway["ok"] * len(build(args[0]).endpoints)
    assert "gateway's own /metrics: reviews p50" in proc.stdout
    reloads = doc["reloads"]
    assert reloads["applied"] >= 2
    assert reloads["refused"] == 0
    assert reloads["applied"] == reloads["requested"]
    rss = doc["rss"]
    assert len(rss["series"]) >= 3
    assert all(s["mb"] > 0 for s in rss["series"])
    assert rss["summary"]["last_mb"] == rss["series"][-1]["mb"]
    assert "configuration reloads in gateway phases" in proc.stdout
    assert "gateway RSS" in proc.stdout


def _server_phase(name: str, *, cpu_s: float | None, elapsed_s: float = 10.0) -> PhaseResult:
    latency = LatencySummary.of([0.001, 0.002])
    return PhaseResult(
        name=name,
        elapsed_s=elapsed_s,
        ok=2,
        errors={},
        injected=0,
        throughput_rps=0.2,
        latency=latency,
        by_class={},
        cpu_s=cpu_s,
    )


@pytest.mark.parametrize(
    ("gateway_cpu", "phases", "expected"),
    [
        pytest.param(
            0.5,
            [_server_phase("gateway", cpu_s=4.9), _server_phase("nginx", cpu_s=0.2)],
            [
                "  CPU: the gateway process used 0.49 of a CPU, 98 % of its allowance (0.5 of a CPU)",
                "  CPU: the nginx process used 0.02 of a CPU, 4 % of its allowance (0.5 of a CPU)",
            ],
            id="--gateway-cpu: each measured server's CPU as a share of its quota (at 100 % its queue only grows)",
        ),
        pytest.param(
            0.5,
            [_server_phase("direct", cpu_s=3.0)],
            [],
            id="--gateway-cpu: the direct row's CPU is the backends', which run without the quota: no share",
        ),
        pytest.param(
            None,
            [_server_phase("gateway", cpu_s=4.9)],
            [],
            id="without --gateway-cpu there is no allowance to share",
        ),
    ],
)
def test_the_report_gives_each_servers_cpu_as_a_share_of_its_quota(
    gateway_cpu: float | None, phases: list[PhaseResult], expected: list[str]
) -> None:
    opts = Options(duration=10, gateway_cpu=gateway_cpu, progress=False)
    result = RunResult(scenario=build("passthrough"), options=opts, points=[{p.name: [p] for p in phases}])
    assert [line for line in table(result).splitlines() if line.startswith("  CPU: ")] == expected
