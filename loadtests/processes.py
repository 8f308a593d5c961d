"""The processes of a run: the backend fleet and the gateway, each separate so that their CPU is
measured apart (``/proc/<pid>/stat``), plus the TLS material they share."""

from __future__ import annotations

import contextlib
import math
import os
import random
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio

from loadtests.client import ConnectionLostError, Endpoint, Http1Connection

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (its threads included) and of its descendants.

    With ``--workers N`` the gateway is a supervisor and N worker processes: live workers are
    counted through ``/proc``, exited ones through the supervisor's ``cutime``/``cstime``.
    """
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    own = (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / _CLK_TCK
    return own + sum(_or_zero(proc_cpu_seconds, child) for child in _children(pid))


def proc_wait_seconds(pid: int, *, children: bool = True) -> float:
    """Seconds the main thread of ``pid`` (and of its descendants, with ``children``) spent runnable
    but waiting for a CPU (``/proc/<pid>/schedstat``, second field): on a shared machine, what others
    took from its event loop. NaN where the kernel keeps no schedstats."""
    try:
        own = int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan
    if not children:
        return own
    return own + sum(_or_zero(proc_wait_seconds, child) for child in _children(pid))


def proc_peak_rss_mb(pid: int) -> float:
    """Peak resident set size (VmHWM) of ``pid`` and its live descendants, summed, in MiB."""
    return _status_mb(pid, "VmHWM:")


def proc_rss_mb(pid: int) -> float:
    """Resident set size now (VmRSS) of ``pid`` and its live descendants, summed, in MiB."""
    return _status_mb(pid, "VmRSS:")


def _status_mb(pid: int, key: str) -> float:
    value = float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            value = int(line.split()[1]) / 1024
    return value + sum(_or_zero(lambda child: _status_mb(child, key), child) for child in _children(pid))


def _or_zero(measure: Callable[[int], float], pid: int) -> float:
    try:
        return measure(pid)
    except OSError:
        return 0.0  # a worker that exited between the listing and the reading


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def placement(pin: bool) -> tuple[set[int], set[int]] | None:
    """``--pin``: (the measured server's CPUs, everyone else's): the last CPU this process may use,
    and the others. None without ``pin``; a ValueError with fewer than 2 CPUs to split."""
    if not pin:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"--pin needs 2 CPUs or more to split (this process may use {len(cpus)})")
    return {cpus[-1]}, set(cpus[:-1])


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread ``pid`` has now to ``cpus`` (the threads it makes later inherit their
    creator's CPUs). A process that exits meanwhile is left alone."""
    try:
        tasks = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return
    for tid in tasks:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


_EXEC_PINNED = (
    "import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def pinned(argv: list[str], cpus: set[int] | None) -> list[str]:
    """``argv`` started on ``cpus`` from its first instruction (None: as it is): the process (same
    pid: it execs) and every thread or child it makes run there, with no window in which a thread
    started before it was pinned (a Go program starts its runtime's threads before ``main``)."""
    if cpus is None:
        return argv
    return [sys.executable, "-S", "-c", _EXEC_PINNED, ",".join(map(str, sorted(cpus))), *argv]


def cpus_of(pid: int) -> set[int]:
    """The CPUs any thread of ``pid`` may run on (the union over its threads; empty if it exited)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found |= os.sched_getaffinity(int(task.name))
    return found


_PORTS_GIVEN: set[int] = set()
_PORT_FLOOR = 20000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (also used as the dead backend's port), for a server
    started later by its number.

    Not ``bind(0)``: that hands out a port from the kernel's ephemeral range, which every outgoing
    connection (and the next ``bind(0)``) draws from too, so by the time the server binds, a
    connection or another server may hold it ("address already in use" — it failed CI once). The
    port comes from below the ephemeral range instead, is never handed out twice by this process,
    and is checked free by binding it."""
    low, high = _ephemeral_range()
    span = range(_PORT_FLOOR, low) if low - _PORT_FLOOR >= 1000 else range(high + 1, 65536)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(span)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {span.start}-{span.stop - 1} on {host} after 200 tries")


@dataclass(frozen=True)
class Certs:
    """A throwaway CA and one server certificate for 127.0.0.1/localhost, written as PEM files."""

    ca_pem: bytes
    certfile: Path
    keyfile: Path

    @classmethod
    def create(cls, directory: Path, key_type: str = "ecdsa") -> Certs:
        """``key_type``: "ecdsa" (P-256, what the project ships) or "rsa" (2048 bits)."""
        import trustme

        kind = {"ecdsa": trustme.KeyType.ECDSA, "rsa": trustme.KeyType.RSA}[key_type]
        ca = trustme.CA(key_type=kind)
        leaf = ca.issue_cert("127.0.0.1", "localhost", key_type=kind)
        certfile, keyfile = directory / "server.pem", directory / "server-key.pem"
        leaf.private_key_pem.write_to_path(str(keyfile))
        certfile.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        return cls(ca.cert_pem.bytes(), certfile, keyfile)


@contextlib.contextmanager
def managed(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """Terminate (then kill) ``proc`` when the block ends, whatever happens."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _env(
    root: Path | None = None, extra: dict[str, str] | None = None, *, first: Path | None = None
) -> dict[str, str]:
    """The environment of a child: ``root`` (default: this checkout) first on its import path (after
    ``first``, when given), plus the variables of ``extra``."""
    top = str(root or Path(__file__).resolve().parent.parent)
    if first is not None:
        top = str(first) + os.pathsep + top
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, **(extra or {}), "PYTHONPATH": top + (os.pathsep + path if path else "")}


def spawn_fleet(
    count: int, certs: Certs | None, *, http1_only: bool = False, cpus: set[int] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``count`` backend listeners in one separate process (``http1_only``: ALPN http/1.1 only;
    ``cpus``: on these CPUs only).

    Their HTTP/2 is lenient (no header checks in h2): the fleet stands in for compiled backends and
    shares this machine's cores with the gateway it measures, so what it spends is taken from the
    gateway (tests keep the strict default, which checks the gateway's framer).
    """
    cmd = [sys.executable, "-m", "gateway.devtools.backends", "--count", str(count), "--lenient-http2"]
    if http1_only:
        cmd.append("--http1-only")
    if certs is not None:
        cmd += ["--certfile", str(certs.certfile), "--keyfile", str(certs.keyfile)]
    return subprocess.Popen(pinned(cmd, cpus), stdout=subprocess.PIPE, env=_env())  # noqa: S603  # list argv


async def fleet_ports(proc: subprocess.Popen[bytes], timeout: float = 30) -> list[int]:
    """Read the fleet's ready line (its ports)."""
    assert proc.stdout is not None
    with trio.fail_after(timeout):
        line = await trio.to_thread.run_sync(proc.stdout.readline)
    if not line:
        raise RuntimeError(f"backend fleet exited with {proc.wait()} before it was ready")
    ports: list[int] = msgspec.json.decode(line)["ports"]
    return ports


def spawn_gateway(
    config_dir: Path,
    port: int,
    certs: Certs | None,
    log: Path,
    extra: list[str],
    *,
    tree: Path | None = None,
    env: dict[str, str] | None = None,
    gc_stats: Path | None = None,
    cpus: set[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``python -m gateway --config DIR --bind 127.0.0.1:PORT [--certfile --keyfile]``.

    ``tree``: the gateway of that source checkout instead of this one (``--baseline-tree``): it is
    the child's working directory, which ``python -m`` puts first on the import path. ``env``: more
    environment variables. ``gc_stats``: record its garbage collections into this file
    (``loadtests.gcstats``). ``cpus``: on these CPUs only.
    """
    cmd = [sys.executable, "-m", "gateway", "--config", str(config_dir), "--bind", f"127.0.0.1:{port}"]
    if certs is not None:
        cmd += ["--certfile", str(certs.certfile), "--keyfile", str(certs.keyfile)]
    if not any(arg.startswith("--workers") for arg in extra):
        # One process unless asked: CPU per review is read from this one pid's /proc/<pid>/stat.
        cmd += ["--workers", "1"]
    cmd += extra
    with log.open("wb") as out:
        return subprocess.Popen(  # noqa: S603  # our interpreter, list argv
            pinned(cmd, cpus),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_gateway_env(tree, env, gc_stats),
            cwd=tree,
        )


def _gateway_env(tree: Path | None, env: dict[str, str] | None, gc_stats: Path | None) -> dict[str, str]:
    from loadtests import gcstats

    env = dict(env or {})
    if gc_stats is not None:
        env.update(gcstats.env(gc_stats))
    return _env(tree, env, first=gcstats.HOOK_DIR if gc_stats is not None else None)


async def scrape_metrics(endpoint: Endpoint) -> str:
    """The gateway's ``GET /metrics`` text (its serving port)."""
    conn = await Http1Connection.open(endpoint)
    try:
        status, body = await conn.request(b"/metrics", b"", method=b"GET")
    finally:
        await conn.aclose()
    if status != 200:
        raise RuntimeError(f"GET /metrics answered HTTP {status}")
    return body.decode(errors="replace")


async def wait_ready(endpoint: Endpoint, proc: subprocess.Popen[bytes] | None, timeout: float = 30) -> None:
    """Poll ``GET /readyz`` until it answers 200 (fails if ``proc`` exits first)."""
    last = "no answer"
    with trio.move_on_after(timeout):
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode} before it was ready")
            try:
                conn = await Http1Connection.open(endpoint)
                try:
                    status, body = await conn.request(b"/readyz", b"", method=b"GET")
                finally:
                    await conn.aclose()
                if status == 200:
                    return
                last = f"HTTP {status}: {body[:200]!r}"
            except (OSError, ConnectionLostError) as exc:
                last = str(exc)
            await trio.sleep(0.1)
    raise RuntimeError(f"not ready after {timeout:g} s: {last}")


def tree_revision(tree: Path) -> str:
    """``git describe`` of a source checkout (a short commit, ``-dirty`` when changed), or ``?``."""
    try:
        done = subprocess.run(  # noqa: S603  # fixed argv
            ["git", "-C", str(tree), "describe", "--always", "--dirty"],  # noqa: S607  # git from PATH
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return done.stdout.strip() or "?"


def py_spy() -> str | None:
    """The ``py-spy`` executable next to this interpreter or on PATH, or None."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def spawn_profiler(exe: str, pid: int, out: Path, duration: float) -> subprocess.Popen[bytes]:
    """``py-spy record`` against ``pid`` (and its worker processes) for ``duration`` seconds: a flame
    graph, or collapsed stacks (one ``frame;frame;… count`` line each) when ``out`` ends in ``.txt``."""
    fmt = "raw" if out.suffix == ".txt" else "flamegraph"
    cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--output", str(out), "--format", fmt]
    cmd += ["--duration", str(max(1, math.ceil(duration))), "--nonblocking"]
    cmd += ["--rate", "1000"]  # py-spy's default 100/s leaves a lightly loaded phase a few dozen samples
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # noqa: S603  # list argv


def nginx() -> str | None:
    """The ``nginx`` executable (Debian ``nginx-light``), or None."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )


def write_nginx_conf(directory: Path, port: int, upstream: tuple[str, int], certs: Certs | None) -> Path:
    """One nginx process: a TLS (or plaintext) listener proxying every request to ``upstream`` over
    HTTP/1.1 keep-alive (TLS when the backends speak it), nothing written but its error log.

    Room for 16,384 connections: a client that dials whenever none is idle (client-go's policy)
    opens hundreds during a stall, and nginx's default 1,024 (client and upstream sides together)
    would make the floor line close connections for want of slots, not for want of speed."""
    directory.mkdir(parents=True, exist_ok=True)
    scheme = "https" if certs else "http"
    tls = (
        f"ssl_certificate {certs.certfile}; ssl_certificate_key {certs.keyfile};\n"
        "        proxy_ssl_session_reuse on; proxy_ssl_verify off;\n"
        if certs
        else ""
    )
    temp = "\n".join(
        f"    {kind}_temp_path {directory / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = directory / "nginx.conf"
    conf.write_text(
        f"""daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 20000;
pid {directory / "nginx.pid"};
error_log {directory / "error.log"} warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
{temp}
    client_body_buffer_size 64k;
    client_max_body_size 4m;
    proxy_buffer_size 64k;
    proxy_buffers 8 64k;
    upstream backend {{ server {upstream[0]}:{upstream[1]}; keepalive 32; }}
    server {{
        listen 127.0.0.1:{port}{" ssl" if certs else ""};
        keepalive_requests 1000000;
        {tls}
        location / {{
            proxy_pass {scheme}://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""
    )
    return conf


def spawn_nginx(exe: str, conf: Path, cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    """Start nginx in the foreground as one process (its CPU is read like the gateway's; ``cpus``: on
    these CPUs only)."""
    cmd = [exe, "-p", str(conf.parent), "-c", str(conf), "-e", str(conf.parent / "error.log")]
    return subprocess.Popen(pinned(cmd, cpus), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # noqa: S603  # list argv


async def wait_answering(endpoint: Endpoint, proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    """Poll until ``endpoint`` answers any HTTP request (fails if ``proc`` exits first)."""
    last = "no answer"
    with trio.move_on_after(timeout):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} before it answered")
            try:
                conn = await Http1Connection.open(endpoint)
                try:
                    await conn.request(b"/", b"", method=b"GET")
                finally:
                    await conn.aclose()
                return
            except (OSError, ConnectionLostError) as exc:
                last = str(exc)
            await trio.sleep(0.1)
    raise RuntimeError(f"not answering after {timeout:g} s: {last}")
