"""Scenarios: which backends exist, how the gateway is configured for them, and what every answer
must be. Each scenario is one command (``python -m loadtests <name>``)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import yaml

from loadtests.fixtures import SLOW_LABEL

Kind = Literal["validating", "mutating"]
DOMAIN = "loadtest.webhook-gateway.dev"


@dataclass(frozen=True)
class BackendSpec:
    """One backend webhook of a scenario."""

    name: str
    kind: Kind
    behaviour: str  # the backend server path tail: "allow", "deny", "patch/<label>"
    failure_policy: str = "Fail"
    timeout_seconds: int = 10
    slow_only: bool = False  # objectSelector: only reviews of class "slow" match
    dead: bool = False  # nothing listens at its URL
    delay_ms: float | None = None  # its own fixed delay, replacing the run's latency distribution
    mode: str = "Enforce"  # Shadow: called, never used (its answer is not expected)

    @property
    def label(self) -> str | None:
        return self.behaviour.split("/", 1)[1] if self.behaviour.startswith("patch/") else None

    def times_out(self) -> bool:
        return self.delay_ms is not None and self.delay_ms >= self.timeout_seconds * 1000


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    backends: tuple[BackendSpec, ...]
    slow_fraction: float = 0.0
    backend_policy: str = ""  # the webhook-gateway.io/backend-policy annotation of every configuration

    @property
    def validating(self) -> tuple[BackendSpec, ...]:
        return tuple(b for b in self.backends if b.kind == "validating")

    @property
    def mutating(self) -> tuple[BackendSpec, ...]:
        return tuple(b for b in self.backends if b.kind == "mutating")

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Gateway endpoints one review goes through, in the apiserver's order (mutate, then validate)."""
        if not self.backends:
            return ("validate",)
        return tuple(e for e, hooks in (("mutate", self.mutating), ("validate", self.validating)) if hooks)

    @property
    def direct_backend(self) -> BackendSpec:
        """The backend the direct baseline calls: the first live, non-slow one (an allow one when none)."""
        for b in self.backends:
            if not b.dead and not b.slow_only:
                return b
        return BackendSpec("direct." + DOMAIN, "validating", "allow")


def _validating(n: int, **kw: object) -> list[BackendSpec]:
    return [BackendSpec(f"v{i:02d}.{DOMAIN}", "validating", "allow", **kw) for i in range(n)]  # type: ignore[arg-type]


def _mutating(n: int) -> list[BackendSpec]:
    return [BackendSpec(f"m{i:02d}.{DOMAIN}", "mutating", f"patch/loadtest-m{i}") for i in range(n)]


SCENARIOS: dict[str, str] = {
    "passthrough": "one validating backend",
    "fanout5": "5 validating backends in parallel",
    "fanout20": "20 validating backends in parallel",
    "mutating3": "a chain of 3 mutating backends (each adds a label)",
    "mixed": "production-like: 3 mutating then 5 validating backends",
    "slow-ignore": "4 fast validating backends + 1 slow one (Ignore, times out) seeing a share of reviews",
    "dead-fail": "one live validating backend + one dead backend under Fail (every review denied)",
    "none": "one validating backend that matches nothing (the server's own floor)",
    "backend-down": "1 live validating backend + 1 stalled one (timeout 2s, Ignore) behind a circuit breaker",
    "backend-down-off": "backend-down without the circuit breaker: every review waits for the stalled one",
    "shadow": "1 live validating backend + 1 new one in Shadow mode that denies after 100 ms",
    "shadow-off": "shadow with the new backend enforcing: every review waits for it and is denied",
}


def build(
    name: str, *, backends: int | None = None, slow_fraction: float = 0.05, slow_ms: float = 1500
) -> Scenario:
    """The scenario ``name``; ``backends`` overrides the validating count where it is the point."""
    desc = SCENARIOS[name]
    if name == "passthrough":
        hooks = _validating(backends or 1)
    elif name in ("fanout5", "fanout20"):
        hooks = _validating(backends or int(name.removeprefix("fanout")))
    elif name == "mutating3":
        hooks = _mutating(backends or 3)
    elif name == "mixed":
        hooks = _mutating(3) + _validating(backends or 5)
    elif name == "slow-ignore":
        slow = BackendSpec(
            f"slow.{DOMAIN}",
            "validating",
            "allow",
            failure_policy="Ignore",
            timeout_seconds=1,
            slow_only=True,
            delay_ms=slow_ms,
        )
        hooks = [*_validating(backends or 4), slow]
        return Scenario(name, desc, tuple(hooks), slow_fraction=slow_fraction)
    elif name == "dead-fail":
        hooks = [*_validating(backends or 1), BackendSpec(f"dead.{DOMAIN}", "validating", "allow", dead=True)]
    elif name == "none":
        hooks = [replace(b, name=f"nomatch.{DOMAIN}") for b in _validating(1)]
        return Scenario(name, desc, tuple(hooks))
    elif name in ("backend-down", "backend-down-off"):
        stalled = BackendSpec(
            f"stalled.{DOMAIN}",
            "validating",
            "allow",
            failure_policy="Ignore",
            timeout_seconds=2,
            delay_ms=30_000,
        )
        policy = (
            ""
            if name.endswith("-off")
            else '"*": {circuitBreaker: {consecutiveFailures: 5, openSeconds: 10}}'
        )
        return Scenario(name, desc, (*_validating(backends or 1), stalled), backend_policy=policy)
    elif name in ("shadow", "shadow-off"):
        off = name.endswith("-off")
        new = BackendSpec(
            f"new-check.{DOMAIN}",
            "validating",
            "deny",
            timeout_seconds=2,
            delay_ms=100,
            mode="Enforce" if off else "Shadow",
        )
        policy = "" if off else f"{new.name}: {{mode: Shadow}}"
        return Scenario(name, desc, (*_validating(backends or 1), new), backend_policy=policy)
    else:  # pragma: no cover - argparse restricts the choices
        raise ValueError(name)
    return Scenario(name, desc, tuple(hooks))


def overload(backends: int) -> Scenario:
    """``python -m loadtests overload``: validating backends answering in 20 ms under Ignore, so a
    review shed for overload (allowed, with the fail-open annotations) is a correct answer."""
    busy = [
        BackendSpec(f"busy{i}.{DOMAIN}", "validating", "allow", failure_policy="Ignore", delay_ms=20)
        for i in range(backends)
    ]
    return Scenario("overload", f"{backends} validating backends (20 ms, Ignore)", tuple(busy))


def backend_path(spec: BackendSpec, latency: str, error_rate: float) -> str:
    """The backend server path for ``spec`` under the run's latency and error-rate options."""
    steps: list[str] = []
    if spec.delay_ms is not None:
        steps.append(f"sleep/{spec.delay_ms:g}")
    elif latency:
        steps.append(latency)
    if error_rate > 0 and not spec.dead:
        steps.append(f"errors/{error_rate:g}")
    steps.append(spec.behaviour)
    return "/" + "/".join(steps)


def write_configs(
    scenario: Scenario, urls: dict[str, str], ca_pem: bytes | None, directory: Path
) -> list[Path]:
    """Write one Validating- and/or MutatingWebhookConfiguration YAML for ``scenario`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for kind, hooks in (("Validating", scenario.validating), ("Mutating", scenario.mutating)):
        if not hooks:
            continue
        webhooks = []
        for spec in hooks:
            client_config: dict[str, str] = {"url": urls[spec.name]}
            if ca_pem and urls[spec.name].startswith("https:"):
                client_config["caBundle"] = base64.b64encode(ca_pem).decode()
            resources = ["configmaps"] if scenario.name == "none" else ["pods"]
            hook: dict[str, object] = {
                "name": spec.name,
                "clientConfig": client_config,
                "rules": [
                    {
                        "operations": ["CREATE", "UPDATE"],
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": resources,
                        "scope": "Namespaced",
                    }
                ],
                "failurePolicy": spec.failure_policy,
                "matchPolicy": "Exact",  # rules name exact versions; no MAT-10 warning
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": spec.timeout_seconds,
            }
            if spec.slow_only:
                hook["objectSelector"] = {"matchLabels": {SLOW_LABEL: "true"}}
            if kind == "Mutating":
                hook["reinvocationPolicy"] = "Never"
            webhooks.append(hook)
        doc = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": f"{kind}WebhookConfiguration",
            "metadata": {"name": f"loadtest-{scenario.name}-{kind.lower()}"},
            "webhooks": webhooks,
        }
        if scenario.backend_policy:
            doc["metadata"]["annotations"] = {"webhook-gateway.io/backend-policy": scenario.backend_policy}  # type: ignore[index]
        path = directory / f"{kind.lower()}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        written.append(path)
    return written


@dataclass(frozen=True)
class Expectation:
    """What a correct answer to one call looks like."""

    allowed: bool
    labels: tuple[str, ...] = ()  # labels the combined patch must add (mutating endpoint)
    message_contains: str = ""  # a denial's status.message must contain this
    via_gateway: bool = True  # False: the reply comes straight from a backend (direct baseline)


def expect_gateway(scenario: Scenario, endpoint: str, cls: str) -> Expectation:
    """The gateway's answer for a review of class ``cls`` at ``endpoint`` ("validate"/"mutate")."""
    if scenario.name == "none":
        return Expectation(allowed=True)
    hooks = scenario.mutating if endpoint == "mutate" else scenario.validating
    labels: list[str] = []
    for spec in hooks:
        if spec.slow_only and cls != "slow":
            continue
        if spec.mode == "Shadow":  # its answer never reaches the caller
            continue
        fails = spec.dead or spec.times_out()
        if fails and spec.failure_policy == "Fail":
            return Expectation(allowed=False, message_contains=f'failed calling webhook "{spec.name}"')
        if fails:
            continue
        if spec.behaviour == "deny":
            return Expectation(
                allowed=False, message_contains=f'admission webhook "{spec.name}" denied the request'
            )
        if spec.label:
            labels.append(spec.label)
    return Expectation(allowed=True, labels=tuple(labels))


def expect_direct(spec: BackendSpec) -> Expectation:
    """A backend's own answer (direct baseline)."""
    if spec.behaviour == "deny":
        return Expectation(allowed=False, via_gateway=False)
    return Expectation(allowed=True, labels=(spec.label,) if spec.label else (), via_gateway=False)
