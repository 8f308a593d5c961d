"""A compiled backend for the load tests (``--backend go``): ``loadtests/gobackend/main.go``, a
webhook that allows every review, in place of the Python fleet (``gateway.devtools.backends``).

Why: the load generator, the backends and the gateway share this machine's CPUs, and the Python
fleet spends about as much CPU per review as the gateway itself, so at 80 % of the gateway's
capacity the machine is saturated and an open-loop run measures the machine. In production the
apiserver, the gateway and its backends run on CPUs (or hosts) of their own. The Go backend answers
``POST /allow`` only (v1 and v1beta1 reviews, over h2 or HTTP/1.1 + TLS): scenarios whose backends
all allow, with no latency or error steps. Its CPU per review, measured beside the fleet's, is in
loadtests/README.md.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from loadtests import gobuild
from loadtests.processes import Certs, pinned

SOURCE = Path(__file__).resolve().parent / "gobackend"
PATH = "/allow"  # the one path it serves


def build() -> Path:
    """The backend's binary, built if its sources or the toolchain changed."""
    return gobuild.build(SOURCE)


def spawn(
    count: int, certs: Certs, *, http1_only: bool = False, cpus: set[int] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``count`` listeners in one Go process, as ``processes.spawn_fleet`` starts the Python
    ones: it prints the same ready line (``processes.fleet_ports`` reads it), and its CPU is read
    from ``/proc/<pid>/stat`` the same way. ``cpus``: on these CPUs only."""
    cmd = [str(build()), "-count", str(count)]
    cmd += ["-certfile", str(certs.certfile), "-keyfile", str(certs.keyfile)]
    if http1_only:
        cmd.append("-http1-only")
    return subprocess.Popen(pinned(cmd, cpus), stdout=subprocess.PIPE)  # noqa: S603  # our binary, list argv
