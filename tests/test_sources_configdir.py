"""Live configuration (CFG-25, ORD-04): the config directory and TLS files are polled and reloaded.

Real files in a temporary directory, real time with short poll intervals. The loader here is a tiny
stand-in with the loader's contract (``load(path, generation) -> Snapshot`` or ``ConfigError``);
one test uses the real ``gateway.config.load`` when it exists.
"""

from __future__ import annotations

import os
import shutil
import ssl
from collections.abc import Callable, Sequence
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
import yaml

from gateway.config.load import load_directory
from gateway.config.model import Snapshot
from gateway.errors import ConfigError, ConfigProblem
from gateway.sources.configdir import (
    ConfigStore,
    ReloadResult,
    fingerprint,
    watch_config_dir,
    watch_files,
)

INTERVAL = 0.01


def tiny_load(path: Path, generation: int) -> Snapshot:
    """Each visible *.yaml file (recursively) holds ``namespaces: {...}``, ``warn: msg`` or ``error: msg``."""
    namespaces: dict[str, dict[str, str]] = {}
    problems: list[ConfigProblem] = []
    for file in sorted(path.rglob("*.yaml")):
        if any(part.startswith(".") for part in file.relative_to(path).parts):
            continue
        doc = yaml.safe_load(file.read_text()) or {}
        name = str(file.relative_to(path))
        if "error" in doc:
            problems.append(ConfigProblem(file=name, message=doc["error"]))
        if "warn" in doc:
            problems.append(ConfigProblem(file=name, message=doc["warn"], severity="warning"))
        namespaces.update(doc.get("namespaces", {}))
    if any(p.severity == "error" for p in problems):
        raise ConfigError(problems)
    return Snapshot(namespaces=namespaces, generation=generation, warnings=tuple(problems))


def write_configmap(directory: Path, files: dict[str, str], version: int) -> None:
    """Lay out ``files`` as the kubelet does for a ConfigMap volume, swapping ``..data`` atomically."""
    stamp = directory / f"..2024_05_01_10_00_0{version}.{version:09d}"
    stamp.mkdir()
    for key, text in files.items():
        (stamp / key).write_text(text)
    old = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    (directory / "..data_tmp").symlink_to(stamp.name)
    (directory / "..data_tmp").rename(directory / "..data")
    for key in files:
        if not (directory / key).is_symlink():
            (directory / key).symlink_to(f"..data/{key}")
    for entry in directory.iterdir():
        if entry.is_symlink() and not entry.exists():
            entry.unlink()  # keys dropped from the ConfigMap
    if old:
        shutil.rmtree(directory / old)


class Reloads:
    """Collects on_reload reports and lets a test wait for the next one."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[tuple[ReloadResult, list[str]]](100)

    def __call__(self, result: ReloadResult, problems: Sequence[ConfigProblem]) -> None:
        self.send.send_nowait((result, [str(p) for p in problems]))

    async def next(self) -> tuple[ReloadResult, list[str]]:
        with trio.fail_after(10):  # turns a missed reload into a failure instead of a hang
            return await self.receive.receive()


async def _start(
    nursery: trio.Nursery,
    directory: Path,
    load: Callable[[Path, int], Snapshot] = tiny_load,
    interval: float = INTERVAL,
) -> tuple[ConfigStore, Reloads]:
    store = ConfigStore(load(directory, 0))
    reloads = Reloads()
    await nursery.start(
        lambda task_status: watch_config_dir(
            directory, store, load, interval=interval, on_reload=reloads, task_status=task_status
        )
    )
    return store, reloads


def _plain(directory: Path) -> None:
    (directory / "a.yaml").write_text("namespaces: {team-a: {team: a}}\n")


def _edit(d: Path) -> None:
    (d / "a.yaml").write_text("namespaces: {team-a: {team: a, tier: gold}}\n")


def _add(d: Path) -> None:
    (d / "b.yaml").write_text("namespaces: {team-b: {team: b}}\n")


def _remove(d: Path) -> None:
    (d / "a.yaml").unlink()


def _subdir(d: Path) -> None:
    (d / "more").mkdir()
    (d / "more" / "c.yaml").write_text("namespaces: {team-c: {}}\n")


def _rename_over(d: Path) -> None:
    # an editor's save: same size, new inode
    (d / "a.yaml.tmp").write_text("namespaces: {team-a: {team: A}}\n")
    (d / "a.yaml.tmp").rename(d / "a.yaml")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(
            _edit, {"team-a": {"team": "a", "tier": "gold"}}, id="CFG-25: an edited file is reloaded"
        ),
        pytest.param(
            _add, {"team-a": {"team": "a"}, "team-b": {"team": "b"}}, id="CFG-25: a new file is loaded"
        ),
        pytest.param(_remove, {}, id="CFG-25: a removed file's objects disappear"),
        pytest.param(
            _subdir, {"team-a": {"team": "a"}, "team-c": {}}, id="CFG-25: a file in a new subdirectory"
        ),
        pytest.param(
            _rename_over, {"team-a": {"team": "A"}}, id="CFG-25: a same-size file renamed over the old"
        ),
    ],
)
async def test_valid_change_is_swapped_in(
    tmp_path: Path, nursery: trio.Nursery, change: Callable[[Path], None], expected: dict[str, Any]
) -> None:
    """A valid change replaces the snapshot whole with the next generation; old readers keep theirs."""
    _plain(tmp_path)
    store, reloads = await _start(nursery, tmp_path)
    before = store.snapshot
    change(tmp_path)
    assert await reloads.next() == ("success", [])
    assert store.snapshot.generation == 1
    assert store.snapshot.namespaces == expected
    assert before.namespaces == {"team-a": {"team": "a"}}, "ORD-04: a snapshot already taken never changes"


async def test_invalid_change_is_refused(tmp_path: Path, nursery: trio.Nursery) -> None:
    """CFG-25: an invalid directory is refused with its problems; the last good snapshot keeps serving."""
    _plain(tmp_path)
    store, reloads = await _start(nursery, tmp_path)
    good = store.snapshot
    (tmp_path / "bad.yaml").write_text("error: 'webhooks[0].timeoutSeconds: Invalid value: 45'\n")
    assert await reloads.next() == ("failure", ["bad.yaml: webhooks[0].timeoutSeconds: Invalid value: 45"])
    assert store.snapshot is good
    (tmp_path / "bad.yaml").write_text("warn: 'sideEffects Unknown'\nnamespaces: {team-z: {}}\n")
    assert await reloads.next() == ("success", ["bad.yaml: sideEffects Unknown"])
    assert store.snapshot.generation == 1
    assert set(store.snapshot.namespaces) == {"team-a", "team-z"}


async def test_unreadable_directory_is_a_failed_reload(tmp_path: Path, nursery: trio.Nursery) -> None:
    """CFG-25: a directory that disappears is a failed reload naming it; the old snapshot stays."""
    config = tmp_path / "config"
    config.mkdir()
    _plain(config)
    store, reloads = await _start(nursery, config)
    good = store.snapshot
    shutil.rmtree(config)
    result, problems = await reloads.next()
    assert (result, len(problems)) == ("failure", 1)
    assert problems[0].startswith(f"{config}: ")
    assert store.snapshot is good


async def test_configmap_symlink_swap_is_detected(tmp_path: Path, nursery: trio.Nursery) -> None:
    """CFG-25: the kubelet's atomic ``..data`` symlink swap of a ConfigMap volume triggers a reload."""
    write_configmap(tmp_path, {"a.yaml": "namespaces: {team-a: {team: a}}\n"}, version=1)
    store, reloads = await _start(nursery, tmp_path)
    assert store.snapshot.namespaces == {"team-a": {"team": "a"}}
    before = fingerprint(tmp_path)
    write_configmap(tmp_path, {"a.yaml": "namespaces: {team-a: {team: b}}\n"}, version=2)
    assert fingerprint(tmp_path) != before
    assert await reloads.next() == ("success", [])
    assert store.snapshot.namespaces == {"team-a": {"team": "b"}}
    write_configmap(tmp_path, {"b.yaml": "namespaces: {team-b: {}}\n"}, version=3)
    assert await reloads.next() == ("success", [])
    assert store.snapshot.namespaces == {"team-b": {}}
    assert store.snapshot.generation == 2


async def test_no_change_no_reload(tmp_path: Path, nursery: trio.Nursery) -> None:
    """CFG-25: polling an unchanged directory (even with fresh reads of it) never reloads."""
    _plain(tmp_path)
    calls = count()

    def counting_load(path: Path, generation: int) -> Snapshot:
        next(calls)
        return tiny_load(path, generation)

    store, _ = await _start(nursery, tmp_path, counting_load)
    (tmp_path / "a.yaml").read_text()  # reading does not change what is polled
    await trio.sleep(INTERVAL * 30)
    assert next(calls) == 1, "only the start-up load ran"
    assert store.snapshot.generation == 0


async def test_baseline_catches_change_before_watch_start(tmp_path: Path, nursery: trio.Nursery) -> None:
    """CFG-25: a change between the start-up load and the watcher's start is not missed."""
    _plain(tmp_path)
    baseline = fingerprint(tmp_path)
    store = ConfigStore(tiny_load(tmp_path, 0))
    _add(tmp_path)
    reloads = Reloads()
    await nursery.start(
        lambda task_status: watch_config_dir(
            tmp_path,
            store,
            tiny_load,
            interval=INTERVAL,
            on_reload=reloads,
            baseline=baseline,
            task_status=task_status,
        )
    )
    assert await reloads.next() == ("success", [])
    assert "team-b" in store.snapshot.namespaces


_VALID = """\
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: team-a}
webhooks:
- name: check.team-a.example.com
  clientConfig: {url: "https://team-a.example.com/validate"}
  rules: [{operations: [CREATE], apiGroups: [""], apiVersions: [v1], resources: [pods]}]
  sideEffects: None
  admissionReviewVersions: [v1]
  timeoutSeconds: TIMEOUT
"""


async def test_real_loader_reload(tmp_path: Path, nursery: trio.Nursery) -> None:
    """CFG-11/CFG-25 with the real loader: a 45 s timeout is refused with its message, 5 s is loaded."""

    def load(path: Path, generation: int) -> Snapshot:
        return load_directory(path, strict_https=False, generation=generation)

    (tmp_path / "team-a.yaml").write_text(_VALID.replace("TIMEOUT", "10"))
    store, reloads = await _start(nursery, tmp_path, load)
    assert [w.timeout_seconds for w in store.snapshot.validating] == [10]
    (tmp_path / "team-a.yaml").write_text(_VALID.replace("TIMEOUT", "45"))
    result, problems = await reloads.next()
    assert result == "failure"
    assert any("the timeout value must be between 1 and 30 seconds" in p for p in problems)
    assert [w.timeout_seconds for w in store.snapshot.validating] == [10]
    (tmp_path / "team-a.yaml").write_text(_VALID.replace("TIMEOUT", "5"))
    assert (await reloads.next())[0] == "success"
    assert [w.timeout_seconds for w in store.snapshot.validating] == [5]
    assert store.snapshot.generation == 1


# --- single files: TLS certificate and key, caBundles, credentials ---------------------------------


def _issue(ca: trustme.CA, directory: Path) -> None:
    leaf = ca.issue_cert("webhook-gateway.webhook-gateway.svc")
    (directory / "tls.crt").write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    (directory / "tls.key").write_bytes(leaf.private_key_pem.bytes())


def _secret_volume(ca: trustme.CA, directory: Path, version: int) -> None:
    """A Secret volume update: new files in a timestamped directory, then the ``..data`` swap."""
    stamp = directory / f"..2024_05_01_10_00_0{version}.{version:09d}"
    stamp.mkdir()
    _issue(ca, stamp)
    old = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    (directory / "..data_tmp").symlink_to(stamp.name)
    (directory / "..data_tmp").rename(directory / "..data")
    for key in ("tls.crt", "tls.key"):
        if not (directory / key).is_symlink():
            (directory / key).symlink_to(f"..data/{key}")
    if old:
        shutil.rmtree(directory / old)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("plain", id="TLS rotation: certificate and key files rewritten in place"),
        pytest.param("secret-volume", id="TLS rotation: a Secret volume's ..data swap"),
    ],
)
async def test_tls_files_change_is_reported(tmp_path: Path, nursery: trio.Nursery, layout: str) -> None:
    """watch_files reports a rotated certificate/key pair in one call, and the new pair loads."""
    ca = trustme.CA()
    rotate = (
        (lambda v: _issue(ca, tmp_path)) if layout == "plain" else (lambda v: _secret_volume(ca, tmp_path, v))
    )
    rotate(1)
    paths = [tmp_path / "tls.crt", tmp_path / "tls.key"]
    changes, receive = trio.open_memory_channel[list[Path]](10)
    await nursery.start(
        lambda task_status: watch_files(
            paths,
            lambda changed: changes.send_nowait(list(changed)),
            interval=INTERVAL,
            task_status=task_status,
        )
    )
    old_cert = paths[0].read_bytes()
    rotate(2)
    with trio.fail_after(10):
        changed = await receive.receive()
    assert changed == paths
    assert paths[0].read_bytes() != old_cert
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(*paths)  # a matching pair


async def test_removed_file_is_reported(tmp_path: Path, nursery: trio.Nursery) -> None:
    """watch_files reports a credential file that disappears, and only that file."""
    keep, gone = tmp_path / "ca.crt", tmp_path / "token"
    keep.write_text("ca")
    gone.write_text("token")
    changes, receive = trio.open_memory_channel[list[Path]](10)
    await nursery.start(
        lambda task_status: watch_files(
            [keep, gone],
            lambda changed: changes.send_nowait(list(changed)),
            interval=INTERVAL,
            task_status=task_status,
        )
    )
    gone.unlink()
    with trio.fail_after(10):
        assert await receive.receive() == [gone]
