"""`--workers N`: N gateway processes on one socket, supervised; the real CLI as a subprocess.

Reviews go to 127.0.0.1 through real sockets to the real command line; the backend is the sample
backend server, the namespace watch the fake kube-apiserver. Worker processes are found in /proc
as the supervisor's children.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trustme
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability import Metrics
from gateway.server.cgroup import CpuBudget, CpuShare, cpu_share
from gateway.server.workers import available_cpus, capture, merge
from loadtests.processes import free_port
from tests.support.client import connect
from tests.support.gateway import backend, hook, review, write_config
from tests.support.kubeapi import FakeKubeAPI, write_kubeconfig

REPO = Path(__file__).resolve().parent.parent


# --- how many workers by default -----------------------------------------------------------------


def _cgroup(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    (tmp_path / "proc-cgroup").write_text(proc)
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    return tmp_path / "proc-cgroup", root


CPU_CASES = [
    pytest.param(
        8, "0::/\n", {"cpu.max": "max 100000\n"}, 8, id="cgroup v2 without a quota: the affinity mask"
    ),
    pytest.param(
        8, "0::/\n", {"cpu.max": "150000 100000\n"}, 2, id="cgroup v2 quota of 1.5 CPUs: rounded up to 2"
    ),
    pytest.param(
        8, "0::/\n", {"cpu.max": "20000 100000\n"}, 1, id="cgroup v2 quota below one CPU: one worker"
    ),
    pytest.param(2, "0::/\n", {"cpu.max": "400000 100000\n"}, 2, id="affinity of 2 under a quota of 4: 2"),
    pytest.param(
        16,
        "0::/kubepods/pod1/ctr\n",
        {"kubepods/pod1/ctr/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "300000 100000\n"},
        3,
        id="cgroup v2: a parent's quota limits the container too",
    ),
    pytest.param(
        8,
        "12:cpu,cpuacct:/\n1:name=systemd:/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "250000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
        3,
        id="cgroup v1 cfs quota of 2.5 CPUs: 3",
    ),
    pytest.param(
        8,
        "12:cpu,cpuacct:/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
        8,
        id="cgroup v1 without a quota (-1): the affinity mask",
    ),
    pytest.param(4, "", {}, 4, id="no cgroup information: the affinity mask"),
]


@pytest.mark.parametrize(("affinity", "proc", "files", "expected"), CPU_CASES)
def test_default_worker_count(
    tmp_path: Path, affinity: int, proc: str, files: dict[str, str], expected: int
) -> None:
    proc_cgroup, root = _cgroup(tmp_path, proc, files)
    assert available_cpus(affinity=affinity, proc_cgroup=proc_cgroup, cgroup_root=root) == expected


CPU_SHARE_CASES = [
    pytest.param(2, "", {}, 1, 1.0, id="two CPUs, no cgroup quota, one process: one CPU (one event loop)"),
    pytest.param(2, "", {}, 2, 1.0, id="two CPUs, no cgroup quota, two workers: one CPU each"),
    pytest.param(
        8, "0::/\n", {"cpu.max": "max 100000\n"}, 16, 0.5, id="eight CPUs, sixteen workers: half a CPU each"
    ),
    pytest.param(
        2,
        "0::/\n",
        {"cpu.max": "50000 100000\n"},
        1,
        0.5,
        id="cgroup v2 quota of 500m, one process: half a CPU, not rounded up",
    ),
    pytest.param(
        4,
        "12:cpu,cpuacct:/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
        2,
        0.75,
        id="cgroup v1 quota of 1.5 CPUs, two workers: 0.75 CPU each",
    ),
]


@pytest.mark.parametrize(("affinity", "proc", "files", "processes", "expected"), CPU_SHARE_CASES)
def test_the_cpu_a_worker_may_use_is_its_share_of_the_quota_or_its_cpus(
    tmp_path: Path, affinity: int, proc: str, files: dict[str, str], processes: int, expected: float
) -> None:
    """What the handshake gate and ``--shed-max-cpu`` measure a worker's CPU against (``cpu_share``;
    docs/inbound.md, docs/resilience.md)."""
    proc_cgroup, root = _cgroup(tmp_path, proc, files)
    assert cpu_share(processes, affinity=affinity, proc_cgroup=proc_cgroup, cgroup_root=root) == expected


def test_a_cpu_share_is_measured_over_at_least_its_window() -> None:
    """Asked more often than its window, it keeps its last measure; a budget must be positive."""
    now, spent = [0.0], [0.0]
    share = CpuShare(0.5, window=0.1, clock=lambda: now[0], cpu=lambda: spent[0])
    now[0], spent[0] = 0.05, 0.05  # a whole CPU for 50 ms: within the window, not measured yet
    assert share.share() == 0
    now[0], spent[0] = 0.1, 0.1
    assert share.share() == 2  # 0.1 s of CPU in 0.1 s: twice the budget
    now[0] = 0.15
    assert share.share() == 2  # still the last measure
    now[0] = 0.3  # no CPU since
    assert share.share() == 0
    with pytest.raises(ValueError, match="budget"):
        CpuShare(0)


def test_a_cpu_budget_follows_a_limit_changed_while_the_process_runs(tmp_path: Path) -> None:
    """An in-place resize of a pod rewrites its cgroup's ``cpu.max``: the budget the handshake gate
    and ``--shed-max-cpu`` measure against is read again once its refresh interval has passed, not
    before, and a change is reported once (the ``cpu budget changed`` log line)."""
    proc_cgroup, root = _cgroup(tmp_path, "0::/\n", {"cpu.max": "100000 100000\n"})
    now, changes = [0.0], []
    budget = CpuBudget(
        lambda: cpu_share(1, affinity=2, proc_cgroup=proc_cgroup, cgroup_root=root),
        refresh=1.0,
        clock=lambda: now[0],
        on_change=lambda before, after: changes.append((before, after)),
    )
    assert budget() == 1.0
    (root / "cpu.max").write_text("50000 100000\n")  # resized to 500m
    now[0] = 0.9
    assert budget() == 1.0  # not read again yet
    now[0] = 1.0
    assert budget() == 0.5
    now[0] = 2.5
    assert budget() == 0.5
    assert changes == [(1.0, 0.5)]
    share = CpuShare(budget, window=0.1, clock=lambda: now[0], cpu=lambda: now[0] * 0.5)
    now[0] = 2.6
    assert share.share() == pytest.approx(1.0)  # half a CPU used of the half it may use


def test_default_worker_count_of_this_process() -> None:
    """Without overrides: never more than the CPUs in this process's affinity mask, at least one."""
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


# --- merging the workers' metrics ----------------------------------------------------------------


def _values(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_merged_metrics_add_counters_and_histograms_and_combine_gauges_per_family() -> None:
    """MET: counters and histograms of two workers add up; in-flight adds; config generation is the highest."""
    a, b = Metrics(), Metrics()
    for worker, reviews, generation in ((a, 3, 2), (b, 2, 1)):
        worker.config_reloaded(True, generation, {"validating": 1, "mutating": 0})
        for _ in range(reviews):
            worker.review_started("validating")
            worker.review_finished("validating", code=200, seconds=0.002, operation="CREATE", allowed=True)
        worker.review_started("validating")  # one in flight in each
    merged = Metrics()
    merge(merged, [capture(a), capture(b)])
    got = _values(merged)
    code = (("code", "200"), ("endpoint", "validating"))
    assert got[("webhook_gateway_inbound_requests_total", code)] == 5
    assert (
        got[
            (
                "webhook_gateway_review_duration_seconds_count",
                (("decision", "allowed"), ("endpoint", "validating")),
            )
        ]
        == 5
    )
    assert got[("webhook_gateway_reviews_in_flight", (("endpoint", "validating"),))] == 2
    assert got[("webhook_gateway_config_generation", ())] == 2
    assert got[("webhook_gateway_config_reloads_total", (("result", "success"),))] == 2


def test_a_restarted_worker_continues_its_predecessors_counters_but_not_its_gauges() -> None:
    """A worker started in the slot of a dead one starts from its last snapshot: totals never go back."""
    old = Metrics()
    old.review_started("mutating")
    old.review_finished("mutating", code=200, seconds=0.001, operation="CREATE", allowed=False)
    old.review_started("mutating")  # in flight when it died
    new = Metrics()
    merge(new, [capture(old)], gauges=False)
    got = _values(new)
    assert got[("webhook_gateway_inbound_requests_total", (("code", "200"), ("endpoint", "mutating")))] == 1
    assert got[("webhook_gateway_reviews_in_flight", (("endpoint", "mutating"),))] == 0


# --- the real command line with --workers 2 ------------------------------------------------------


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


class Gateway:
    def __init__(self, process: trio.Process, port: int, config: Path) -> None:
        self.process = process
        self.port = port
        self.config = config
        self.tls: ssl.SSLContext | None = None
        self.seen: set[int] = set()  # every worker pid seen, to clean up after a failed test
        self.metrics_port: int | None = None  # with --metrics-bind, /metrics is served only there

    async def get(self, path: str, port: int | None = None) -> tuple[int, str]:
        # A new connection each time: any worker may take it.
        client = await connect("127.0.0.1", port or self.port, ssl_context=self.tls if port is None else None)
        try:
            resp = await client.post(path, b"", method="GET")
            assert resp is not None
            return resp.status, resp.body.decode()
        finally:
            await client.aclose()

    async def review(self, endpoint: str = "validate") -> dict[str, object]:
        client = await connect("127.0.0.1", self.port, ssl_context=self.tls)
        try:
            resp = await client.post(f"/{endpoint}?timeout=10s", json.dumps(review()).encode())
            assert resp is not None and resp.status == 200
            return resp.json["response"]  # type: ignore[no-any-return]
        finally:
            await client.aclose()

    async def metrics(self, port: int | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, text = await self.get("/metrics", port or self.metrics_port)
        assert status == 200
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    async def metric_sum(self, name: str, port: int | None = None) -> float:
        return sum(v for (n, _), v in (await self.metrics(port)).items() if n == name)

    async def wait_ready(self, timeout: float = 40) -> None:
        with trio.fail_after(timeout):
            while True:
                assert self.process.returncode is None, "the gateway exited before it was ready"
                try:
                    if (await self.get("/readyz"))[0] == 200:
                        return
                except (OSError, trio.TooSlowError):
                    pass  # the supervisor's socket accepts before any worker serves it
                await trio.sleep(0.1)

    def workers(self) -> set[int]:
        found = _children(self.process.pid)
        self.seen |= found
        return found


@asynccontextmanager
async def gateway(
    tmp_path: Path,
    *args: str,
    ready: bool = True,
    tls: ssl.SSLContext | None = None,
    workers: int | None = 2,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Gateway]:
    port = free_port()
    count = ["--workers", str(workers)] if workers is not None else []
    process = await trio.lowlevel.open_process(
        [
            sys.executable, "-m", "gateway", "--config", str(tmp_path / "config"),
            "--bind", f"127.0.0.1:{port}", *count, "--log-level", "warning",
            "--drain-seconds", "0.3", "--shutdown-timeout", "5", "--config-poll-seconds", "0.2", *args,
        ],
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    gw = Gateway(process, port, tmp_path / "config")
    gw.tls = tls
    try:
        if ready:
            await gw.wait_ready()
        yield gw
    finally:
        if process.returncode is None:
            gw.workers()
            process.terminate()  # a clean stop, so that the supervisor removes its run directory
            with trio.move_on_after(20):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
        for pid in gw.seen:  # workers left behind by a failed test
            with contextlib.suppress(OSError):
                if b"worker_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
async def allow_backend(nursery: trio.Nursery) -> str:
    from gateway.devtools.backends import serve_backend

    server = await nursery.start(
        lambda task_status: serve_backend(record_calls=False, task_status=task_status)
    )
    return f"http://127.0.0.1:{server.port}"


def _config(tmp_path: Path, base: str, path: str = "/allow", **fields: object) -> None:
    hooks = [backend("check.example.com", path, **fields)]
    hooks[0]["clientConfig"]["url"] = base + path
    write_config(tmp_path / "config", validating={"policy": hooks})


async def _review_until_both_workers_served(gw: Gateway, limit: int = 200) -> int:
    """Send reviews on new connections until both workers have answered some; returns how many."""
    sent = 0
    while sent < limit:
        for _ in range(10):
            assert (await gw.review())["allowed"] is True
            sent += 1
        await trio.sleep(0.6)  # > DUMP_SECONDS: the other worker's share is in /metrics
        per_worker = {
            k: v for k, v in (await gw.metrics()).items() if k[0] == "webhook_gateway_worker_reviews_total"
        }
        if len(per_worker) == 2 and all(v > 0 for v in per_worker.values()):
            return sent
    raise AssertionError(f"one worker served all {sent} reviews")


async def _eventually(check: object, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not await check():  # type: ignore[operator]
            await trio.sleep(0.2)


async def test_two_workers_share_the_socket_and_metrics_count_every_review(
    tmp_path: Path, allow_backend: str
) -> None:
    """Both workers answer reviews on the one port; /metrics on any worker counts all of them."""
    _config(tmp_path, allow_backend)
    metrics_port = free_port()
    async with gateway(tmp_path, "--metrics-bind", f"127.0.0.1:{metrics_port}") as gw:
        gw.metrics_port = metrics_port
        assert len(gw.workers()) == 2
        assert (await gw.get("/metrics"))[0] == 404, "the main listener leaves /metrics to --metrics-bind"
        sent = await _review_until_both_workers_served(gw)
        for _ in range(4):  # every scrape, whichever worker answers it, sees the same totals
            assert await gw.metric_sum("webhook_gateway_inbound_requests_total") == sent
            assert await gw.metric_sum("webhook_gateway_inbound_requests_total", metrics_port) == sent
            assert await gw.metric_sum("webhook_gateway_worker_reviews_total") == sent
            calls = await gw.metric_sum("webhook_gateway_admission_webhook_request_total")
            assert calls == sent
        got = await gw.metrics()
        assert got[("webhook_gateway_workers", ())] == 2
        assert got[("webhook_gateway_workers_ready", ())] == 2
        # open inbound connections are the sum over the workers, whichever worker holds them
        held = await connect("127.0.0.1", gw.port)
        try:
            resp = await held.post("/validate?timeout=10s", json.dumps(review()).encode())
            assert resp is not None and resp.status == 200

            async def one_open() -> bool:
                return await gw.metric_sum("webhook_gateway_inbound_open_connections") == 1

            await _eventually(one_open)
        finally:
            await held.aclose()


async def test_a_killed_worker_is_restarted_counted_and_reviews_keep_being_answered(
    tmp_path: Path, allow_backend: str
) -> None:
    """kill -9 of one worker: /readyz turns 503 until its successor is ready; counts survive; restarts=1."""
    _config(tmp_path, allow_backend)
    async with gateway(tmp_path) as gw:
        sent = await _review_until_both_workers_served(gw)
        await trio.sleep(0.6)  # both workers' counts are in their snapshots
        before = gw.workers()
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        seen_not_ready = False
        with trio.fail_after(40):
            while True:  # reviews keep being answered by the survivor meanwhile
                assert (await gw.review())["allowed"] is True
                sent += 1
                status, _ = await gw.get("/readyz")
                seen_not_ready |= status == 503
                now = gw.workers()
                if seen_not_ready and status == 200 and len(now) == 2:
                    break
                await trio.sleep(0.05)
        assert victim not in now and len(now - before) == 1
        await trio.sleep(0.6)
        got = await gw.metrics()
        assert sum(v for (n, _), v in got.items() if n == "webhook_gateway_worker_restarts_total") == 1
        assert await gw.metric_sum("webhook_gateway_inbound_requests_total") == sent


async def test_sigterm_drains_every_worker_and_exits_within_the_bound(
    tmp_path: Path, allow_backend: str
) -> None:
    """SIGTERM: /readyz 503 on every worker, in-flight reviews finish, all processes exit 0."""
    _config(tmp_path, allow_backend, "/sleep/800/allow")
    async with gateway(tmp_path, "--drain-seconds", "2") as gw:
        workers = gw.workers()
        answers: list[bool] = []

        async def in_flight() -> None:
            answers.append(bool((await gw.review())["allowed"]))

        async with trio.open_nursery() as inner:
            for _ in range(4):
                inner.start_soon(in_flight)
            await trio.sleep(0.3)
            gw.process.send_signal(signal.SIGTERM)
            await trio.sleep(0.3)  # the supervisor forwards it, each worker turns /readyz to 503
            for _ in range(4):
                assert (await gw.get("/readyz"))[0] == 503
        assert answers == [True] * 4
        # --drain-seconds 2 + --shutdown-timeout 5 + the supervisor's 5 s margin, and slack
        with trio.fail_after(2 + 5 + 5 + 5):
            assert await gw.process.wait() == 0
        assert not any(Path(f"/proc/{pid}").exists() and _zombie_or_alive(pid) for pid in workers)


def _zombie_or_alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


async def test_a_configuration_change_reaches_every_worker(tmp_path: Path, allow_backend: str) -> None:
    """CFG: both workers reload: successful loads go from 2 to 4, and reviews on both workers are denied."""
    _config(tmp_path, allow_backend)
    async with gateway(tmp_path) as gw:
        success = ("webhook_gateway_config_reloads_total", (("result", "success"),))
        assert (await gw.metrics())[success] == 2  # each worker's first load
        _config(tmp_path, allow_backend, "/deny/403/closed")

        async def reloaded() -> bool:
            return (await gw.metrics())[success] == 4

        await _eventually(reloaded, timeout=20)
        got = await gw.metrics()
        assert got[("webhook_gateway_config_generation", ())] == 2
        assert got[("webhook_gateway_config_last_reload_successful", ())] == 1
        before = {k: v for k, v in got.items() if k[0] == "webhook_gateway_worker_reviews_total"}
        for _ in range(40):
            for _ in range(5):
                assert (await gw.review())["allowed"] is False
            await trio.sleep(0.6)
            after = await gw.metrics()
            if all(after[k] > v for k, v in before.items()):
                break  # both workers denied with the new configuration
        else:
            raise AssertionError("one worker served every review")


async def test_readiness_is_false_until_every_worker_is_ready(
    tmp_path: Path, allow_backend: str, kube_api: FakeKubeAPI
) -> None:
    """MAT-33: one worker's first namespace list fails; /readyz stays 503 on every worker until it synced."""
    hooks = [backend("check.example.com", "/allow", namespaceSelector={"matchLabels": {"team": "a"}})]
    hooks[0]["clientConfig"]["url"] = allow_backend + "/allow"
    write_config(tmp_path / "config", validating={"policy": hooks})
    kubeconfig = write_kubeconfig(kube_api, tmp_path / "kubeconfig")
    kube_api.fail_lists = 1  # the first worker to list gets a 500 and retries after its back-off
    args = ("--namespace-source", "cluster", "--kubeconfig", str(kubeconfig))
    async with gateway(tmp_path, *args, ready=False) as gw:
        with trio.fail_after(40):
            while len(kube_api.lists()) < 2:  # one failed, one succeeded: one worker is ready
                await trio.sleep(0.02)
        for _ in range(4):
            status, _ = await gw.get("/readyz")
            if len(kube_api.lists()) > 2:
                break  # the retry already happened
            assert status == 503
        await gw.wait_ready()

        async def both_watching() -> bool:
            return len(kube_api.watches()) >= 2

        await _eventually(both_watching)
        # Namespace labels are watched once per worker: N lists (+1 retried) and N watches, no more.
        assert len(kube_api.lists()) == 3
        assert len(kube_api.watches()) == 2


BAD_STARTS = [
    pytest.param(
        {"bad.yaml": "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingWebhookConfiguration\n"
         "metadata: {name: x}\nwebhooks: [{name: bad}]\n"},
        (),
        2,
        id="CFG-23: a configuration refused at start stops every worker, exit code 2 as with one process",
    ),
    pytest.param(
        {},
        ("--certfile", "/nonexistent/tls.crt", "--keyfile", "/nonexistent/tls.key", "--allow-empty-config"),
        1,
        id="a serving certificate that cannot be read stops every worker, exit code 1 as with one process",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("files", "args", "code"), BAD_STARTS)
async def test_a_gateway_that_cannot_start_exits_instead_of_restarting_workers(
    tmp_path: Path, files: dict[str, str], args: tuple[str, ...], code: int
) -> None:
    (tmp_path / "config").mkdir()
    for name, text in files.items():
        (tmp_path / "config" / name).write_text(text)
    async with gateway(tmp_path, *args, ready=False) as gw:
        with trio.fail_after(40):
            assert await gw.process.wait() == code


WORKER_COUNTS = [
    pytest.param(1, {}, 0, id="--workers 1 is the single-process gateway: no supervisor, no child process"),
    pytest.param(None, {"WEBHOOK_GATEWAY_WORKERS": "3"}, 3, id="WEBHOOK_GATEWAY_WORKERS=3 without the flag: 3 workers"),
    pytest.param(1, {"WEBHOOK_GATEWAY_WORKERS": "3"}, 0, id="the flag wins over WEBHOOK_GATEWAY_WORKERS"),
]  # fmt: skip


@pytest.mark.parametrize(("workers", "env", "children"), WORKER_COUNTS)
async def test_worker_count_from_the_flag_or_the_environment(
    tmp_path: Path, allow_backend: str, workers: int | None, env: dict[str, str], children: int
) -> None:
    _config(tmp_path, allow_backend)
    async with gateway(tmp_path, workers=workers, env=env) as gw:
        assert (await gw.review())["allowed"] is True
        assert len(gw.workers()) == children


async def test_a_rotated_serving_certificate_reaches_every_worker(tmp_path: Path, allow_backend: str) -> None:
    """TRN: after the certificate files change, both workers present the new certificate."""
    _config(tmp_path, allow_backend)
    old_ca, new_ca = trustme.CA(), trustme.CA()
    pem = tmp_path / "tls.pem"
    old_ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(pem)
    old_trust, new_trust = ssl.create_default_context(), ssl.create_default_context()
    old_ca.configure_trust(old_trust)
    new_ca.configure_trust(new_trust)
    async with gateway(tmp_path, "--certfile", str(pem), "--keyfile", str(pem), tls=old_trust) as gw:
        new_ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(pem)
        gw.tls = new_trust  # from now on, only a connection presenting the new certificate succeeds

        async def both_rotated() -> bool:
            try:
                before = await gw.metrics()
                for _ in range(10):
                    assert (await gw.review())["allowed"] is True
                await trio.sleep(0.6)
                after = await gw.metrics()
            except (ssl.SSLError, trio.BrokenResourceError):
                return False  # a worker still presents the old certificate
            served = [
                after[k] - before.get(k, 0) for k in after if k[0] == "webhook_gateway_worker_reviews_total"
            ]
            return len(served) == 2 and all(n > 0 for n in served)

        await _eventually(both_rotated, timeout=30)


async def test_workers_stop_by_themselves_when_the_supervisor_is_killed(
    tmp_path: Path, allow_backend: str
) -> None:
    """kill -9 of the supervisor: its workers notice, drain and exit instead of serving on unsupervised."""
    _config(tmp_path, allow_backend)
    async with gateway(tmp_path) as gw:
        workers = gw.workers()
        assert len(workers) == 2
        run_dir = _run_dir_of(min(workers))
        assert run_dir.is_dir()
        gw.process.kill()
        await gw.process.wait()
        with trio.fail_after(30):
            while any(_zombie_or_alive(pid) for pid in workers):
                await trio.sleep(0.1)
        assert not run_dir.exists()  # the last worker out removed it


def _run_dir_of(worker: int) -> Path:
    """The supervisor's run directory, from the worker's memory map of its readiness flags."""
    for line in Path(f"/proc/{worker}/maps").read_text().splitlines():
        if line.endswith("/ready"):
            return Path(line.split()[-1]).parent
    raise AssertionError("the worker maps no readiness flags")


def test_a_negative_worker_count_is_a_one_line_error() -> None:
    """Bad input gets a clear error, not a traceback."""
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--workers", "-1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, "a bad option value, as argparse's own errors"
    assert result.stderr.strip() == (
        "webhook-gateway: error: --workers: -1 is not a number of processes (0: one per CPU)"
    )


async def test_rotated_backend_credentials_reach_every_worker(nursery: trio.Nursery, tmp_path: Path) -> None:
    """TRN-10/11: after --backend-kubeconfig changes, calls from both workers carry the new token."""
    from gateway.devtools.backends import serve_backend

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    _config(tmp_path, f"http://127.0.0.1:{server.port}")
    kubeconfig = tmp_path / "backends.kubeconfig"

    def write_token(token: str) -> None:
        doc = {"apiVersion": "v1", "kind": "Config", "users": [{"name": "*", "user": {"token": token}}]}
        kubeconfig.write_text(json.dumps(doc))  # JSON is YAML

    write_token("first")
    async with gateway(tmp_path, "--backend-kubeconfig", str(kubeconfig)) as gw:
        assert (await gw.review())["allowed"] is True
        assert server.calls[-1].header("authorization") == "Bearer first"
        write_token("second")

        async def both_rotated() -> bool:
            before = await gw.metrics()
            first_call = len(server.calls)
            for _ in range(10):
                assert (await gw.review())["allowed"] is True
            if any(c.header("authorization") != "Bearer second" for c in server.calls[first_call:]):
                return False  # a worker still sends the old token
            await trio.sleep(0.6)
            after = await gw.metrics()
            served = [
                after[k] - before.get(k, 0) for k in after if k[0] == "webhook_gateway_worker_reviews_total"
            ]
            return len(served) == 2 and all(n > 0 for n in served)

        await _eventually(both_rotated, timeout=30)


# --- one state per backend across workers (docs/resilience.md, "Several workers") --------------


def _policy_config(tmp_path: Path, base: str, policy: str, **fields: object) -> None:
    hooks = [backend("stalled.example.com", "/sleep/10000/allow", **fields)]
    hooks[0]["clientConfig"]["url"] = base + "/sleep/10000/allow"
    doc = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "team-a", "annotations": {"webhook-gateway.io/backend-policy": policy}},
        "webhooks": hooks,
    }
    (tmp_path / "config").mkdir(exist_ok=True)
    (tmp_path / "config" / "webhooks.json").write_text(json.dumps(doc))


async def _per_worker_reviews(gw: Gateway) -> dict[str, float]:
    return {
        dict(labels)["worker"]: value
        for (name, labels), value in (await gw.metrics()).items()
        if name == "webhook_gateway_worker_reviews_total"
    }


async def test_a_circuit_opened_by_failures_on_two_workers_is_open_on_every_worker(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """consecutiveFailures 3 counts the failures of every worker; once open, every review fails fast
    on whichever worker takes it (the refusal names the circuit, not a timeout), the backend is not
    called again, and /metrics shows the one circuit open once."""
    from gateway.devtools.backends import serve_backend

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    _policy_config(
        tmp_path,
        f"http://127.0.0.1:{server.port}",
        '"*": {circuitBreaker: {consecutiveFailures: 3, openSeconds: 600}}',
        timeoutSeconds=1,
        failurePolicy="Fail",
    )
    timed_out = "context deadline exceeded"
    refused = 'failed calling webhook "stalled.example.com": circuit open after 3 consecutive failures'
    async with gateway(tmp_path) as gw:
        # Three reviews on new connections: each worker may take any of them. With one state per
        # backend, the third failure opens the circuit wherever the first two happened.
        for _ in range(3):
            message = (await gw.review())["status"]["message"]  # type: ignore[index]
            assert timed_out in message, message
        assert len(server.calls) == 3
        before = await _per_worker_reviews(gw)
        followed = 0
        with trio.fail_after(60):
            while True:
                for _ in range(10):
                    answer = await gw.review()
                    assert answer["allowed"] is False
                    message = answer["status"]["message"]  # type: ignore[index]
                    # A worker still closed would call the backend and time out after 1 s instead.
                    assert refused in message, f"review {followed}: {message}"
                    followed += 1
                await trio.sleep(0.6)  # > DUMP_SECONDS: both workers' counts are in /metrics
                after = await _per_worker_reviews(gw)
                if len(after) == 2 and all(after[w] - before.get(w, 0) >= 3 for w in after):
                    break  # both workers answered several reviews since the circuit opened
        assert len(server.calls) == 3, "no worker called the backend once the circuit was open"
        got = await gw.metrics()
        webhook = (("webhook", "stalled.example.com"),)
        assert got[("webhook_gateway_backend_circuit_state", webhook)] == 1  # open, on every worker
        opened = (("state", "open"), ("webhook", "stalled.example.com"))
        assert got[("webhook_gateway_backend_circuit_transitions_total", opened)] == 1
        assert got[("webhook_gateway_shared_state_slots", (("state", "used"), ("table", "circuits")))] == 1
        assert got[("webhook_gateway_shared_state_refused_total", (("table", "circuits"),))] == 0


async def test_a_pod_ejected_by_one_worker_gets_no_call_from_any_worker(
    nursery: trio.Nursery, tmp_path: Path, kube_api: FakeKubeAPI
) -> None:
    """Endpoint ejection (3 consecutive connection failures) counts the failures of every worker and
    ejects the pod for all of them: no review on any worker meets the dead pod again.

    The EndpointSlices come from the fake kube-apiserver: the real one refuses loopback addresses in
    EndpointSlices, and the pods here are 127.0.0.x listeners."""
    import base64

    from gateway.devtools.backends import serve_backend

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("hook.team-a.svc").configure_cert(context)
    healthy = await nursery.start(
        lambda task_status: serve_backend(
            host="127.0.0.3", ssl_context=context, http1_only=True, task_status=task_status
        )
    )
    dead = trio.socket.socket()
    await dead.bind(("127.0.0.2", 0))  # bound, never listening: every connection is refused at once
    kube_api.put_slice("team-a", "hook-dead", "hook", dead.getsockname()[1], [("127.0.0.2", True, False)])
    kube_api.put_slice("team-a", "hook-ok", "hook", healthy.port, [("127.0.0.3", True, False)])
    service = {"namespace": "team-a", "name": "hook", "path": "/allow"}
    bundle = base64.b64encode(ca.cert_pem.bytes()).decode()
    entry = hook("pods.example.com", "", clientConfig={"service": service, "caBundle": bundle})
    write_config(tmp_path / "config", validating={"a": [entry]})
    kubeconfig = write_kubeconfig(kube_api, tmp_path / "kubeconfig")
    args = ("--namespace-source", "cluster", "--kubeconfig", str(kubeconfig))
    refused = 0
    try:
        async with gateway(tmp_path, *args) as gw:

            async def both_watching() -> bool:
                return (
                    sum(p.endswith("/endpointslices") and "watch" in q for p, q, _ in kube_api.requests) >= 2
                )

            await _eventually(both_watching)
            with trio.fail_after(60):
                while refused < 3:  # the dead pod is picked about every other call until ejected
                    answer = await gw.review()
                    if answer["allowed"] is False:
                        assert "connection refused" in answer["status"]["message"]  # type: ignore[index]
                        refused += 1
                before = await _per_worker_reviews(gw)
                while True:
                    for _ in range(10):
                        answer = await gw.review()
                        assert answer["allowed"] is True, f"after {refused} refusals: {answer}"
                    await trio.sleep(0.6)
                    after = await _per_worker_reviews(gw)
                    if len(after) == 2 and all(after[w] - before.get(w, 0) >= 10 for w in after):
                        break  # both workers answered ten reviews or more since the ejection
    finally:
        dead.close()


async def test_max_in_flight_bounds_the_calls_of_both_workers_together(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """maxInFlight 1 with two workers: while one call is in flight, reviews on either worker are
    refused at once (the refusal names the bulkhead); each burst of concurrent reviews reaches the
    backend once, also when both workers took some of it."""
    from gateway.devtools.backends import serve_backend

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    hooks = [backend("slow.example.com", "/sleep/2000/allow", failurePolicy="Fail")]
    hooks[0]["clientConfig"]["url"] = f"http://127.0.0.1:{server.port}/sleep/2000/allow"
    doc = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {
            "name": "team-a",
            "annotations": {"webhook-gateway.io/backend-policy": '"*": {maxInFlight: 1}'},
        },
        "webhooks": hooks,
    }
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "webhooks.json").write_text(json.dumps(doc))
    refused = "1 calls already in flight (maxInFlight 1)"
    async with gateway(tmp_path) as gw:
        with trio.fail_after(120):
            while True:
                before = await _per_worker_reviews(gw)
                calls = len(server.calls)
                answers: list[dict[str, object]] = []

                async def one(into: list[dict[str, object]]) -> None:
                    into.append(await gw.review())

                async with trio.open_nursery() as burst:
                    for _ in range(6):
                        burst.start_soon(one, answers)
                assert len(server.calls) - calls == 1, "one call in flight at a time, whichever worker"
                assert sorted(bool(a["allowed"]) for a in answers) == [False] * 5 + [True]
                for answer in answers:
                    if not answer["allowed"]:
                        assert refused in answer["status"]["message"]  # type: ignore[index]
                await trio.sleep(0.6)  # > DUMP_SECONDS: both workers' counts are in /metrics
                after = await _per_worker_reviews(gw)
                if len(after) == 2 and all(after[w] > before.get(w, 0) for w in after):
                    break  # a burst that both workers took part in


async def test_a_restarted_worker_finds_the_circuit_open(nursery: trio.Nursery, tmp_path: Path) -> None:
    """kill -9 of a worker once the circuit is open: its successor refuses at once too (it picks
    up the shared state), and the backend is not called again."""
    from gateway.devtools.backends import serve_backend

    server = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    _policy_config(
        tmp_path,
        f"http://127.0.0.1:{server.port}",
        '"*": {circuitBreaker: {consecutiveFailures: 1, openSeconds: 600}}',
        timeoutSeconds=1,
        failurePolicy="Fail",
    )
    refused = 'failed calling webhook "stalled.example.com": circuit open after 1 consecutive failures'
    async with gateway(tmp_path) as gw:
        assert "context deadline exceeded" in (await gw.review())["status"]["message"]  # type: ignore[index]
        assert len(server.calls) == 1
        before = gw.workers()
        for victim in sorted(before):  # each worker in turn: whichever held what, all restart
            os.kill(victim, signal.SIGKILL)
            with trio.fail_after(60):
                while True:
                    now = gw.workers()
                    if victim not in now and len(now) == 2 and (await gw.get("/readyz"))[0] == 200:
                        break
                    await trio.sleep(0.1)
        assert not gw.workers() & before, "both workers were replaced"
        baseline = await _per_worker_reviews(gw)
        with trio.fail_after(60):
            while True:
                for _ in range(10):
                    message = (await gw.review())["status"]["message"]  # type: ignore[index]
                    assert refused in message, message
                await trio.sleep(0.6)
                after = await _per_worker_reviews(gw)
                if len(after) == 2 and all(after[w] - baseline.get(w, 0) >= 3 for w in after):
                    break
        assert len(server.calls) == 1
