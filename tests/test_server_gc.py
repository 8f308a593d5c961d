"""The serving gateway's garbage collector: start-up objects frozen, full collections rare.

docs/performance.md ("Why it collapses"): after ``gc.freeze()`` CPython's brake on full collections
never applies, and each one scans every open connection's objects; the gateway raises the oldest
generation's threshold from 10 to 100 once it serves.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from gateway.devtools.backends import serve_backend
from tests.support.inbound import start


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    gc.unfreeze()


async def test_a_serving_gateway_freezes_its_start_up_and_collects_in_full_ten_times_less_often(
    restored_gc: None, nursery: trio.Nursery, tmp_path: Path
) -> None:
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()
    backend = await nursery.start(lambda task_status: serve_backend(task_status=task_status))
    await start(nursery, tmp_path, f"http://127.0.0.1:{backend.port}/allow")
    assert gc.get_threshold() == (700, 10, 100)
    assert gc.get_freeze_count() > 0
