"""The load tests' test bed (issue 32): ``--backend go``, a compiled backend that allows every
review at a fraction of the Python fleet's CPU, and ``--pin``, the measured server on a CPU of its
own — each through real processes, sockets and TLS."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gateway.wire import tls
from loadtests import gobackend
from loadtests.client import Endpoint, H2Connection, Http1Connection, client_context
from loadtests.fixtures import review_templates
from loadtests.processes import Certs, cpus_of, fleet_ports, managed, nginx, pinned
from tests.test_loadtool_cli import loadtool

ROOT = Path(__file__).resolve().parent.parent
UID = "5f0c3c4e-1d2b-4a3c-9e8f-0123456789ab"


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[tuple[Certs, list[int]]]:
    """The Go backend with two listeners (h2 and http/1.1 offered), and its certificates."""
    certs = Certs.create(tmp_path)
    with managed(gobackend.spawn(2, certs)) as proc:
        yield certs, await fleet_ports(proc)


@pytest.fixture
async def http1_backend(tmp_path: Path) -> AsyncIterator[tuple[Certs, list[int]]]:
    (tmp_path / "http1").mkdir()  # (pytest-trio sets async fixtures up concurrently)
    certs = Certs.create(tmp_path / "http1")
    with managed(gobackend.spawn(1, certs, http1_only=True)) as proc:
        yield certs, await fleet_ports(proc)


async def call(
    certs: Certs, port: int, body: bytes, *, protocol: str = "http1", path: bytes = b"/allow?timeout=10s"
) -> tuple[int, bytes]:
    endpoint = Endpoint("127.0.0.1", port, client_context(certs.ca_pem, protocol), f"127.0.0.1:{port}")
    if protocol == "h2":
        async with trio.open_nursery() as nursery:
            h2 = await H2Connection.open(endpoint, nursery)
            try:
                return await h2.request(path, body)
            finally:
                await h2.aclose()
                nursery.cancel_scope.cancel()
    conn = await Http1Connection.open(endpoint)
    try:
        return await conn.request(path, body)
    finally:
        await conn.aclose()


@pytest.mark.parametrize(
    ("protocol", "version"),
    [
        pytest.param("h2", "v1", id="over h2 a v1 review is allowed with its uid in v1"),
        pytest.param("http1", "v1", id="over HTTP/1.1 a v1 review is allowed with its uid in v1"),
        pytest.param("h2", "v1beta1", id="over h2 a v1beta1 review is answered in v1beta1"),
        pytest.param("http1", "v1beta1", id="over HTTP/1.1 a v1beta1 review is answered in v1beta1"),
    ],
)
async def test_the_go_backend_allows_with_the_reviews_uid_in_its_version(
    backend: tuple[Certs, list[int]], protocol: str, version: str
) -> None:
    certs, ports = backend
    body = review_templates(8, version)[0].body(UID)
    for port in ports:  # every listener serves
        status, reply = await call(certs, port, body, protocol=protocol)
        assert status == 200, reply
        assert json.loads(reply) == {
            "apiVersion": f"admission.k8s.io/{version}",
            "kind": "AdmissionReview",
            "response": {"uid": UID, "allowed": True},
        }


def review(request: str, before: str = "", after: str = "", version: str = "admission.k8s.io/v1") -> bytes:
    return (
        f'{{{before}"apiVersion":"{version}","kind":"AdmissionReview","request":{request}{after}}}'
    ).encode()


# Reviews whose request.uid a careless scanner would get wrong; the answer must carry
# json.loads(body)["request"]["uid"] every time.
TRICKY = [
    pytest.param(
        review('{"object":{"metadata":{"uid":"the-pods-uid"}},"uid":"' + UID + '"}'),
        id="the object's metadata.uid comes before request.uid and is not taken",
    ),
    pytest.param(
        review('{"userInfo":{"uid":"the-users-uid"},"uid":"' + UID + '"}'),
        id="userInfo.uid before request.uid is not taken",
    ),
    pytest.param(
        review('{"uid":"' + UID + '"}', before='"uid":"top-level-decoy",'),
        id="a top-level uid is not request.uid",
    ),
    pytest.param(
        review('{"note":"a string with \\"uid\\":\\"fake\\" in it","uid":"' + UID + '"}'),
        id="a uid key inside a string value is only text",
    ),
    pytest.param(
        review('{"\\u0075id":"' + UID + '"}'),
        id="an escaped key that reads uid is request.uid",
    ),
    pytest.param(
        review('{"uid":"a\\"b\\\\c\\u00e9"}'),
        id="a uid with escapes comes back as the same string",
    ),
    pytest.param(
        review('{"uid":"first","uid":"' + UID + '"}'),
        id="of duplicate uid keys the last one counts as in encoding/json",
    ),
    pytest.param(
        review('{"uid":"' + UID + '"}', before='"request":{"uid":"earlier-request"},'),
        id="of duplicate request keys the last one counts",
    ),
    pytest.param(
        review('{"list":[{"uid":"in-an-array"}, [1, 2.5e3, true, null]],"uid":"' + UID + '"}'),
        id="arrays, numbers and literals before request.uid are skipped whole",
    ),
    pytest.param(
        b' {\n "request" : { "uid" : "' + UID.encode() + b'" } ,\n "apiVersion" : "admission.k8s.io/v1" }\n',
        id="whitespace anywhere and apiVersion after request",
    ),
]


@pytest.mark.parametrize("body", TRICKY)
async def test_the_answer_carries_request_uid_for_any_valid_json_review(
    backend: tuple[Certs, list[int]], body: bytes
) -> None:
    certs, ports = backend
    status, reply = await call(certs, ports[0], body)
    assert status == 200, reply
    assert json.loads(reply)["response"]["uid"] == json.loads(body)["request"]["uid"]


@pytest.mark.parametrize(
    ("body", "path", "status"),
    [
        pytest.param(b"not json", b"/allow", 400, id="a body that is not JSON gets 400"),
        pytest.param(b'{"apiVersion":"admission.k8s.io/v1"', b"/allow", 400, id="truncated JSON gets 400"),
        pytest.param(
            review('{"uid":"x"}', version="admission.k8s.io/v2"),
            b"/allow",
            400,
            id="a review of an unknown version gets 400",
        ),
        pytest.param(review('{"name":"x"}'), b"/allow", 400, id="a review without request.uid gets 400"),
        pytest.param(review("null"), b"/allow", 400, id="a null request gets 400"),
        pytest.param(review('{"uid":"x"}'), b"/deny", 404, id="any path but /allow is not served"),
        pytest.param(
            review('{"uid":"x"}'), b"/sleep/x/allow", 404, id="a sleep that is not milliseconds is not served"
        ),
        pytest.param(
            review('{"uid":"x"}'), b"/sleep/5/deny", 404, id="a sleep before anything but allow is not served"
        ),
    ],
)
async def test_what_is_not_a_review_to_allow_is_refused_not_allowed(
    backend: tuple[Certs, list[int]], body: bytes, path: bytes, status: int
) -> None:
    certs, ports = backend
    got, reply = await call(certs, ports[0], body, path=path)
    assert got == status, reply


async def test_sleep_n_allow_answers_the_same_after_n_milliseconds(backend: tuple[Certs, list[int]]) -> None:
    """The overload scenario's 20 ms backends (``/sleep/20/allow``): the same answer, not before."""
    certs, ports = backend
    body = review(f'{{"uid":"{UID}"}}')
    started = trio.current_time()
    status, reply = await call(certs, ports[0], body, path=b"/sleep/50/allow?timeout=10s")
    assert status == 200, reply
    assert json.loads(reply)["response"] == {"uid": UID, "allowed": True}
    assert trio.current_time() - started >= 0.05  # a lower bound only: nothing here is timed


def alpn(certs: Certs, port: int) -> str | None:
    ctx = tls.client_context(ca_pem=certs.ca_pem, alpn=["h2", "http/1.1"])
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        return s.selected_alpn_protocol()


async def test_it_offers_h2_then_http11_and_only_http11_when_asked(
    backend: tuple[Certs, list[int]], http1_backend: tuple[Certs, list[int]]
) -> None:
    assert alpn(backend[0], backend[1][0]) == "h2"
    assert alpn(http1_backend[0], http1_backend[1][0]) == "http/1.1"


# ------------------------------------------------------------------------------------------------
# --pin


def test_a_pinned_program_runs_every_thread_on_its_cpus_from_its_start(tmp_path: Path) -> None:
    """A Go program starts its runtime's threads before main: pinning its pid after the start
    would leave those where they were; ``pinned`` sets the CPUs before it runs at all."""
    first = min(os.sched_getaffinity(0))
    certs = Certs.create(tmp_path)
    cmd = [
        str(gobackend.build()),
        "-count",
        "1",
        "-certfile",
        str(certs.certfile),
        "-keyfile",
        str(certs.keyfile),
    ]
    with managed(subprocess.Popen(pinned(cmd, {first}), stdout=subprocess.PIPE)) as proc:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["ports"], "it serves"
        threads = list(Path(f"/proc/{proc.pid}/task").iterdir())
        assert len(threads) > 1, "Go's runtime threads are there"
        assert cpus_of(proc.pid) == {first}


def run_quick(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "result.json"
    argv = [sys.executable, "-m", "loadtests", "passthrough", "--quick", "--duration", "1", "--rate", "100"]
    proc = subprocess.run(
        [*argv, "--no-progress", "--json", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_a_run_with_the_go_backend_and_the_go_caller_answers_every_review(tmp_path: Path) -> None:
    # 800 reviews: ~90 ms of the Go backend's CPU, read in clock ticks of 10 ms (100 reviews could
    # round to none and read 0).
    proc, doc = run_quick(
        tmp_path, "--backend", "go", "--generator", "go", "--rate", "400", "--duration", "2"
    )
    rows = doc["points"][0]["median"]
    assert set(rows) == {"direct", "gateway"}
    for name, row in rows.items():
        assert row["ok"] > 50 and row["errors"] == {} and row["late"] == 0, (name, row)
        assert row["backend_cpu_us_per_review"] > 0, "the Go backend's CPU is reported per review"
    assert "Go backend (loadtests/gobackend)" in proc.stdout
    # What Go's transport does not show the caller is "-", not 0: surplus closes, server closes.
    assert re.search(r"peak \d+ open, closed: - surplus idle, \d+ abandoned, - by the server", proc.stdout), (
        proc.stdout
    )


def _split() -> tuple[list[int], list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-1:], cpus[:-1]


@pytest.mark.slow
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="--pin needs 2 CPUs (refused with one: tested below)"
)
@pytest.mark.parametrize(
    ("args", "servers", "others"),
    [
        pytest.param(
            ["--backend", "go", "--generator", "go", "--nginx"],
            {"gateway", "nginx"},
            {"generator", "go caller", "backend"},
            id="--pin puts gateway and nginx on the last CPU and the Go caller and Go backend on the others",
        ),
        pytest.param(
            ["--baseline-arg=--workers=1"],
            {"gateway", "baseline"},
            {"generator", "backend"},
            id="--pin puts both gateways on the last CPU and the Python generator and fleet on the others",
        ),
    ],
)
def test_pin_places_every_process_it_starts(
    tmp_path: Path, args: list[str], servers: set[str], others: set[str]
) -> None:
    if "--nginx" in args and nginx() is None:
        pytest.skip("nginx is not installed (Debian: apt-get install nginx-light)")
    proc, doc = run_quick(tmp_path, "--pin", *args)
    last, rest = _split()
    placement = doc["placement"]  # read from each process's threads during the phases
    assert set(placement) == servers | others
    assert {role: cpus for role, cpus in placement.items() if role in servers} == dict.fromkeys(servers, last)
    assert {role: cpus for role, cpus in placement.items() if role in others} == dict.fromkeys(others, rest)
    assert all(row["errors"] == {} for row in doc["points"][0]["median"].values())
    assert "pinned (--pin;" in proc.stdout


@pytest.mark.parametrize(
    ("args", "prelude", "message"),
    [
        pytest.param(
            ["mutating3", "--backend", "go"],
            "",
            "--backend go answers POST /allow only, and scenario mutating3 calls /patch/",
            id="--backend go refuses a scenario whose backends do more than allow",
        ),
        pytest.param(
            ["passthrough", "--backend", "go", "--latency-ms", "5"],
            "",
            "--backend go answers POST /allow only, and scenario passthrough calls /latency/fixed/5/allow",
            id="--backend go refuses a latency it would not honour",
        ),
        pytest.param(
            ["passthrough", "--backend", "go", "--no-tls"],
            "",
            "--backend go serves HTTPS only",
            id="--backend go refuses plaintext",
        ),
        pytest.param(
            ["--target", "https://127.0.0.1:1/validate", "--backend", "go"],
            "",
            "--backend go is a backend this run starts (not --target)",
            id="--backend go refuses a run with no backends of its own",
        ),
        pytest.param(
            ["passthrough", "--pin", "--target", "https://127.0.0.1:1/validate"],
            "",
            "--pin places the processes this run starts (not --target)",
            id="--pin refuses a target it does not start",
        ),
        pytest.param(
            ["passthrough", "--pin"],
            "import os\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})",
            "--pin needs 2 CPUs or more to split (this process may use 1)",
            id="--pin refuses a machine with one CPU",
        ),
        pytest.param(
            ["passthrough", "--gateway-cpu", "0.5", "--target", "https://127.0.0.1:1/validate"],
            "",
            "--gateway-cpu limits the processes this run starts (not --target)",
            id="--gateway-cpu refuses a target it does not start",
        ),
        pytest.param(
            ["passthrough", "--gateway-cpu", "0", "--duration", "1"],
            "",
            "--gateway-cpu 0: give a share of CPUs between 0.01 and 64",
            id="--gateway-cpu refuses a share of 0",
        ),
    ],
)
async def test_refusals_exit_2_with_one_line_before_any_work(
    args: list[str], prelude: str, message: str
) -> None:
    code, out = await loadtool(*args, prelude=prelude)
    assert code == 2, out
    assert message in out
    assert "starting" not in out
    assert len([line for line in out.splitlines() if "error:" in line]) == 1
