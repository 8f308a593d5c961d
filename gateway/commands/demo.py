"""``webhook-gateway demo``: sample backends, the gateway and a handful of reviews, on free ports.

Exit 0 when every step decided as the bundled configuration says (1 otherwise); ``--write-samples DIR``
writes the configuration and example objects the docs use instead.
"""

from __future__ import annotations

import argparse

from gateway.commands.options import Parser
from gateway.demo import DemoSettings

SUMMARY = "run the bundled end-to-end demonstration (a few seconds, free ports)"


def build_parser(prog: str) -> Parser:
    p = Parser(
        prog=prog,
        description="Start the sample backends and the gateway on free ports, send reviews as "
        "kube-apiserver would, and print each decision.",
    )
    p.add_option(
        "--config",
        help="demo configuration directory; URLs on 127.0.0.1:18081 are pointed at the sample backends",
        shown_default="the bundled gateway/data/demo",
    )
    p.add_option("--log-format", choices=("json", "console"), default="console", help="gateway log format")
    p.add_option(
        "--write-samples",
        metavar="DIR",
        help="instead of running: write the demo's configuration (DIR/config) and the example objects "
        "the docs use into DIR",
    )
    return p


def settings(options: argparse.Namespace) -> DemoSettings:
    return DemoSettings(
        config=options.config or None, log_format=options.log_format, write_samples=options.write_samples
    )


def run(options: DemoSettings) -> int:
    from gateway.demo import run_demo

    return run_demo(options)
