"""The metrics of the backend protections and of overload shedding, rendered and parsed back."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from gateway.config.backend_policy import ANNOTATION
from gateway.observability.metrics import Metrics
from gateway.resilience import BackendGuards, Pass
from tests.configs.builders import config, hook, load

P = "webhook_gateway_"


def scrape(m: Metrics) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    out: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
    for family in text_string_to_metric_families(m.render()[0].decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def test_circuit_transitions_feed_the_state_gauge_and_the_transition_counter() -> None:
    """Guards report transitions; wired to Metrics they give state (0/1/2) and transitions by state."""
    m = Metrics()
    clock = Clock()
    guards = BackendGuards(clock, lambda name, t: m.circuit_changed(name, int(t.state), t.state.label))
    doc = config(hook("a.b.c"))
    doc["metadata"]["annotations"] = {
        ANNOTATION: '"*": {circuitBreaker: {consecutiveFailures: 1, openSeconds: 5}}'
    }
    guard = guards.for_webhook(load(doc).mutating[0])
    passed = guard.before_call()
    assert isinstance(passed, Pass)
    guard.failed(passed, "timeout")
    refused = guard.before_call()
    assert not isinstance(refused, Pass)
    m.call_refused("a.b.c", refused.reason)
    samples = scrape(m)
    assert samples[P + "backend_circuit_state"] == {frozenset({("webhook", "a.b.c")}): 1.0}
    assert samples[P + "backend_calls_refused_total"] == {
        frozenset({("webhook", "a.b.c"), ("reason", "circuit_open")}): 1.0
    }
    clock.now = 5
    probe = guard.before_call()
    assert isinstance(probe, Pass)
    assert scrape(m)[P + "backend_circuit_state"] == {frozenset({("webhook", "a.b.c")}): 2.0}
    guard.succeeded(probe)
    samples = scrape(m)
    assert samples[P + "backend_circuit_state"] == {frozenset({("webhook", "a.b.c")}): 0.0}
    assert samples[P + "backend_circuit_transitions_total"] == {
        frozenset({("webhook", "a.b.c"), ("state", s)}): 1.0 for s in ("open", "half-open", "closed")
    }


def test_shed_and_shadow_counters() -> None:
    """Shed reasons exist at 0 from the start (alerts work before the first overload)."""
    m = Metrics()
    assert scrape(m)[P + "reviews_shed_total"] == {
        frozenset({("reason", "in_flight")}): 0.0,
        frozenset({("reason", "event_loop_lag")}): 0.0,
        frozenset({("reason", "cpu")}): 0.0,
    }
    m.review_shed("event_loop_lag")
    m.shadow_decision("new.check.example.com", "denied")
    m.shadow_decision("new.check.example.com", "denied")
    samples = scrape(m)
    assert samples[P + "reviews_shed_total"][frozenset({("reason", "event_loop_lag")})] == 1.0
    assert samples[P + "shadow_decisions_total"] == {
        frozenset({("webhook", "new.check.example.com"), ("outcome", "denied")}): 2.0
    }
