"""A review the overload gate sheds is answered where it is read, with the answer it would get anyway.

Real sockets: the gateway in-process, a sample backend. One review is held in flight on a slow
backend with ``--shed-max-in-flight 1``, so that every other review is shed while it lasts. Each
shed review is sent twice: over HTTP/1.1 as kube-apiserver sends it (a plain request, its body
with its head: answered at once by ``GatewayApp.answer_at_once``, no task, no ASGI request) and
over HTTP/2 (the ASGI path, which shed reviews took before). The two answers must be the same,
field for field, and only the first may be counted in ``GatewayApp.answered_at_once``.
Nothing here is timed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from gateway.cli import parse
from gateway.devtools.backends import BackendServer, serve_backend
from gateway.observability import Observability
from gateway.server.serve import Running, serve
from tests.support.client import Client
from tests.support.gateway import gateway_client, hook, pod, review, start_gateway, write_config

HOLD = {"matchLabels": {"hold": "yes"}}  # only the held review matches the slow backend
OTHERS = {"matchExpressions": [{"key": "hold", "operator": "DoesNotExist"}]}


def _hooks(url: str, *specs: tuple[str, str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        hook(name, f"{url}/allow", failurePolicy=policy, objectSelector=OTHERS, **extra)
        for name, policy, extra in specs
    ]


def _slow(url: str) -> dict[str, Any]:
    """The backend that holds a review (only the one labelled hold=yes) for 20 s."""
    slow = hook("hold.example.com", f"{url}/sleep/20000/allow", failurePolicy="Ignore", objectSelector=HOLD)
    slow["timeoutSeconds"] = 30
    return slow


async def _hold_one_review(nursery: trio.Nursery, running: Running, server: BackendServer) -> None:
    """One review in flight on the slow backend: with ``--shed-max-in-flight 1`` every other review
    is shed while it lasts."""
    holder = await gateway_client(running)
    nursery.start_soon(
        holder.post, "/validate?timeout=25s", json.dumps(review(pod(labels={"hold": "yes"}))).encode()
    )
    with trio.fail_after(10):
        while not server.calls:
            await trio.sleep(0.005)


CASES = [
    pytest.param(
        "validate",
        [("a.example.com", "Fail", {})],
        {},
        200,
        id="FPT-01/ERR-02: shed under failurePolicy Fail is denied naming the webhook, at once as on the ASGI path",
    ),
    pytest.param(
        "validate",
        [("a.example.com", "Ignore", {})],
        {},
        200,
        id="FPT-03/AUD-06: shed under Ignore is allowed with the failed-open annotation, at once as on the ASGI path",
    ),
    pytest.param(
        "validate",
        [("a.example.com", "Ignore", {}), ("b.example.com", "Fail", {}), ("c.example.com", "Ignore", {})],
        {},
        200,
        id="VAL-05/VAL-07: three backends shed, each under its own policy, in configuration order, at once",
    ),
    pytest.param(
        "mutate",
        [("m.example.com", "Ignore", {}), ("n.example.com", "Ignore", {"reinvocationPolicy": "IfNeeded"})],
        {},
        200,
        id="MUT-14/AUD-06: a mutating chain shed under Ignore: no patch, failed-open per round and index, at once",
    ),
    pytest.param(
        "validate",
        [("a.example.com", "Ignore", {})],
        {"version": "v1beta1"},
        200,
        id="REV-02: a v1beta1 review shed is answered in v1beta1, at once",
    ),
    pytest.param(
        "validate",
        [("a.example.com", "Fail", {"sideEffects": "Unknown"})],
        {"dry_run": True},
        200,
        id="FPT-09: a dry run to a backend with side effects is refused for that, not for the shedding, at once",
    ),
    pytest.param(
        "validate",
        [
            (
                "a.example.com",
                "Fail",
                {"matchConditions": [{"name": "not-web", "expression": "object.metadata.name != 'web-1'"}]},
            ),
            ("b.example.com", "Ignore", {"namespaceSelector": {"matchLabels": {"team": "shop"}}}),
        ],
        {},
        200,
        id="MAT-12/MAT-25: match conditions and a known namespace's labels decide who is shed, at once",
    ),
    pytest.param(
        "validate/ignore",
        [("a.example.com", "Fail", {}), ("b.example.com", "Ignore", {})],
        {},
        200,
        id="the /validate/ignore half sheds only its own backends, at once",
    ),
]


@pytest.mark.parametrize(("endpoint", "specs", "review_args", "status"), CASES)
async def test_a_shed_review_is_answered_where_it_is_read_as_on_the_asgi_path(
    nursery: trio.Nursery,
    tmp_path: Path,
    endpoint: str,
    specs: list[tuple[str, str, dict[str, Any]]],
    review_args: dict[str, Any],
    status: int,
) -> None:
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    url = f"http://127.0.0.1:{server.port}"
    slow = _slow(url)
    hooks = _hooks(url, *specs)
    if endpoint == "mutate":
        write_config(
            tmp_path / "c",
            validating={"hold": [slow]},
            mutating={"team-a": hooks},
            namespaces={"shop": {"team": "shop"}},
        )
    else:
        # sideEffects Unknown is a v1beta1 value (v1 refuses it): the dry-run case's configuration.
        v1beta1 = any(h.get("sideEffects") == "Unknown" for h in hooks)
        write_config(
            tmp_path / "c",
            validating={"team-a": [slow, *hooks]},
            namespaces={"shop": {"team": "shop"}},
            api_version="admissionregistration.k8s.io/v1beta1"
            if v1beta1
            else "admissionregistration.k8s.io/v1",
        )
    running = await start_gateway(nursery, tmp_path / "c", "--shed-max-in-flight", "1")
    app = running.app
    assert app is not None
    await _hold_one_review(nursery, running, server)
    assert app.answered_at_once == 0, "the held review took the ASGI path"

    doc = review(pod(), **review_args)
    h1: Client = await gateway_client(running)
    at_once = await h1.post(f"/{endpoint}?timeout=5s", json.dumps(doc).encode())
    assert app.answered_at_once == 1, "the shed review was answered where it was read"
    h2: Client = await gateway_client(running, protocol="h2")
    asgi = await h2.post(f"/{endpoint}?timeout=5s", json.dumps(doc).encode())
    assert app.answered_at_once == 1, "the HTTP/2 review took the ASGI path"
    assert at_once is not None and asgi is not None
    assert (at_once.status, asgi.status) == (status, status)
    assert at_once.headers["content-type"] == asgi.headers["content-type"] == "application/json"
    assert at_once.json == asgi.json
    assert at_once.json["response"]["uid"] == doc["request"]["uid"]
    assert len(server.calls) == 1, "a shed review called a backend"


async def test_what_cannot_be_decided_at_once_takes_the_asgi_path(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A malformed review (400 with its reason), a review to an unknown path and a GET are not
    answered at once; they get what they always got."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    url = f"http://127.0.0.1:{server.port}"
    slow = _slow(url)
    write_config(tmp_path / "c", validating={"team-a": [slow, *_hooks(url, ("a.example.com", "Fail", {}))]})
    running = await start_gateway(nursery, tmp_path / "c", "--shed-max-in-flight", "1")
    await _hold_one_review(nursery, running, server)
    client = await gateway_client(running)
    bad = await client.post(
        "/validate?timeout=5s", b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}'
    )
    assert bad is not None and bad.status == 400
    unknown = await client.post("/elsewhere", json.dumps(review(pod())).encode())
    assert unknown is not None and unknown.status == 404
    shed = await client.post("/validate?timeout=5s", json.dumps(review(pod())).encode())
    assert shed is not None and shed.status == 200 and shed.json["response"]["allowed"] is False


async def test_shed_reviews_answered_at_once_write_one_review_line_a_second(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Under overload a review line costs a tenth of a shed answer: of the reviews shed where they
    were read, one per endpoint and second gets its line; each is counted in the metrics."""
    from structlog.testing import capture_logs

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    url = f"http://127.0.0.1:{server.port}"
    slow = _slow(url)
    write_config(tmp_path / "c", validating={"team-a": [slow, *_hooks(url, ("a.example.com", "Ignore", {}))]})
    options = parse(
        [
            "--config",
            str(tmp_path / "c"),
            "--bind",
            "127.0.0.1:0",
            "--drain-seconds",
            "0",
            "--shed-max-in-flight",
            "1",
        ]
    ).options
    observer = Observability(metrics=True)  # with its review lines, as `webhook-gateway serve` runs
    running: Running = await nursery.start(
        lambda task_status: serve(options, observer=observer, handle_signals=False, task_status=task_status)
    )
    await _hold_one_review(nursery, running, server)
    client = await gateway_client(running)
    with capture_logs() as logs:
        for _ in range(20):
            got = await client.post("/validate?timeout=5s", json.dumps(review(pod())).encode())
            assert got is not None and got.json["response"]["allowed"] is True
    lines = [entry for entry in logs if entry["event"] == "review"]
    assert 1 <= len(lines) < 20
    assert lines[0]["decision"] == "allowed", lines
    scraped = await client.post("/metrics", b"", method="GET")
    assert scraped is not None
    assert 'webhook_gateway_reviews_shed_total{reason="in_flight"} 20.0' in scraped.body.decode()


SPLITS = [
    pytest.param(
        [0.5],
        id="the body in two writes, as Go's client writes a body larger than its 4 KiB buffer: answered at once",
    ),
    pytest.param([0.0], id="the head alone, then the body: answered at once"),
    pytest.param([0.25, 0.5, 0.75], id="the body in four writes: answered at once"),
]


@pytest.mark.parametrize("cuts", SPLITS)
async def test_a_shed_review_whose_body_comes_in_several_reads_is_answered_at_once(
    nursery: trio.Nursery, tmp_path: Path, cuts: list[float]
) -> None:
    """kube-apiserver's client (Go's net/http) writes a request through a 4 KiB buffer: an 8 KB review
    reaches the gateway in several reads. A shed review's body is gathered where it is read (not
    handed to a task and the ASGI path piece by piece) and answered at once, the same answer."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    url = f"http://127.0.0.1:{server.port}"
    write_config(
        tmp_path / "c", validating={"team-a": [_slow(url), *_hooks(url, ("a.example.com", "Ignore", {}))]}
    )
    running = await start_gateway(nursery, tmp_path / "c", "--shed-max-in-flight", "1")
    app = running.app
    assert app is not None
    await _hold_one_review(nursery, running, server)
    doc = review(pod(labels={"pad": "x" * 60}))
    doc["request"]["object"]["metadata"]["annotations"] = {"note": "y" * 8000}  # an 8 KB review
    body = json.dumps(doc).encode()
    whole = await (await gateway_client(running)).post("/validate?timeout=5s", body)
    assert app.answered_at_once == 1 and whole is not None

    request = b"POST /validate?timeout=5s HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n\r\n" % len(body)
    stream = await trio.open_tcp_stream("127.0.0.1", int(running.urls[0].rsplit(":", 1)[1]))
    marks = [len(request) + int(len(body) * cut) for cut in cuts]
    wire = request + body
    for start, end in zip([0, *marks], [*marks, len(wire)], strict=True):
        await stream.send_all(wire[start:end])
        await trio.testing.wait_all_tasks_blocked()  # the gateway has read these bytes
    reply = await _read_reply(stream)
    await stream.aclose()
    assert app.answered_at_once == 2, "the review in several reads took the ASGI path"
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1]) == whole.json
    assert len(server.calls) == 1, "a shed review called a backend"


async def _read_reply(stream: trio.abc.Stream) -> bytes:
    """One HTTP/1.1 reply with a Content-Length, read whole."""
    reply = b""
    with trio.fail_after(10):
        while True:
            head, sep, rest = reply.partition(b"\r\n\r\n")
            if sep:
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                assert length is not None, head
                if len(rest) >= int(length[1]):
                    return reply
            chunk = await stream.receive_some(65536)
            assert chunk, reply
            reply += chunk


async def test_a_shed_review_whose_body_stops_coming_is_cut_at_the_heads_deadline(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A body being gathered holds at most 64 KiB and no task, and its head's deadline covers it: a
    client that sends half a body and stops is cut at --header-read-timeout, as a half head is."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    url = f"http://127.0.0.1:{server.port}"
    write_config(
        tmp_path / "c", validating={"team-a": [_slow(url), *_hooks(url, ("a.example.com", "Ignore", {}))]}
    )
    running = await start_gateway(
        nursery, tmp_path / "c", "--shed-max-in-flight", "1", "--header-read-timeout", "0.5"
    )
    await _hold_one_review(nursery, running, server)
    body = json.dumps(review(pod())).encode()
    head = b"POST /validate?timeout=5s HTTP/1.1\r\nHost: gateway\r\nContent-Length: %d\r\n\r\n" % len(body)
    stream = await trio.open_tcp_stream("127.0.0.1", int(running.urls[0].rsplit(":", 1)[1]))
    await stream.send_all(head + body[: len(body) // 2])
    with trio.fail_after(10):
        assert await stream.receive_some(65536) == b"", "the connection was closed, nothing answered"
    await stream.aclose()


# --- reviews alike share one shed verdict ----------------------------------------------------------

PODS = [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["*"], "resources": ["pods"], "scope": "*"}]
NAMESPACES = [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["*"], "resources": ["namespaces"]}]
CONFIGMAPS = [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["*"], "resources": ["configmaps"]}]
SHOP, CAFE = {"team": "shop"}, {"team": "cafe"}


def _namespace(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def _pod_review(**fields: Any) -> dict[str, Any]:
    labels = fields.pop("labels", None)
    namespace = fields.pop("namespace", "shop")
    return review(pod(namespace=namespace, labels=labels), namespace=namespace, **fields)


def _namespace_deleted(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """The review of a Namespace's deletion: no object, the stored one as oldObject."""
    ns, kind = ("", "v1", "namespaces"), ("", "v1", "Namespace")
    return review(
        None, operation="DELETE", old=_namespace(name, labels), namespace=name, resource=ns, kind=kind
    )


ALIKE = [
    pytest.param(
        [("a.example.com", "Fail", {})],
        _pod_review(),
        _pod_review(),
        1,
        id="FPT-01/REV-02: a second review of the same class gets the first one's shed verdict under its own uid",
    ),
    pytest.param(
        [("a.example.com", "Ignore", {}), ("b.example.com", "Fail", {})],
        _pod_review(),
        _pod_review(version="v1beta1"),
        1,
        id="REV-02/AUD-06: one shed verdict answers a v1 and a v1beta1 review, each in its own version",
    ),
    pytest.param(
        [("a.example.com", "Fail", {})],
        _pod_review(),
        _pod_review(uid='uid "quoted" \\ back\\slash, é and \u2028'),
        1,
        id="REV-02: a uid that JSON must escape is echoed exactly in a shared shed verdict's answer",
    ),
    pytest.param(
        [("a.example.com", "Fail", {"sideEffects": "Unknown"})],
        _pod_review(),
        _pod_review(dry_run=True),
        0,
        id="FPT-09: a dry run is not of the class of a review that is not: refused for its side effects instead",
    ),
    pytest.param(
        [("a.example.com", "Fail", {"objectSelector": {"matchLabels": {"app": "web"}}})],
        _pod_review(labels={"app": "web"}),
        _pod_review(labels={"app": "web"}),
        1,
        id="MAT-19: reviews whose objects carry the same labels share the verdict an objectSelector gave",
    ),
    pytest.param(
        [("a.example.com", "Fail", {"objectSelector": {"matchLabels": {"app": "web"}}})],
        _pod_review(labels={"app": "web"}),
        _pod_review(labels={"app": "db"}),
        0,
        id="MAT-19: an object with other labels is decided again: the objectSelector skips the backend",
    ),
    pytest.param(
        [("a.example.com", "Fail", {"objectSelector": {"matchLabels": {"app": "web"}}})],
        _pod_review(operation="UPDATE", labels={"app": "db"}, old=pod(labels={"app": "web"})),
        _pod_review(operation="UPDATE", labels={"app": "db"}, old=pod(labels={"app": "db"})),
        0,
        id="MAT-19: an update whose old object has other labels is decided again: the selector reads both",
    ),
    pytest.param(
        [("a.example.com", "Fail", {"namespaceSelector": {"matchLabels": SHOP}})],
        _pod_review(namespace="shop"),
        _pod_review(namespace="cafe"),
        0,
        id="MAT-13: a review in a namespace with other labels is decided again: the namespaceSelector skips",
    ),
    pytest.param(
        [("a.example.com", "Fail", {"namespaceSelector": {"matchLabels": SHOP}, "rules": NAMESPACES})],
        _namespace_deleted("shop", SHOP),
        _namespace_deleted("shop", CAFE),
        0,
        id="MAT-15: a Namespace deleted with other labels is decided again: its old object's labels are read",
    ),
    pytest.param(
        [
            (
                "a.example.com",
                "Fail",
                {"matchConditions": [{"name": "web", "expression": "object.metadata.name == 'web-1'"}]},
            )
        ],
        _pod_review(),
        _pod_review(),
        0,
        id="MAT-25: a backend with match conditions reads the whole review: every shed review is decided again",
    ),
]


@pytest.mark.parametrize(("specs", "first", "second", "reused"), ALIKE)
async def test_reviews_alike_share_one_shed_verdict_and_no_other_review_does(
    nursery: trio.Nursery,
    tmp_path: Path,
    specs: list[tuple[str, str, dict[str, Any]]],
    first: dict[str, Any],
    second: dict[str, Any],
    reused: int,
) -> None:
    """Both shed reviews are answered at once and each as the ASGI path answers it (which decides
    every review in full); the second gets the first one's verdict only when nothing the verdict
    reads differs (``Dispatcher.shed_verdicts_reused``)."""
    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    url = f"http://127.0.0.1:{server.port}"
    slow = hook("hold.example.com", f"{url}/sleep/20000/allow", failurePolicy="Ignore", rules=CONFIGMAPS)
    slow["timeoutSeconds"] = 30
    hooks = [
        hook(name, f"{url}/allow", failurePolicy=policy, **{"rules": PODS, **extra})
        for name, policy, extra in specs
    ]
    v1beta1 = any(h.get("sideEffects") == "Unknown" for h in hooks)  # a v1beta1 value (v1 refuses it)
    write_config(
        tmp_path / "c",
        validating={"team-a": [slow, *hooks]},
        namespaces={"shop": SHOP, "cafe": CAFE},
        api_version="admissionregistration.k8s.io/v1beta1" if v1beta1 else "admissionregistration.k8s.io/v1",
    )
    running = await start_gateway(nursery, tmp_path / "c", "--shed-max-in-flight", "1")
    app = running.app
    holder = await gateway_client(running)
    held = review(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "shop"}},
        resource=("", "v1", "configmaps"),
        kind=("", "v1", "ConfigMap"),
    )
    nursery.start_soon(holder.post, "/validate?timeout=25s", json.dumps(held).encode())
    with trio.fail_after(10):
        while not server.calls:
            await trio.sleep(0.005)

    h1: Client = await gateway_client(running)
    h2: Client = await gateway_client(running, protocol="h2")
    answers = []
    for doc in (first, second):
        body = json.dumps(doc).encode()
        at_once = await h1.post("/validate?timeout=5s", body)
        asgi = await h2.post("/validate?timeout=5s", body)
        assert at_once is not None and asgi is not None
        assert (at_once.status, asgi.status) == (200, 200)
        assert at_once.json == asgi.json, "answered at once as the ASGI path decides it in full"
        assert at_once.json["apiVersion"] == doc["apiVersion"]
        assert at_once.json["response"]["uid"] == doc["request"]["uid"]
        answers.append(at_once.json["response"])
    assert app.answered_at_once == 2
    assert app.dispatcher.shed_verdicts_reused == reused
    if reused == 0 and specs[0][2].get("sideEffects") != "Unknown" and "matchConditions" not in specs[0][2]:
        assert answers[0]["allowed"] != answers[1]["allowed"], "the case decides the two reviews apart"
    assert len(server.calls) == 1, "a shed review called a backend"
