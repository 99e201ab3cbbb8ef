"""Damaged snapshots are detected before deserialising, reported, and skipped."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import (
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotNotFoundError,
    SnapshotStore,
)
from snapshots.format import layout
from tests.tamper import EXPLOITS, resign


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(step)), "step": step}


def _two_snapshots(root: Path) -> SnapshotStore:
    store = SnapshotStore(str(root), async_save=False, keep=None)
    store.save(1, _state(1))
    store.save(2, _state(2))
    return store


def _data_file(root: Path, step: int) -> Path:
    folder = root / layout.step_dir(step)
    return next(p for p in folder.iterdir() if "-w." in p.name)


def _manifest(root: Path, step: int) -> Path:
    return root / layout.manifest_path(step)


def _truncate(root: Path) -> None:
    f = _data_file(root, 2)
    f.write_bytes(f.read_bytes()[:-7])


def _flip(root: Path) -> None:
    f = _data_file(root, 2)
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x40
    f.write_bytes(bytes(data))


def _delete(root: Path) -> None:
    _data_file(root, 2).unlink()


def _garbage_manifest(root: Path) -> None:
    _manifest(root, 2).write_bytes(b'{"format_version": 1, "step": 2, "fil')


def _edit_manifest(root: Path, change: Callable[[dict], None]) -> None:
    body = json.loads(_manifest(root, 2).read_bytes())
    change(body)
    _manifest(root, 2).write_text(json.dumps(body))


def _future_version(root: Path) -> None:
    _edit_manifest(root, lambda b: b.update(format_version=99))


def _escaping_name(root: Path) -> None:
    (root / "secret.pt").write_bytes(b"outside")

    def change(body: dict) -> None:
        body["files"][0]["name"] = "../secret.pt"

    _edit_manifest(root, change)


DAMAGE = {
    "truncated": (_truncate, "bytes"),
    "flipped byte": (_flip, "checksum"),
    "deleted file": (_delete, "missing"),
    "garbage manifest": (_garbage_manifest, "JSON"),
    "future format version": (_future_version, "format_version 99"),
    "name escaping the prefix": (_escaping_name, "escapes"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_detected_reported_and_skipped(tmp_path: Path, kind: str) -> None:
    store = _two_snapshots(tmp_path)
    damage, words = DAMAGE[kind]
    damage(tmp_path)
    result = store.verify(2)
    assert not result.ok and words in " ".join(result.problems)
    with capture_logs() as logs:
        latest = store.latest()
        loaded = store.load()
    assert latest is not None and latest.step == 1
    assert loaded.info.step == 1 and torch.equal(loaded.state["w"], _state(1)["w"])
    corrupt = [e for e in logs if e["event"] == "snapshot.corrupt"]
    assert [e["step"] for e in corrupt] == [2, 2]
    assert all(words in e["problem"] for e in corrupt)
    with pytest.raises(SnapshotCorruptError):
        store.load(2)


def test_no_valid_snapshot_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    store = _two_snapshots(tmp_path)
    _flip(tmp_path)
    _data_file(tmp_path, 1).unlink()
    with pytest.raises(NoValidSnapshotError, match="none passes verification"):
        store.latest()
    with pytest.raises(NoValidSnapshotError):
        store.load()


def test_empty_store_has_no_latest_and_load_says_so(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path), async_save=False)
    assert store.latest() is None
    with pytest.raises(SnapshotNotFoundError):
        store.load()
    with pytest.raises(SnapshotNotFoundError):
        store.load(5)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("exploit", list(EXPLOITS))
def test_malicious_pickle_with_a_valid_checksum_does_not_execute(
    tmp_path: Path, exploit: str
) -> None:
    root = tmp_path / "snaps"
    store = SnapshotStore(str(root), async_save=False)
    store.save(3, _state(3))
    sentinel = tmp_path / "pwned"
    resign(root, 3, lambda f: f.get("key") == "w", EXPLOITS[exploit](sentinel))
    assert store.verify(3).ok  # the checksum cannot catch it; the loader must
    with pytest.raises(SnapshotCorruptError, match="cannot be loaded safely"):
        store.load(3)
    with pytest.raises(NoValidSnapshotError):
        store.load()
    assert not sentinel.exists()
