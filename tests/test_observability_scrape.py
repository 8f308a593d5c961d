"""End to end: the real gateway with ``Observability`` on 127.0.0.1, real sample backends, a scripted set of
reviews, then ``GET /metrics`` over the socket and the canonical lines that were written (MET-02..09, FPT-03).

The timeout scenario waits for a real ``timeoutSeconds: 1``, so this file takes about a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from gateway.cli import parse
from gateway.devtools.backends import serve_backend
from gateway.observability.observer import Observability
from gateway.server.serve import Running, serve
from tests.support.client import connect
from tests.support.gateway import gateway_client, hook, pod, port_of, review, send_review, write_config

P = "webhook_gateway_"
Labels = frozenset[tuple[str, str]]


def only(scenario: str, name: str, url: str, **fields: Any) -> dict[str, Any]:
    """A backend that sees only pods labelled ``scenario=<scenario>``."""
    return hook(name, url, objectSelector={"matchLabels": {"scenario": scenario}}, **fields)


def scrape_text(text: str) -> dict[str, dict[Labels, float]]:
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = family.name if family.type == "counter" and f"\n{family.name}{{" in text else s.name
            out.setdefault(name, {})[frozenset(s.labels.items())] = s.value
    return out


def L(**labels: str) -> Labels:  # reads like a label-set literal
    return frozenset(labels.items())


async def test_scripted_reviews_then_scrape(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Allow, deny, timeouts under Ignore and Fail, a bad response, a 400: /metrics and logs agree."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    base = f"http://127.0.0.1:{server.port}"
    write_config(
        tmp_path,
        validating={
            "policies": [
                only("allow", "allow.example.com", base + "/allow"),
                only("deny", "deny.example.com", base + "/deny/403/image%20registry%20not%20allowed"),
                only("timeout", "ignore.example.com", base + "/sleep/3000/allow",
                     failurePolicy="Ignore", timeoutSeconds=1),
                only("timeout", "fail.example.com", base + "/sleep/3000/allow", timeoutSeconds=1),
                only("bad", "bad.example.com", base + "/empty-body"),
            ]
        },
        mutating={"labels": [only("allow", "patch.example.com", base + "/patch/checked")]},
    )  # fmt: skip
    options = parse(["--config", str(tmp_path), "--bind", "127.0.0.1:0", "--drain-seconds", "0"]).options
    with capture_logs() as logs:
        obs = Observability(metrics=True)
        running: Running = await nursery.start(
            lambda task_status: serve(options, observer=obs, handle_signals=False, task_status=task_status)
        )
        client = await gateway_client(running)
        verdicts = {}
        script = [("allow", "validate"), ("allow", "validate"), ("deny", "validate"),
                  ("timeout", "validate"), ("bad", "validate"), ("allow", "mutate")]  # fmt: skip
        for scenario, endpoint in script:
            doc = review(pod(labels={"scenario": scenario}))
            resp = await send_review(client, endpoint, doc)
            verdicts[(scenario, endpoint)] = resp.json["response"]["allowed"]
        malformed = await client.post("/validate", b"{not json")
        assert malformed is not None
        assert malformed.status == 400
        scraped = await client.post("/metrics", b"", method="GET")
        await client.aclose()
        running.shutdown()

    assert verdicts == {
        ("allow", "validate"): True,
        ("deny", "validate"): False,
        ("timeout", "validate"): False,
        ("bad", "validate"): False,
        ("allow", "mutate"): True,
    }
    assert scraped is not None
    assert scraped.status == 200
    assert scraped.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    s = scrape_text(scraped.body.decode())
    v = {"type": "validating", "operation": "CREATE"}
    assert s[P + "admission_webhook_request_total"] == {
        L(name="allow.example.com", code="200", rejected="false", **v): 2.0,
        L(name="deny.example.com", code="403", rejected="true", **v): 1.0,
        L(name="ignore.example.com", code="503", rejected="false", **v): 1.0,
        L(name="fail.example.com", code="503", rejected="true", **v): 1.0,
        L(name="bad.example.com", code="503", rejected="true", **v): 1.0,
        L(name="patch.example.com", code="200", rejected="false", type="admit", operation="CREATE"): 1.0,
    }
    assert s[P + "admission_webhook_fail_open_count"] == {
        L(name="ignore.example.com", type="validating"): 1.0
    }
    assert s[P + "admission_webhook_rejection_count"] == {
        L(name="deny.example.com", error_type="no_error", rejection_code="403", **v): 1.0,
        L(name="fail.example.com", error_type="calling_webhook_error", rejection_code="503", **v): 1.0,
        L(name="bad.example.com", error_type="calling_webhook_error", rejection_code="503", **v): 1.0,
    }
    assert s[P + "admission_step_admission_duration_seconds_count"] == {
        L(type="validate", operation="CREATE", rejected="false"): 2.0,
        L(type="validate", operation="CREATE", rejected="true"): 3.0,
        L(type="admit", operation="CREATE", rejected="false"): 1.0,
    }
    assert s[P + "inbound_requests_total"] == {
        L(endpoint="validating", code="200"): 5.0,
        L(endpoint="validating", code="400"): 1.0,
        L(endpoint="mutating", code="200"): 1.0,
    }
    assert {dict(k)["name"]: dict(k)["reason"] for k in s[P + "backend_call_errors_total"]} == {
        "ignore.example.com": "timeout",
        "fail.example.com": "timeout",
        "bad.example.com": "decode",  # REV-08: an empty body is undecodable
    }
    assert s[P + "config_reloads_total"] == {L(result="success"): 1.0, L(result="failure"): 0.0}
    assert s[P + "backends"] == {L(kind="validating"): 5.0, L(kind="mutating"): 1.0}
    assert s[P + "config_generation"] == {L(): 1.0}
    assert s[P + "reviews_in_flight"] == {L(endpoint="validating"): 0.0, L(endpoint="mutating"): 0.0}
    connections = s[P + "backend_open_connections"]
    assert list(connections) == [L(origin=base)]  # kept-alive connections, labelled by origin
    assert connections[L(origin=base)] >= 1

    lines = [e for e in logs if e["event"] == "review"]
    assert [(e["decision"], e.get("denied_by")) for e in lines] == [
        ("allowed", None),
        ("allowed", None),
        ("denied", "deny.example.com"),
        ("denied", "fail.example.com"),
        ("denied", "bad.example.com"),
        ("allowed", None),
        ("error", None),
    ]
    assert lines[2]["reason"] == (
        'admission webhook "deny.example.com" denied the request: image registry not allowed'
    )
    assert [(b["name"], b["outcome"], b.get("error_kind")) for b in lines[3]["backends"]] == [
        ("ignore.example.com", "failed_open", "timeout"),
        ("fail.example.com", "failed_closed", "timeout"),
    ]
    assert lines[6]["code"] == 400
    failed_open = [e for e in logs if e["event"] == "backend failed open"]
    assert [(e["webhook"], e["log_level"]) for e in failed_open] == [("ignore.example.com", "warning")]
    assert "context deadline exceeded" in failed_open[0]["error"]
    json.dumps([{k: v for k, v in e.items() if k != "object"} for e in lines])  # plain values only


async def test_metrics_on_a_separate_listener(nursery: trio.Nursery, tmp_path: Path) -> None:
    """--metrics-bind serves /metrics, /healthz and /readyz on its own plaintext port, and nothing else."""
    write_config(tmp_path / "c")
    options = parse(
        [
            "--config",
            str(tmp_path / "c"),
            "--bind",
            "127.0.0.1:0",
            "--metrics-bind",
            "127.0.0.1:0",
            "--drain-seconds",
            "0",
            "--allow-empty-config",
        ]
    ).options
    running = await nursery.start(
        lambda task_status: serve(
            options, observer=Observability(), handle_signals=False, task_status=task_status
        )
    )
    (metrics_url,) = running.metrics_urls
    client = await connect("127.0.0.1", port_of(metrics_url))
    for path, status in (("/metrics", 200), ("/healthz", 200), ("/readyz", 200), ("/validate", 404)):
        got = await client.post(path, b"", method="GET" if path != "/validate" else "POST")
        assert got is not None
        assert got.status == status, path
    got = await client.post("/metrics", b"", method="GET")
    assert got is not None
    assert b"webhook_gateway_config_generation 1" in got.body
