"""Loaded at start-up by a gateway the load tool starts with ``--gc-stats`` (this directory is put first
on its ``PYTHONPATH``): records every garbage collection's generation and pause through ``gc.callbacks``
and appends them to the file named by ``LOADTEST_GC_STATS``, one
``struct.pack("<dffi", end_on_the_monotonic_clock, pause_seconds, cpu_seconds, generation)`` each: the
pause on the wall clock, and the CPU the collecting thread used meanwhile (a pause is longer than
its CPU when the process waited for a CPU during it, as on a busy shared machine). A daemon thread
flushes the records every 0.2 s, so the gateway never writes the file on its event loop's thread.
"""

from __future__ import annotations

import gc
import os
import struct
import threading
import time

_path = os.environ.get("LOADTEST_GC_STATS")
if _path:
    _records: list[bytes] = []
    _started = [0.0, 0.0]
    _pack = struct.Struct("<dffi").pack
    _clock = time.perf_counter
    _cpu = time.thread_time
    _offset = time.monotonic() - time.perf_counter()

    def _on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _started[0], _started[1] = _clock(), _cpu()
        else:
            end, cpu = _clock(), _cpu()
            _records.append(_pack(end + _offset, end - _started[0], cpu - _started[1], info["generation"]))

    def _flush() -> None:
        with open(_path, "ab", buffering=0) as out:
            while True:
                time.sleep(0.2)
                if _records:
                    batch = _records[:]
                    del _records[: len(batch)]
                    out.write(b"".join(batch))

    gc.callbacks.append(_on_gc)
    threading.Thread(target=_flush, name="loadtest-gc-stats", daemon=True).start()
