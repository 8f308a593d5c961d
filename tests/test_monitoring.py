"""The monitoring pack: alerting rules, their unit tests, the dashboard and the metric reference.

Tested with the real tools: ``promtool check rules`` and ``promtool test rules`` on the rules the
PrometheusRule ships, and a real Prometheus (loopback only, a temporary directory, a one-second
scrape interval) scraping a real gateway process under a short load, until every dashboard panel's
query returns data and every rule evaluates without error.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import ssl
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
import yaml

from gateway.devtools.backends import serve_backend
from gateway.observability import metrics_doc
from gateway.observability.metrics import Metrics
from loadtests.processes import free_port
from tests.support.client import connect
from tests.support.conversion import CRD, conversion_review, crd, crontab, write_crds
from tests.support.gateway import hook, review, send_review, write_config
from tests.support.tools import require_tool

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "deploy" / "components" / "monitoring"
RUNBOOKS = ROOT / "docs" / "runbooks.md"


def rule_groups() -> dict[str, Any]:
    return dict(yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"])


def alerts() -> list[dict[str, Any]]:
    return [rule for group in rule_groups()["groups"] for rule in group["rules"] if "alert" in rule]


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads((MONITORING / "dashboard.json").read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels if p["type"] != "row" for t in p["targets"]]


def _tool(name: str) -> str:
    return require_tool(name)


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    """rules.yaml (the PrometheusRule's spec) next to the shipped unit tests, as promtool wants them."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    shutil.copy(MONITORING / "tests" / "alerts-test.yaml", tmp_path)
    return tmp_path


def test_promtool_check_rules(rules_dir: Path) -> None:
    """The rules are valid Prometheus rules (syntax, PromQL, templates)."""
    result = subprocess.run(
        [_tool("promtool"), "check", "rules", "rules.yaml"],
        cwd=rules_dir, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests(rules_dir: Path) -> None:
    """Each alert fires on a bad series (labels and annotations exact) and not on a healthy one."""
    result = subprocess.run(
        [_tool("promtool"), "test", "rules", "alerts-test.yaml"],
        cwd=rules_dir, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", (MONITORING / "tests" / "alerts-test.yaml").read_text()))
    assert tested == {a["alert"] for a in alerts()}, "every alert has a unit test"


def test_every_alert_has_a_runbook() -> None:
    """Each alert's runbook_url points at a section of docs/runbooks.md named like the alert."""
    text = RUNBOOKS.read_text()
    headings = {line[4:].strip() for line in text.splitlines() if line.startswith("### ")}
    for alert in alerts():
        name = alert["alert"]
        assert name in headings, f"docs/runbooks.md has no '### {name}' section"
        assert alert["annotations"]["runbook_url"].endswith(f"docs/runbooks.md#{name.lower()}")
        assert {"summary", "description"} <= alert["annotations"].keys()
        assert alert["labels"]["severity"] in ("warning", "critical")


def _exported_series() -> set[str]:
    names = set()
    metrics = Metrics()
    for family in metrics.families:
        if family.kind == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    names.add(metrics.connection_metric().name)
    names.add(metrics.inbound_metric().name)
    return names


def test_dashboard_rows() -> None:
    """The dashboard has the rows an operator looks for, each with panels under it."""
    panels = json.loads((MONITORING / "dashboard.json").read_text())["panels"]
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == [
        "Overview", "Per backend", "Connections and load", "Conversions", "Inbound connections",
        "Backend protections",
    ]  # fmt: skip
    queries = " ".join(q for _, q in dashboard_queries())
    for family in ("crd_conversion_webhook", "conversion_webhook_request", "conversion_cache", "inbound_",
                   "backend_circuit_state", "reviews_shed"):  # fmt: skip
        assert "webhook_gateway_" + family in queries, family
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))


def test_rules_and_dashboard_use_only_exported_metrics() -> None:
    """No alert or panel refers to a gateway metric the gateway does not export (a typo never fires)."""
    exported = _exported_series()
    texts = [a["expr"] for a in alerts()] + [q for _, q in dashboard_queries()]
    used = {name for text in texts for name in re.findall(r"\bwebhook_gateway_\w+", text)}
    assert used - exported == set()
    assert len(used) >= 15


def test_metrics_reference_is_generated_from_the_code() -> None:
    """docs/metrics.md is exactly what `python -m gateway.observability.metrics_doc` prints."""
    documented = (ROOT / "docs" / "metrics.md").read_text()
    assert documented == metrics_doc.render(), (
        "docs/metrics.md is stale: python -m gateway.observability.metrics_doc > docs/metrics.md"
    )
    metrics = Metrics()
    for name in [f.name for f in metrics.families] + [metrics.connection_metric().name]:
        assert f"| `{name}` |" in documented, name


# --- a real Prometheus scraping a real gateway ---------------------------------------------------


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:  # loopback only
        return json.load(resp)


async def _wait_http(url: str, what: str, seconds: float = 30.0) -> None:
    with trio.move_on_after(seconds):
        while True:
            try:
                await trio.to_thread.run_sync(lambda: urllib.request.urlopen(url, timeout=2).read())
                return
            except OSError:
                await trio.sleep(0.2)
    raise AssertionError(f"{what} did not come up at {url}")


async def _query(prom: str, expr: str) -> list[Any]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = await trio.to_thread.run_sync(_get_json, url)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@pytest.mark.slow
async def test_prometheus_scrapes_the_gateway_and_every_panel_has_data(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A real Prometheus scrapes a real gateway under load: every panel's query returns data, every rule is healthy."""
    prometheus = _tool("prometheus")
    backend = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    base = f"http://127.0.0.1:{backend.port}"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connect errors
    write_config(
        tmp_path / "config",
        validating={
            "policy": [
                hook("allow.example.com", base + "/allow", timeoutSeconds=2),
                hook("deny.example.com", base + "/deny/403/not%20here", timeoutSeconds=2,
                     objectSelector={"matchLabels": {"app": "denied"}}),
                hook("down.example.com", dead + "/allow", failurePolicy="Ignore", timeoutSeconds=1),
            ]
        },
        mutating={"labels": [hook("label.example.com", base + "/patch/checked", timeoutSeconds=2)]},
    )  # fmt: skip
    # Backend protections: a backend that never answers, behind a circuit breaker that opens at once.
    guarded = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {
            "name": "guarded",
            "annotations": {
                "webhook-gateway.io/backend-policy": '"*": {circuitBreaker: {consecutiveFailures: 2, openSeconds: 60}}'
            },
        },
        "webhooks": [hook("guarded.example.com", dead + "/allow", failurePolicy="Ignore", timeoutSeconds=1)],
    }
    (tmp_path / "config" / "guarded.yaml").write_text(yaml.safe_dump(guarded))
    # Conversions: a CRD whose conversions are cached, and one whose backend fails every conversion.
    failing = "failing.stable.example.com"
    write_crds(
        tmp_path / "config",
        [
            crd(url=base + "/convert", annotations={"webhook-gateway.io/conversion-cache": "true"}),
            crd(failing, url=base + "/convert/fail/no%20way"),
        ],
    )
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "tls.pem"))
    port, metrics_port, prom_port = free_port(), free_port(), free_port()
    gateway = await trio.lowlevel.open_process(
        [sys.executable, "-m", "gateway", "--config", str(tmp_path / "config"),
         "--bind", f"127.0.0.1:{port}", "--metrics-bind", f"127.0.0.1:{metrics_port}",
         "--certfile", str(tmp_path / "tls.pem"), "--keyfile", str(tmp_path / "tls.pem"),
         "--drain-seconds", "0", "--log-level", "error", "--header-read-timeout", "1"],
        cwd=ROOT,
    )  # fmt: skip
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(tmp_path / "rules.yaml")],
                "scrape_configs": [
                    {
                        "job_name": "webhook-gateway",
                        "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
                    }
                ],
            }
        )
    )
    prom = await trio.lowlevel.open_process(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    prom_url = f"http://127.0.0.1:{prom_port}"
    try:
        await _wait_http(f"http://127.0.0.1:{metrics_port}/readyz", "the gateway")
        await _wait_http(f"{prom_url}/-/ready", "Prometheus")
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        client = await connect("127.0.0.1", port, ssl_context=ctx)
        # An inbound connection that never starts its TLS handshake: closed by the head deadline.
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(60):
            for i in range(400):  # a short load, spread over a few scrapes
                if i % 20 == 0:  # the same two objects each time: misses first, then cache hits
                    objects = [crontab("a"), crontab("b")]
                    resp = await send_review(client, f"convert/{CRD}", conversion_review(objects))
                    assert resp.json["response"]["result"]["status"] == "Success", resp.body
                if i % 100 == 0:
                    resp = await send_review(client, f"convert/{failing}", conversion_review([crontab()]))
                    assert resp.json["response"]["result"]["status"] == "Failure", resp.body
                labels = {"app": "denied"} if i % 10 == 0 else {"app": "web"}
                obj = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"p{i}", "namespace": "shop", "labels": labels},
                }
                await send_review(client, "mutate" if i % 2 else "validate", review(obj))
                if i % 40 == 0:
                    await trio.sleep(0.25)
        empty = [title for title, _ in dashboard_queries()]
        with trio.move_on_after(45):
            while empty:
                empty = [title for title, expr in dashboard_queries() if not await _query(prom_url, expr)]
                await trio.sleep(0 if not empty else 1)
        assert empty == []
        with trio.fail_after(5):  # the silent connection was closed (reset: it never finished a handshake)
            with contextlib.suppress(trio.BrokenResourceError):
                assert await silent.receive_some() == b""
        with trio.fail_after(30):
            while True:
                body = await trio.to_thread.run_sync(_get_json, f"{prom_url}/api/v1/rules")
                rules = [r for g in body["data"]["groups"] for r in g["rules"]]
                if len(rules) == len(alerts()) and all(
                    r.get("lastEvaluation", "").startswith("2") for r in rules
                ):
                    break
                await trio.sleep(0.5)
        assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
        # this run's certificate expires in years, every backend is fast: those alerts stay silent
        firing = {r["name"] for r in rules if r["state"] == "firing"}
        assert not firing & {"WebhookGatewayCertificateExpiringSoon", "WebhookGatewayNoReadyReplicas"}
    finally:
        for process in (prom, gateway):
            process.terminate()
        with trio.move_on_after(15):
            await prom.wait()
            await gateway.wait()
        for process in (prom, gateway):
            if process.returncode is None:
                process.kill()


# --- the gauges the alerts need ----------------------------------------------------------------------


async def _scrape(port: int, ctx: ssl.SSLContext) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    client = await connect("127.0.0.1", port, ssl_context=ctx)
    resp = await client.post("/metrics", b"", method="GET")
    await client.aclose()
    assert resp is not None
    out: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
    for family in text_string_to_metric_families(resp.body.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


async def test_certificate_expiry_and_backend_timeouts_follow_reloads(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The expiry gauge is the serving certificate's notAfter, also after rotation; timeouts follow the config."""
    from datetime import UTC, datetime

    from gateway.cli import parse
    from gateway.observability.observer import Observability
    from gateway.server.serve import serve

    ca = trustme.CA()
    first = datetime(2031, 1, 2, tzinfo=UTC)
    ca.issue_cert("localhost", not_after=first).private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "tls.pem")
    )
    config = tmp_path / "config"
    write_config(
        config, validating={"v": [hook("a.example.com", "https://a.example.com/v", timeoutSeconds=4)]}
    )
    options = parse(
        ["--config", str(config), "--bind", "127.0.0.1:0", "--drain-seconds", "0", "--config-poll-seconds", "0.1",
         "--certfile", str(tmp_path / "tls.pem"), "--keyfile", str(tmp_path / "tls.pem")]
    ).options  # fmt: skip
    running = await nursery.start(
        lambda task_status: serve(
            options, observer=Observability(metrics=True), handle_signals=False, task_status=task_status
        )
    )
    port = int(running.urls[0].rsplit(":", 1)[1])
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    expiry = "webhook_gateway_serving_certificate_expiry_timestamp_seconds"
    timeouts = "webhook_gateway_backend_timeout_seconds"
    scraped = await _scrape(port, ctx)
    assert scraped[expiry] == {frozenset(): first.timestamp()}
    assert scraped[timeouts] == {frozenset({("name", "a.example.com"), ("type", "validating")}): 4.0}

    second = datetime(2032, 3, 4, tzinfo=UTC)
    ca.issue_cert("localhost", not_after=second).private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "tls.pem")
    )
    write_config(config, mutating={"m": [hook("b.example.com", "https://b.example.com/m", timeoutSeconds=7)]})
    reloaded = {frozenset({("name", "b.example.com"), ("type", "admit")}): 7.0}
    with trio.fail_after(20):  # the certificate and the configuration reload independently
        while True:
            scraped = await _scrape(port, ctx)
            if scraped[expiry] == {frozenset(): second.timestamp()} and scraped.get(timeouts) == reloaded:
                break
            await trio.sleep(0.1)
    assert scraped[timeouts] == reloaded
    running.shutdown()
