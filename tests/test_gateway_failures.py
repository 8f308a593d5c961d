"""Failure policy, timeouts, call errors and their messages, end to end (spec §7 FPT-*, §8 ERR-*, REV-08..14)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.gateway import Expect, backend, run_scenario

CALLERS = [pytest.param("v1", id="v1 caller"), pytest.param("v1beta1", id="v1beta1 caller")]
FAILED = 'Internal error occurred: failed calling webhook "b.example.com": '


def fail(path: str, **fields: Any) -> dict[str, list[dict[str, Any]]]:
    return {"a": [backend("b.example.com", path, failurePolicy="Fail", **fields)]}


CALL_ERRORS: list[Any] = [
    pytest.param(
        fail("/status/404"),
        FAILED + "failed to call webhook: the server could not find the requested resource",
        500,
        id="ERR-07: HTTP 404 becomes the generic not-found cause",
    ),
    pytest.param(
        fail("/status/500/kaboom"),
        FAILED + 'failed to call webhook: an error on the server ("kaboom") '
        "has prevented the request from succeeding",
        500,
        id="ERR-07: HTTP 500 quotes the server's text body",
    ),
    pytest.param(
        fail("/status/429"),
        FAILED + "failed to call webhook: the server has received too many "
        "requests and has asked us to try again later",
        500,
        id="ERR-07: HTTP 429",
    ),
    pytest.param(
        fail("/redirect"),
        FAILED + "failed to call webhook: the server responded with the status code "
        "307 but did not return more information",
        500,
        id="FPT-11: a redirect is not followed and is a call error",
    ),
    pytest.param(
        fail("/wrong-uid"),
        FAILED + 'received invalid webhook response: expected response.uid="',
        500,
        id="REV-12: a v1 reply with another uid is a call error",
    ),
    pytest.param(
        fail("/no-response"),
        FAILED + "received invalid webhook response: webhook response was absent",
        500,
        id="REV-12: a reply without response is a call error",
    ),
    pytest.param(
        fail("/empty-body"),
        FAILED + "failed to call webhook: ",
        500,
        id="REV-08: an empty body is undecodable",
    ),
    pytest.param(
        fail("/close"),
        FAILED + 'failed to call webhook: Post "http://127.0.0.1:',
        500,
        id="ERR-06: a connection closed without answer is a transport error naming the URL",
    ),
    pytest.param(
        fail("/sleep/3000/allow", timeoutSeconds=1),
        FAILED + 'failed to call webhook: Post "http://',
        500,
        id="FPT-05: timeoutSeconds bounds the call and the cause is context deadline exceeded",
    ),
]


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("validating", "prefix", "code"), CALL_ERRORS)
async def test_call_errors_fail_closed(
    nursery: trio.Nursery, tmp_path: Path, caller: str, validating: Any, prefix: str, code: int
) -> None:
    """Each kind of call error denies under Fail with ERR-02's 500 naming the backend and the cause."""
    outcome = await run_scenario(nursery, tmp_path, validating=validating, caller_version=caller)
    Expect(allowed=False, code=code, reason="InternalError", message_prefix=prefix).check(outcome)
    causes = outcome.status["details"]["causes"]
    assert causes == [{"message": outcome.message.removeprefix("Internal error occurred: ")}]


async def test_timeout_message_and_budget(nursery: trio.Nursery, tmp_path: Path) -> None:
    """FPT-05/06, ERR-06: a 1 s timeout answers in about 1 s with the exact URL and cause."""
    outcome = await run_scenario(nursery, tmp_path, validating=fail("/sleep/5000/allow", timeoutSeconds=1))
    port = outcome.backend.port
    assert outcome.message == (
        FAILED + f'failed to call webhook: Post "http://127.0.0.1:{port}/sleep/5000/allow?timeout=1s": '
        "context deadline exceeded"
    )
    assert 0.9 <= outcome.elapsed < 2.0


async def test_caller_timeout_sets_the_gateway_deadline(nursery: trio.Nursery, tmp_path: Path) -> None:
    """FPT-07/08: with ?timeout=1s the gateway answers before the caller gives up, failing the slow backend."""
    outcome = await run_scenario(nursery, tmp_path, validating=fail("/sleep/5000/allow"), timeout="1s")
    assert outcome.message.endswith("context deadline exceeded")
    assert outcome.elapsed < 1.0


async def test_timeout_query_sent_to_backend(nursery: trio.Nursery, tmp_path: Path) -> None:
    """FPT-06/TRN-04: the backend URL carries ?timeout= with its whole-second limit and nothing else."""
    outcome = await run_scenario(nursery, tmp_path, validating=fail("/allow", timeoutSeconds=7))
    (call,) = outcome.calls
    assert call.path == "/allow?timeout=7s"


async def test_no_retries(nursery: trio.Nursery, tmp_path: Path) -> None:
    """FPT-10: a failed call is not repeated."""
    outcome = await run_scenario(nursery, tmp_path, validating=fail("/status/503"))
    assert len(outcome.calls) == 1


async def test_connection_refused(nursery: trio.Nursery, tmp_path: Path) -> None:
    """ERR-06: an unreachable backend fails with its URL and `connection refused`."""
    hooks = {"a": [backend("b.example.com", "/allow")]}
    hooks["a"][0]["clientConfig"] = {"url": "http://127.0.0.1:9/validate"}
    outcome = await run_scenario(nursery, tmp_path, validating=hooks)
    assert outcome.message.startswith(
        FAILED + 'failed to call webhook: Post "http://127.0.0.1:9/validate?timeout=5s": '
    )
    assert "connection refused" in outcome.message


async def test_version_negotiated_per_backend(nursery: trio.Nursery, tmp_path: Path) -> None:
    """REV-03/04, GW-13: each backend gets the first version it lists; the object is never converted."""
    hooks = {
        "a": [
            backend("old.example.com", "/only-v1beta1/allow", admissionReviewVersions=["v1beta1", "v1"]),
            backend("new.example.com", "/allow", admissionReviewVersions=["v2", "v1"]),
        ]
    }
    outcome = await run_scenario(nursery, tmp_path, validating=hooks, caller_version="v1beta1")
    assert outcome.allowed
    versions = sorted(c.review["apiVersion"] for c in outcome.calls)
    assert versions == ["admission.k8s.io/v1", "admission.k8s.io/v1beta1"]
    for call in outcome.calls:
        assert call.review["request"]["kind"] == outcome.sent["request"]["kind"]
        assert call.review["request"]["object"] == outcome.sent["request"]["object"]
