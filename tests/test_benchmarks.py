"""The benchmarks run and report what their docstrings promise (the figures themselves live in
docs/performance.md: no timing is asserted here)."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks import bench_connection, bench_tls_read

ROOT = Path(__file__).resolve().parent.parent
# A small run: enough connections to read a difference in clock ticks, one repeat.
SMALL = ("--connections", "200", "--clients", "2", "--repeat", "1")


def run_bench_connection(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``benchmarks/bench_connection.py`` run as a user runs it."""
    return subprocess.run(
        [sys.executable, "benchmarks/bench_connection.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(
    "key_type",
    [
        pytest.param(
            "ecdsa",
            id="bench_connection --nginx: the gateway's and nginx's cost of a new connection, same run, ECDSA",
        ),
        pytest.param(
            "rsa",
            id="bench_connection --nginx: the gateway's and nginx's cost of a new connection, same run, RSA",
        ),
    ],
)
def test_bench_connection_beside_nginx(key_type: str) -> None:
    proc = run_bench_connection("--nginx", "--key-type", key_type, *SMALL, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(rf"^{key_type}: server CPU per request: new connection \d+ µs", proc.stdout, re.M), (
        proc.stdout
    )
    assert re.search(
        rf"^{key_type}: nginx: new connection \d+ µs, keep-alive \d+ µs; a new connection costs -?\d+ µs; "
        r"the gateway's = (-?[\d.]+x|- \(too few connections to tell\)) nginx's$",
        proc.stdout,
        re.M,
    ), proc.stdout


_PERF_REPORT = """# To display the perf.data header info, please use --header/--header-only options.
#
# Overhead  Shared Object
# ........  ...........................
#
    46.80%  libpython3.11.so.1.0
    25.02%  libcrypto.so.3
    16.37%  [kernel.kallsyms]
     7.02%  libc.so.6
     4.08%  libssl.so.3
     0.16%  _socket.cpython-311-x86_64-linux-gnu.so
     0.15%  select.cpython-311-x86_64-linux-gnu.so
     0.11%  [vdso]
"""


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        pytest.param(
            _PERF_REPORT,
            {
                "Python interpreter": 0.468,
                "OpenSSL crypto (libcrypto)": 0.2502,
                "kernel": 0.1637,
                "libc": 0.0702,
                "OpenSSL TLS (libssl)": 0.0408,
                "Python extension modules": 0.0031,
                "other": 0.0011,
            },
            id="bench_connection --perf: perf's samples per library add up per part of the server",
        ),
        pytest.param(
            "    47.89%  libcrypto.so.3\n    32.98%  [kernel.kallsyms]\n     3.12%  nginx\n",
            {"OpenSSL crypto (libcrypto)": 0.4789, "kernel": 0.3298, "nginx": 0.0312},
            id="bench_connection --perf: nginx's own code is a part of its own",
        ),
        pytest.param(
            "# only comments\n#\n", {}, id="bench_connection --perf: a report without samples has no parts"
        ),
    ],
)
def test_bench_connection_perf_shares(report: str, expected: dict[str, float]) -> None:
    assert bench_connection.shares(report) == pytest.approx(expected)


def test_bench_connection_perf_names_what_it_counts_as_other() -> None:
    """bench_connection --perf: the libraries counted as "other" are named, most samples first."""
    assert bench_connection.unnamed(_PERF_REPORT) == ["[vdso]"]


@pytest.mark.parametrize(
    ("fresh", "kept", "expected"),
    [
        pytest.param(
            {"kernel": 0.4, "OpenSSL crypto (libcrypto)": 0.6},
            {"kernel": 1.0},
            {
                "OpenSSL crypto (libcrypto)": (240.0, 0.0, 240.0),
                "kernel": (160.0, 50.0, 110.0),
                "nginx": (0.0, 0.0, 0.0),
                "OpenSSL TLS (libssl)": (0.0, 0.0, 0.0),
                "libc": (0.0, 0.0, 0.0),
            },
            id="bench_connection --perf: a listed part without a sample is a row of zeros, not missing",
        ),
        pytest.param(
            {"nginx": 0.5, "other": 0.5},
            {"nginx": 1.0},
            {
                "nginx": (200.0, 50.0, 150.0),
                "other": (200.0, 0.0, 200.0),
                "OpenSSL crypto (libcrypto)": (0.0, 0.0, 0.0),
                "OpenSSL TLS (libssl)": (0.0, 0.0, 0.0),
                "libc": (0.0, 0.0, 0.0),
                "kernel": (0.0, 0.0, 0.0),
            },
            id="bench_connection --perf: a part not listed appears when it has samples, largest first",
        ),
    ],
)
def test_bench_connection_perf_rows(
    fresh: dict[str, float], kept: dict[str, float], expected: dict[str, tuple[float, float, float]]
) -> None:
    listed = ("nginx", "OpenSSL crypto (libcrypto)", "OpenSSL TLS (libssl)", "libc", "kernel")
    rows = bench_connection.breakdown_rows(fresh, kept, (400.0, 50.0, 350.0), listed)
    assert {part: tuple(round(us, 6) for us in row) for part, row in rows.items()} == expected
    assert list(rows) == list(expected)


@pytest.mark.skipif(
    shutil.which("perf") is None, reason="perf is not installed (Debian: apt-get install linux-perf)"
)
def test_bench_connection_perf_beside_nginx() -> None:
    """bench_connection --perf --nginx: each server's CPU per request split by library, both servers."""
    proc = run_bench_connection("--nginx", "--perf", *SMALL, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for server, own in (("gateway", "Python interpreter"), ("nginx", "nginx")):
        table = proc.stdout.split(f"ecdsa: {server}: where the CPU went", 1)
        assert len(table) == 2, proc.stdout
        # Every listed part has its row, sampled or not (a short run may take no sample of nginx's code).
        for part in (own, "OpenSSL crypto (libcrypto)", "OpenSSL TLS (libssl)", "libc", "kernel"):
            assert re.search(rf"^  {re.escape(part)} +\d+ +\d+ +-?\d+$", table[1], re.M), (part, proc.stdout)
        # Both servers spend most of a new connection in libcrypto and the kernel.
        crypto = re.search(r"^  OpenSSL crypto \(libcrypto\) +(\d+) ", table[1], re.M)
        assert crypto is not None and int(crypto[1]) > 0, proc.stdout


def test_bench_connection_refuses_perf_with_profile() -> None:
    """bench_connection: --perf and --profile (cProfile) together are refused with one line, exit 2."""
    proc = run_bench_connection("--perf", "--profile", "out.prof", timeout=60)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1].endswith("--perf and --profile measure apart: give one of them")
    )


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        pytest.param(
            ("--requests", "50", "--repeat", "1"),
            0,
            r"request of 8400 bytes in 3 TLS records.*\n.*the gateway's\): +\d+\.\d µs\n"
            r".*memory BIO: +\d+\.\d µs\n  the memory BIO saves -?\d+\.\d µs per request",
            id="bench_tls_read: the gateway's way of reading records beside a memory BIO, same client",
        ),
        pytest.param(
            ("--records", "1100,0"),
            2,
            r"--records: one or more sizes in bytes, each at least 1",
            id="bench_tls_read: a record size below one byte is refused with one line, exit 2",
        ),
    ],
)
def test_bench_tls_read(args: tuple[str, ...], code: int, expected: str) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_tls_read.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == code, proc.stderr[-2000:]
    assert re.search(expected, proc.stdout + proc.stderr), proc.stdout + proc.stderr


def _tls_client(port: int, ca_pem: str, ending: str) -> None:
    """Handshakes, sends part of a request, then ends as ``ending`` says."""
    context = ssl.create_default_context(cadata=ca_pem)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
        tls.sendall(b"x" * 100)
        if ending == "close_notify":
            with contextlib.suppress(OSError):
                tls.unwrap()  # sends close_notify, then waits for the server's (which never comes)
        elif ending == "silent":
            time.sleep(2)
        elif ending == "reset":
            tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        tls.close()


@pytest.mark.parametrize("kind", ["socket", "bio"])
@pytest.mark.parametrize(
    ("ending", "message"),
    [
        pytest.param(
            "close", "the client closed the connection", id="a client that closes mid-request ends the run"
        ),
        pytest.param(
            "close_notify",
            "the client closed the connection",
            id="a client that sends close_notify mid-request ends the run",
        ),
        pytest.param(
            "reset",
            "the client closed the connection",
            id="a client that resets mid-request ends the run (as a close with the server's tickets unread does)",
        ),
        pytest.param("silent", "the client sent nothing for 0.5 s", id="a silent client ends the run"),
    ],
)
def test_bench_tls_read_readers_end_on_a_client_that_is_gone(kind: str, ending: str, message: str) -> None:
    """bench_tls_read: each reader ends with one line, within its bound, when its client goes away or
    falls silent mid-request (it must not spin or wait for ever)."""
    ca_pem, context = bench_tls_read.server_context()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = threading.Thread(target=_tls_client, args=(listener.getsockname()[1], ca_pem, ending))
        client.start()
        raw, _ = listener.accept()
    make = bench_tls_read.socket_reader if kind == "socket" else bench_tls_read.bio_reader
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            read, _ = make(raw, context, 8400, silence=0.5)
            read()
        except BaseException as exc:  # the outcome is checked below
            outcome.append(exc)

    reader = threading.Thread(target=run, daemon=True)  # daemon: a reader that spins must not hang the run
    reader.start()
    reader.join(timeout=10)
    client.join(timeout=10)
    raw.close()
    assert not reader.is_alive(), "the reader neither read a request nor gave up"
    assert len(outcome) == 1 and isinstance(outcome[0], SystemExit), outcome
    assert str(outcome[0]) == message
