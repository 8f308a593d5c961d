"""``webhook-gateway demo``: the whole path on one machine in a few seconds.

Starts the sample backend webhooks described in the bundled configuration on a free port (the
configuration's ``127.0.0.1:18081`` URLs are pointed there), starts the gateway on a free port,
sends a handful of AdmissionReviews as kube-apiserver would,
and prints each decision: allowed, denied (naming the denying backend), mutated (showing the
combined patch), a slow backend failing open, an unavailable one failing closed, and one CRD
conversion (a CronTab from v1 to v2 through ``POST /convert/<crd name>``).
"""

from __future__ import annotations

import base64
import json
import sys
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import trio

from gateway.settings import LogFormat

DEMO_BACKEND_ADDRESS = "127.0.0.1:18081"  # what the bundled configuration's URLs name


@dataclass(frozen=True, slots=True)
class DemoSettings:
    config: str | None = None  # None: the bundled demo configuration
    log_format: LogFormat = "console"
    write_samples: str | None = None  # write the samples into this directory instead of running


def demo_config_dir() -> Path:
    return Path(str(resources.files("gateway") / "data" / "demo"))


def samples_dir() -> Path:
    return Path(str(resources.files("gateway") / "data" / "samples"))


# What the closing hint and docs/getting-started.md run, in a directory `--write-samples DIR` filled.
def hint(directory: str) -> str:
    return "\n".join(
        [
            "Try it yourself (the same configuration, your own gateway):",
            f"  webhook-gateway demo --write-samples {directory}",
            "  python -m gateway.devtools.backends --port 18081 &",
            f"  webhook-gateway --config {directory}/config --bind 127.0.0.1:8443 --workers 1",
            f"  webhook-gateway explain --config {directory}/config {directory}/pod.yaml",
        ]
    )


def write_samples(target: Path) -> list[Path]:
    """The demo's configuration (``config/``, naming the sample backends on 127.0.0.1:18081) and the
    example objects and review the docs use; the files written."""
    written = []
    (target / "config").mkdir(parents=True, exist_ok=True)
    for source, into in ((demo_config_dir(), target / "config"), (samples_dir(), target)):
        for file in sorted(source.iterdir()):
            if file.suffix in (".yaml", ".yml", ".json") and file.is_file():
                (into / file.name).write_text(file.read_text())
                written.append(into / file.name)
    return written


def point_config_at(source: Path, target: Path, port: int) -> None:
    """Copy the demo configuration files, pointing ``127.0.0.1:18081`` URLs at the backends' real port."""
    for file in sorted(source.iterdir()):
        if file.suffix in (".yaml", ".yml", ".json") and file.is_file():
            text = file.read_text().replace(DEMO_BACKEND_ADDRESS, f"127.0.0.1:{port}")
            (target / file.name).write_text(text)


def _pod(
    name: str, labels: dict[str, str], image: str = "registry.example.com/shop/web:1.4.2"
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "shop", "labels": labels},
        "spec": {"containers": [{"name": "app", "image": image}]},
    }


def _review(obj: dict[str, Any], version: str = "v1") -> dict[str, Any]:
    return {
        "apiVersion": f"admission.k8s.io/{version}",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": obj["metadata"]["name"],
            "namespace": "shop",
            "operation": "CREATE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
        },
    }


# (title, endpoint, object, allowed as the bundled configuration decides it)
STEPS: list[tuple[str, str, dict[str, Any], bool]] = [
    ("an ordinary Pod", "validate", _pod("web", {"app": "web"}), True),
    (
        "a Pod from an untrusted registry",
        "validate",
        _pod("evil", {"app": "evil", "demo/image": "untrusted"}, image="evil.example.com/miner:latest"),
        False,
    ),
    ("the same ordinary Pod, mutating", "mutate", _pod("web", {"app": "web"}), True),
    (
        "a Pod audited by a slow backend (Ignore, 1 s timeout)",
        "validate",
        _pod("audited", {"app": "web", "demo/audit": "slow"}),
        True,
    ),
    (
        "a Pod that needs the (unavailable) quota service (Fail)",
        "validate",
        _pod("budget", {"app": "web", "demo/quota": "check"}),
        False,
    ),
]

BOLD, GREEN, RED, DIM, RESET = "\033[1m", "\033[32m", "\033[31m", "\033[2m", "\033[0m"


def _paint(text: str, color: str, enabled: bool) -> str:
    return f"{color}{text}{RESET}" if enabled else text


def describe(step: int, title: str, endpoint: str, reply: dict[str, Any], *, ms: float, color: bool) -> str:
    """One decision, readably."""
    resp = reply["response"]
    lines = [_paint(f"{step}. {title}", BOLD, color) + _paint(f"  POST /{endpoint}  {ms:.1f} ms", DIM, color)]
    if resp.get("allowed"):
        lines.append("   " + _paint("ALLOWED", GREEN, color))
    else:
        st = resp.get("status", {})
        lines.append("   " + _paint(f"DENIED {st.get('code')} {st.get('reason', '')}", RED, color))
        lines.append(f"   {st.get('message', '')}")
    if "patch" in resp:
        patch = json.loads(base64.b64decode(resp["patch"]))
        lines.append(f"   combined patch ({resp.get('patchType')}):")
        lines.extend(f"     {json.dumps(op)}" for op in patch)
    for warning in resp.get("warnings", []):
        lines.append(f"   warning: {warning}")
    for key, value in sorted(resp.get("auditAnnotations", {}).items()):
        lines.append(_paint(f"   audit annotation {key} = {value}", DIM, color))
    return "\n".join(lines)


async def _run(options: DemoSettings, workdir: Path) -> int:
    from gateway.config.model import ClientConfig
    from gateway.devtools.backends import serve_backend
    from gateway.server.serve import serve
    from gateway.settings import ServeSettings
    from gateway.transport.pool import ClientPool
    from gateway.transport.resolve import resolve_target

    shown_config = options.config or str(demo_config_dir())
    color = sys.stdout.isatty()
    async with trio.open_nursery() as nursery:
        backends = await nursery.start(lambda task_status: serve_backend(port=0, task_status=task_status))
        point_config_at(Path(shown_config), workdir, backends.port)
        gateway_options = ServeSettings(
            config=str(workdir),
            bind="127.0.0.1:0",
            drain_seconds=0,
            log_level="warning",
            log_format=options.log_format,
        )
        running = await nursery.start(
            lambda task_status: serve(gateway_options, handle_signals=False, task_status=task_status)
        )
        base = running.urls[0]
        print(_paint("webhook-gateway demo", BOLD, color))
        print(f"  gateway:          {base}  (config: {shown_config})")
        print(f"  sample backends:  http://127.0.0.1:{backends.port}  (gateway/devtools/backends.py)\n")
        unexpected: list[str] = []
        async with ClientPool() as pool:
            for i, (title, endpoint, obj, expected) in enumerate(STEPS, start=1):
                target = resolve_target(ClientConfig(url=f"{base}/{endpoint}"), None)
                body = json.dumps(_review(obj)).encode()
                started = trio.current_time()
                resp = await pool.post(target, body=body, timeout_seconds=10)
                ms = (trio.current_time() - started) * 1000
                reply = json.loads(resp.body)
                print(describe(i, title, endpoint, reply, ms=ms, color=color) + "\n")
                if bool(reply.get("response", {}).get("allowed")) != expected:
                    unexpected.append(f"step {i} ({title}) was {'allowed' if not expected else 'denied'}")
            text, converted = await _conversion_step(pool, base, len(STEPS) + 1, color=color)
            print(text + "\n")
            if not converted:
                unexpected.append(f"step {len(STEPS) + 1} (the CronTab conversion) failed")
        print(hint("samples"))
        running.shutdown()
        nursery.cancel_scope.cancel()
    if unexpected and options.config is None:  # the bundled configuration decides every step
        print(f"demo: unexpected: {'; '.join(unexpected)}", file=sys.stderr)
        return 1
    return 0


async def _conversion_step(pool: Any, base: str, step: int, *, color: bool) -> tuple[str, bool]:
    """A CronTab v1 -> v2 conversion through the gateway (the sample CRD in ``crd.yaml``)."""
    from gateway.config.model import ClientConfig
    from gateway.transport.resolve import resolve_target

    crontab = {
        "apiVersion": "stable.example.com/v1",
        "kind": "CronTab",
        "metadata": {"name": "nightly", "namespace": "shop", "uid": str(uuid.uuid4())},
        "spec": {"cronSpec": "0 1 * * *"},
    }
    review = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "desiredAPIVersion": "stable.example.com/v2",
            "objects": [crontab],
        },
    }
    target = resolve_target(ClientConfig(url=f"{base}/convert/crontabs.stable.example.com"), None)
    started = trio.current_time()
    resp = await pool.post(target, body=json.dumps(review).encode(), timeout_seconds=10)
    ms = (trio.current_time() - started) * 1000
    path = "POST /convert/crontabs.stable.example.com"
    lines = [
        _paint(f"{step}. a CronTab converted from v1 to v2", BOLD, color)
        + _paint(f"  {path}  {ms:.1f} ms", DIM, color)
    ]
    response = json.loads(resp.body).get("response", {})
    result = response.get("result", {})
    converted = result.get("status") == "Success"
    if converted:
        lines.append("   " + _paint("CONVERTED", GREEN, color))
        lines.extend(
            f"   {json.dumps(o['spec'])} as {o['apiVersion']}" for o in response.get("convertedObjects", [])
        )
    else:
        lines.append("   " + _paint("CONVERSION FAILED", RED, color) + f" {result.get('message', '')}")
    return "\n".join(lines), converted


def run_demo(options: DemoSettings) -> int:
    import tempfile

    from gateway.observability import configure_logging

    if options.write_samples:
        target = Path(options.write_samples)
        for path in write_samples(target):
            print(path)
        return 0
    configure_logging("warning", options.log_format)
    with tempfile.TemporaryDirectory(prefix="webhook-gateway-demo-") as workdir:
        return trio.run(_run, options, Path(workdir))
