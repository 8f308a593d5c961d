"""Configuration changes are in force at once: inotify wakes the watcher, the poll is the safety net.

Each test runs ``watch_config_dir`` with a poll interval of an hour, so a reload that happens at all
was woken by the kernel's event (gateway/sources/fsevents.py); the last one takes inotify away and
shows the poll still finds the change. Measured through the apiserver, the delay from a changed
file to the new configuration in force went from 2.7-3.5 s (the 2 s poll and its settle round) to
about 0.14 s (``python -m loadtests.apiserver reload``, docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from gateway.sources import fsevents
from gateway.sources.configdir import ConfigStore
from tests.test_sources_configdir import Reloads, _start, write_configmap

HOUR = 3600.0


async def _watching(
    nursery: trio.Nursery, directory: Path, interval: float = HOUR
) -> tuple[ConfigStore, Reloads]:
    return await _start(nursery, directory, interval=interval)


def _rewrite(d: Path) -> None:
    (d / "a.yaml").write_text("namespaces: {team-a: {team: b}}\n")


def _rename_over(d: Path) -> None:
    (d / ".a.yaml.tmp").write_text("namespaces: {team-a: {team: b}}\n")
    (d / ".a.yaml.tmp").rename(d / "a.yaml")


def _new_subdirectory(d: Path) -> None:
    (d / "more").mkdir()
    (d / "more" / "b.yaml").write_text("namespaces: {team-a: {team: b}}\n")


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_rewrite, id="CFG-25: a file written in place is reloaded at once"),
        pytest.param(
            _rename_over, id="CFG-25: a file renamed over the old one (an editor's save) is reloaded at once"
        ),
        pytest.param(
            _new_subdirectory, id="CFG-25: a file in a subdirectory created after start is reloaded at once"
        ),
    ],
)
async def test_a_changed_file_is_reloaded_without_waiting_for_the_poll(
    nursery: trio.Nursery, tmp_path: Path, change: Callable[[Path], None]
) -> None:
    (tmp_path / "a.yaml").write_text("namespaces: {team-a: {team: a}}\n")
    store, reloads = await _watching(nursery, tmp_path)
    change(tmp_path)
    assert (await reloads.next())[0] == "success"
    assert store.snapshot.namespaces["team-a"] == {"team": "b"}


async def test_a_configmap_volume_swap_is_reloaded_at_once(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The kubelet renames ``..data`` in the volume's root; the files themselves never change."""
    write_configmap(tmp_path, {"a.yaml": "namespaces: {team-a: {team: a}}\n"}, 1)
    store, reloads = await _watching(nursery, tmp_path)
    write_configmap(tmp_path, {"a.yaml": "namespaces: {team-a: {team: b}}\n"}, 2)
    assert (await reloads.next())[0] == "success"
    assert store.snapshot.namespaces["team-a"] == {"team": "b"}


async def test_without_inotify_the_poll_still_reloads(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without inotify (NFS), or no inotify instance left: the poll finds the change."""
    monkeypatch.setattr(fsevents, "INotify", None)
    (tmp_path / "a.yaml").write_text("namespaces: {team-a: {team: a}}\n")
    store, reloads = await _watching(nursery, tmp_path, interval=0.01)
    _rewrite(tmp_path)
    assert (await reloads.next())[0] == "success"
    assert store.snapshot.namespaces["team-a"] == {"team": "b"}
