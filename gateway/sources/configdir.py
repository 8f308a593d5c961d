"""Live configuration: the current ``Snapshot`` and the pollers that replace it (CFG-25, ORD-04).

``ConfigStore`` holds one immutable ``Snapshot``; a review reads ``store.snapshot`` once when it
starts and keeps that object to the end, so a reload never changes what an in-flight review sees.
``watch_config_dir`` polls the configuration directory and swaps in a new snapshot only when the
whole directory loads; otherwise the old one keeps serving and ``on_reload`` reports the problems.
``watch_files`` is the same poller for single files (serving certificate and key, backend caBundle
and credential files).

How a change is noticed: the kernel's inotify events on the directory itself and its visible
subdirectories (``gateway.sources.fsevents``) wake the watcher at once; it waits until the writer
has been quiet for ``SETTLE_SECONDS`` and compares a fingerprint (a stat of every file, following
symlinks). A ConfigMap or Secret volume is updated by the kubelet with an atomic rename of the
``..data`` symlink: the directory's watch sees the rename, and the fingerprint records the link's
target. The poll every ``interval`` stays as the safety net for what inotify cannot report
(network filesystems, the watch limit): there a change is acted on once two consecutive polls agree.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Literal, NoReturn

import trio

from gateway.config.model import Snapshot
from gateway.errors import ConfigError, ConfigProblem
from gateway.sources.fsevents import DirectoryEvents

ReloadResult = Literal["success", "failure"]
Loader = Callable[[Path, int], Snapshot]
"""``load(directory, generation)`` returns a validated Snapshot or raises ``ConfigError``."""
OnReload = Callable[[ReloadResult, Sequence[ConfigProblem]], None]
"""Called after each reload attempt: ("success", warnings) or ("failure", problems)."""

# (relative path, inode, mtime ns, ctime ns, size) per entry; directories and the ConfigMap
# ``..data`` link contribute entries too.
FileState = tuple[str, int, int, int, int]
Fingerprint = tuple[FileState, ...]

_DATA_LINK: Final = "..data"
SETTLE_SECONDS: Final = 0.1  # after an event, how long the directory must stay quiet before a reload
SETTLE_LIMIT_SECONDS: Final = 2.0  # a directory written to without pause is read after this long anyway


class ConfigStore:
    """The configuration in force; reading ``snapshot`` is atomic, replacing it swaps it whole."""

    __slots__ = ("_snapshot",)

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def replace(self, snapshot: Snapshot) -> None:
        """Make ``snapshot`` the one new reviews see; reviews already running keep theirs."""
        self._snapshot = snapshot

    def __repr__(self) -> str:
        return f"<ConfigStore {self._snapshot!r}>"


def _state(rel: str, st: os.stat_result) -> FileState:
    return (rel, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


def fingerprint(directory: Path) -> Fingerprint:
    """A cheap summary of ``directory`` that changes whenever a file the loader reads changes.

    Hidden entries are not walked (the loader skips them, and a ConfigMap mount's timestamped
    directories are reached through the visible symlinks), but the ``..data`` link target is
    recorded, so the kubelet's atomic swap is seen even when sizes and times happen to agree.
    Empty when ``directory`` is missing or not a directory.
    """
    states: list[FileState] = []
    try:
        st = directory.stat()
    except OSError:
        return ()
    if not stat.S_ISDIR(st.st_mode):
        return ()
    states.append(_state(".", st))
    try:
        target = os.readlink(directory / _DATA_LINK)
        states.append((f"{_DATA_LINK} -> {target}", 0, 0, 0, 0))
    except OSError:
        pass
    _walk(directory, "", states)
    return tuple(states)


def _walk(directory: Path, prefix: str, states: list[FileState]) -> None:
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        rel = prefix + entry.name
        try:
            st = entry.stat()  # follows symlinks: a ConfigMap key is a link into ..data/
        except OSError:
            states.append((rel, -1, 0, 0, 0))  # dangling link, or removed while walking
            continue
        states.append(_state(rel, st))
        if stat.S_ISDIR(st.st_mode):
            _walk(Path(entry.path), rel + "/", states)


def file_state(path: Path) -> FileState | None:
    """The (following symlinks) state of one file, ``None`` when it does not exist."""
    try:
        return _state(str(path), path.stat())
    except OSError:
        return None


async def watch_config_dir(
    path: Path,
    store: ConfigStore,
    load: Loader,
    *,
    interval: float = 1.0,
    on_reload: OnReload | None = None,
    baseline: Fingerprint | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Reload ``path`` when it changes (CFG-25): woken by inotify, else by a poll every ``interval``.

    After an event the directory must be quiet for ``SETTLE_SECONDS``; after a poll, two
    consecutive polls must agree: so a file still being written is not read half-way. A valid
    directory becomes ``store.snapshot`` with the next generation; an invalid one (``ConfigError``,
    or the directory missing or unreadable) leaves the store alone. Pass the ``fingerprint()`` taken
    before the start-up load as ``baseline`` so that no change in between is missed.
    """
    report = on_reload or _ignore_reload
    seen = fingerprint(path) if baseline is None else baseline
    events = DirectoryEvents(path)
    task_status.started()
    try:
        while True:
            woken = await events.wait(interval)
            if woken:
                await events.settle(SETTLE_SECONDS, at_most=SETTLE_LIMIT_SECONDS)
            current = fingerprint(path)
            if current == seen:
                continue
            if not woken:
                await trio.sleep(interval)
                if fingerprint(path) != current:
                    continue  # still changing: look again next round
            seen = current
            await _reload(path, current, store, load, report)
    finally:
        events.close()


async def _reload(
    path: Path, current: Fingerprint, store: ConfigStore, load: Loader, report: OnReload
) -> None:
    if not current:
        # The directory itself is gone (volume unmounted, path replaced by a file): loading
        # "nothing" would be a valid, empty configuration, and would drop every backend.
        report("failure", [ConfigProblem(file=str(path), message="not a readable directory")])
        return
    generation = store.snapshot.generation + 1
    try:
        # Loading parses YAML and compiles CEL: run it off the event loop so that reviews in
        # flight are not stalled for the duration of a reload.
        snapshot = await trio.to_thread.run_sync(load, path, generation)
    except ConfigError as exc:
        report("failure", exc.problems)
        return
    except OSError as exc:
        report("failure", [ConfigProblem(file=str(path), message=exc.strerror or str(exc))])
        return
    store.replace(snapshot)
    report("success", snapshot.warnings)


def _ignore_reload(result: ReloadResult, problems: Sequence[ConfigProblem]) -> None:
    return


async def watch_files(
    paths: Sequence[Path],
    on_change: Callable[[Sequence[Path]], None],
    *,
    interval: float = 1.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Call ``on_change(changed_paths)`` when any of ``paths`` changes (contents, inode, removal).

    For certificate/key pairs: both files are reported in one call when they change within the
    same settle window, which is always the case for a Secret volume's atomic swap. The callback
    should load the new files and keep the old state if they do not load.
    """
    seen = [file_state(p) for p in paths]
    task_status.started()
    while True:
        await trio.sleep(interval)
        current = [file_state(p) for p in paths]
        if current == seen:
            continue
        await trio.sleep(interval)
        if [file_state(p) for p in paths] != current:
            continue
        changed = [p for p, old, new in zip(paths, seen, current, strict=True) if old != new]
        seen = current
        on_change(changed)
