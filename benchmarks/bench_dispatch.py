"""The gateway's own CPU per review between ``Dispatcher.validate``/``mutate`` and the HTTP/2 request.

A script, not a test::

    python benchmarks/bench_dispatch.py                 # every scenario, CPU µs per review
    python benchmarks/bench_dispatch.py --profile validating5   # cProfile top list of one scenario
    python benchmarks/bench_dispatch.py --tree /path/to/other/checkout   # the same against another tree

What runs is what the server runs per review after decoding it: a real ``Snapshot`` loaded from YAML,
the real ``Dispatcher`` with the server's backend policy (``GuardedBackends``), ``BackendCaller``,
``Targets`` and ``ClientPool``, and the review's trace context. Only the HTTP/2 connection is a stub
(``_StubH2``): the pool finds one ready connection per backend origin, and its ``request`` answers
at once (after one schedule point, as a real stream waits for its reply) with the reply a backend
would send: an allow echoing the request's uid, or for the mutating chain a JSON Patch adding one
label. So the numbers are the gateway's own per-review and per-call cost, without sockets, TLS,
HPACK or h2's state machine (``gateway/transport/http2.py``, measured elsewhere).

``shed1`` and ``shed10`` decide a review the overload shedder refuses (``Dispatcher.decide_shed``,
each backend under ``Ignore``): what a shed review's decision costs, every call refused before it
is made.

Each scenario: ``--reviews`` reviews in one trio run, repeated ``--repeats`` times; the CPU time
(``time.process_time``) per review of the best and the median repeat is printed.
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import gc
import io
import json
import math
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
POD = ROOT / "loadtests" / "fixtures" / "pod.json"

SCENARIOS = {
    "validating1": ("validating", 1),
    "validating5": ("validating", 5),
    "mutating3": ("mutating", 3),
    # A review the overload shedder refuses (``Dispatcher.decide_shed``, what the server's read path
    # asks before it starts anything for the review): every call refused, each backend under Ignore.
    "shed1": ("validating", 1),
    "shed10": ("validating", 10),
}


def config_yaml(kind: str, count: int, failure_policy: str = "Fail") -> str:
    """One configuration of ``count`` backends on loopback HTTPS (HTTP/2 allowed), as loadtests writes
    it (``loadtests/scenarios.py``), each backend on its own origin."""
    webhooks = []
    for i in range(count):
        hook: dict[str, Any] = {
            "name": f"{kind[0]}{i:02d}.bench.webhook-gateway.dev",
            "clientConfig": {"url": f"https://127.0.0.1:{9440 + i}/{kind}/{i}"},
            "rules": [
                {
                    "operations": ["CREATE", "UPDATE"],
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["pods"],
                    "scope": "Namespaced",
                }
            ],
            "failurePolicy": failure_policy,
            "matchPolicy": "Exact",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 10,
        }
        if kind == "mutating":
            hook["reinvocationPolicy"] = "Never"
        webhooks.append(hook)
    doc = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": f"{kind.capitalize()}WebhookConfiguration",
        "metadata": {"name": f"bench-{kind}"},
        "webhooks": webhooks,
    }
    return yaml.safe_dump(doc, sort_keys=False)


def inbound_body() -> bytes:
    pod = json.loads(POD.read_text())
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "web-1",
            "namespace": pod["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "uid": "5d1b3c52",
                "groups": ["system:serviceaccounts", "system:authenticated"],
            },
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }
    return json.dumps(review, separators=(",", ":")).encode()


_UID_AT = b'"request":{"uid":"'


def reply_for(body: bytes, patch: bytes | None) -> bytes:
    """A backend's v1 reply to ``body``: allowed, the request's uid echoed, optionally a JSON Patch."""
    start = body.index(_UID_AT) + len(_UID_AT)
    uid = body[start : body.index(b'"', start)]
    tail = b"}}" if patch is None else b',"patchType":"JSONPatch","patch":"' + patch + b'"}}'
    return (
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"'
        + uid
        + b'","allowed":true'
        + tail
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "scenarios", nargs="*", metavar="SCENARIO", help=f"any of {', '.join(SCENARIOS)} (default: all)"
    )
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose gateway package runs")
    parser.add_argument("--reviews", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile one repeat; print the top list")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--sort", default="tottime")
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    sys.path.insert(0, str(args.tree.resolve()))  # before the first import of gateway
    import trio

    import gateway

    print(f"gateway from {Path(gateway.__file__).parent}", file=sys.stderr)
    for name in args.scenarios or list(SCENARIOS):
        results = trio.run(bench, name, args)
        print(
            f"{name:12} best {min(results):7.1f} µs  median {statistics.median(results):7.1f} µs"
            f"  per review ({args.reviews} reviews x {len(results)})"
        )


async def bench(name: str, args: argparse.Namespace) -> list[float]:
    """CPU µs per review of each repeat of scenario ``name``."""
    import trio

    from gateway.config.load import load_directory
    from gateway.dispatch.engine import Dispatcher
    from gateway.dispatch.outcome import DispatchSettings
    from gateway.dispatch.policy import GuardedBackends
    from gateway.resilience import BackendGuards
    from gateway.review import decode_inbound
    from gateway.review.view import InboundReview
    from gateway.tracing import start_review_trace
    from gateway.transport.caller import BackendCaller
    from gateway.transport.http2 import HTTP2Connection
    from gateway.transport.pool import ClientPool, _OriginConnections
    from gateway.transport.wire import HTTPResponse

    class _StubH2(HTTP2Connection):
        """A ready HTTP/2 connection whose every request is answered at once."""

        def __init__(self, label: str, patch: bytes | None) -> None:  # no super(): no h2 state machine
            self.label = label
            self.patch = patch
            self.reserved = 0
            self.requests = 0
            self.goaway = False
            self.closed = False
            self.idle_since = 0.0

        @property
        def ready(self) -> bool:
            return True

        def can_open_stream(self) -> bool:
            return self.reserved < 100

        def close_gracefully(self) -> None:
            pass

        def abort(self) -> None:
            pass

        async def request(
            self, headers: Any, body: bytes, *, max_response_bytes: int, deadline: float = math.inf
        ) -> HTTPResponse:
            self.requests += 1
            await trio.lowlevel.checkpoint()  # a real stream waits for its reply
            reply = reply_for(body, self.patch)
            return HTTPResponse(200, [(b"content-type", b"application/json")], reply, "HTTP/2")

    decoded = decode_inbound(inbound_body())
    labels = {"kubernetes.io/metadata.name": decoded.attributes.namespace}

    class _Namespaces:
        async def labels(self, name: str) -> dict[str, str]:
            return labels

        def labels_now(self, name: str) -> dict[str, str]:
            return labels

    kind, count = SCENARIOS[name]
    with tempfile.TemporaryDirectory() as config_dir:  # loaded as the server loads --config
        shed = name.startswith("shed")
        policy = "Ignore" if shed else "Fail"
        (Path(config_dir) / "webhooks.yaml").write_text(config_yaml(kind, count, policy))
        snapshot = load_directory(config_dir)
    hooks = snapshot.validating if kind == "validating" else snapshot.mutating
    assert len(hooks) == count
    results: list[float] = []
    async with ClientPool() as pool:
        caller = BackendCaller(pool, None)
        caller.prepare(snapshot)
        stubs = []
        for i, hook in enumerate(hooks):  # one ready stub connection per backend origin
            target = caller._targets.get(hook.client_config)
            group = pool._origins.setdefault(target.origin, _OriginConnections(target.origin))
            patch = None
            if kind == "mutating":
                ops = [{"op": "add", "path": f"/metadata/labels/bench-m{i}", "value": "true"}]
                patch = base64.b64encode(json.dumps(ops).encode())
            stubs.append(_StubH2(group.label, patch))
            group.h2.append(stubs[-1])
        guards = BackendGuards(trio.current_time)
        guards.reconcile(hooks)
        dispatcher = Dispatcher(caller, _Namespaces(), DispatchSettings(), policy=GuardedBackends(guards))
        run_one = dispatcher.validate if kind == "validating" else dispatcher.mutate

        async def one() -> Any:
            start_review_trace("")  # as the server does per review
            # a fresh view per review: its backend-request template is built once per review
            inbound = InboundReview(
                api_version=decoded.api_version, request=decoded.request, attributes=decoded.attributes
            )
            if shed:
                return dispatcher.decide_shed(  # the shed scenarios are validating
                    "validating", inbound, snapshot, deadline=trio.current_time() + 10, shed="event_loop_lag"
                )
            return await run_one(inbound, snapshot, deadline=trio.current_time() + 10)

        verdict = await one()
        assert verdict.allowed, verdict
        assert len(verdict.report.invocations) == count, verdict.report
        if shed:  # every call refused before it was made: nothing reached a connection
            assert all(stub.requests == 0 for stub in stubs), "a shed call was made"
        if kind == "mutating":
            assert verdict.patch is not None
            assert verdict.patch.count(b'"op"') == count, verdict.patch
        for _ in range(200):  # warm up
            await one()
        for _ in range(1 if args.profile else args.repeats):
            gc.collect()
            profiler = cProfile.Profile() if args.profile else None
            started = time.process_time()
            if profiler is not None:
                profiler.enable()
            for _ in range(args.reviews):
                await one()
            if profiler is not None:
                profiler.disable()
            results.append((time.process_time() - started) / args.reviews * 1e6)
            if profiler is not None:
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(args.sort).print_stats(args.top)
                print(out.getvalue())
    return results


if __name__ == "__main__":
    main()
