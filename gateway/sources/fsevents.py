"""Wake-ups for the configuration directory: the kernel's inotify events where there are any.

``DirectoryEvents(root).wait(timeout)`` returns True as soon as something under ``root`` changed
(a file written, created, removed or renamed, in ``root`` or a visible subdirectory), or False when
``timeout`` passed without a word. It never decides what changed: the caller compares fingerprints
(``gateway.sources.configdir``), so an event it cannot interpret costs one comparison, and a change
it never hears about (a filesystem without inotify, such as NFS, or a watch limit reached) is still
found by the caller's poll, just later.

A ConfigMap or Secret volume is updated by the kubelet with a rename of the ``..data`` symlink in the
volume's root directory: the directory's own watch sees that rename (``IN_MOVED_TO``), although the
files the loader reads (symlinks through ``..data``) never change themselves.

The inotify descriptor is read without blocking, from trio's ``wait_readable``: no thread.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import structlog
import trio

log = structlog.get_logger(__name__)

try:  # Linux; elsewhere the caller's poll is all there is
    from inotify_simple import INotify, flags

    _MASK: int = (
        flags.CREATE | flags.DELETE | flags.MODIFY | flags.CLOSE_WRITE | flags.ATTRIB
        | flags.MOVED_TO | flags.MOVED_FROM | flags.DELETE_SELF | flags.MOVE_SELF
    )  # fmt: skip
except ImportError:  # pragma: no cover - not Linux
    INotify = None
    _MASK = 0


class DirectoryEvents:
    """inotify watches on ``root`` and its visible subdirectories; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._inotify: Any = None
        self._watched: set[str] = set()
        if INotify is None:
            return
        try:
            self._inotify = INotify(nonblocking=True)
        except OSError as exc:  # e.g. the per-user instance limit
            log.warning("no inotify: the configuration directory is polled only", error=str(exc))
            return
        self._rewatch()

    @property
    def active(self) -> bool:
        """True when the kernel reports changes (else only the caller's poll finds them)."""
        return self._inotify is not None and bool(self._watched)

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def _rewatch(self) -> None:
        """Watch ``root`` and every visible subdirectory (new ones appear with the events)."""
        if self._inotify is None:
            return
        directories = [self.root]
        with contextlib.suppress(OSError):
            for current, subdirs, _files in os.walk(self.root, followlinks=True):
                subdirs[:] = [d for d in subdirs if not d.startswith(".")]
                directories += [Path(current) / d for d in subdirs]
        watched = set()
        for directory in directories:
            try:
                self._inotify.add_watch(str(directory), _MASK)  # idempotent for a watched path
            except OSError:
                continue  # gone meanwhile, or the watch limit: the poll still covers it
            watched.add(str(directory))
        self._watched = watched

    def _drain(self) -> bool:
        """Read every pending event; True when there was any."""
        try:
            return bool(self._inotify.read(timeout=0))
        except OSError:
            return False

    async def wait(self, timeout: float) -> bool:
        """Until a change is reported (True) or ``timeout`` seconds pass (False)."""
        if self._inotify is None:
            await trio.sleep(timeout)
            return False
        if not self._watched:
            self._rewatch()  # the directory did not exist at the last look
        with trio.move_on_after(timeout):
            while True:
                await trio.lowlevel.wait_readable(self._inotify.fileno())
                if self._drain():
                    self._rewatch()
                    return True
        self._rewatch()
        return False

    async def settle(self, quiet: float, *, at_most: float) -> None:
        """Until ``quiet`` seconds pass without another event (a writer done), ``at_most`` in all."""
        with trio.move_on_after(at_most):
            while await self.wait(quiet):
                pass
