"""``webhook-gateway`` / ``python -m gateway``: the only reader of argv (``gateway.cli`` dispatches)."""

from __future__ import annotations

import sys

from gateway.cli import main

if __name__ == "__main__":
    sys.exit(main())
