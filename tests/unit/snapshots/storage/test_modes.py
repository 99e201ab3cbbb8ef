"""What local storage creates is its user's alone (0700 folders, 0600 files), or readable by
the group with ``group_access`` (0750/0640), whatever the umask; a folder that was there
before keeps its mode (``snapshots.storage.modes``)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from snapshots import Owner, SnapshotStore
from snapshots.format import layout


@pytest.fixture(params=[0o022, 0o000], ids=["umask 022", "umask 000"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _modes_below(top: Path) -> dict[str, int]:
    """Every folder and file below ``top`` (itself excluded): path -> mode."""
    return {str(p.relative_to(top)): _mode(p) for p in sorted(top.rglob("*"))}


def _store(root: Path, *, group_access: bool) -> SnapshotStore:
    options = {"group_access": True} if group_access else None
    owner = Owner(job_id="job", run_token="1")
    return SnapshotStore(str(root), keep=1, async_save=False, owner=owner, storage_options=options)


def _save_three(store: SnapshotStore) -> None:
    """Three saves, keep 1: two snapshots pruned, their large file set aside (``.reuse``)
    and written over by the next save."""
    for step in (1, 2, 3):
        store.save(step, {"w": torch.full((1 << 19,), float(step))})  # 2 MB: set aside
    store.close()


@pytest.mark.parametrize(
    ("group_access", "folder", "file"), [(False, 0o700, 0o600), (True, 0o750, 0o640)]
)
def test_every_folder_and_file_created_has_the_mode_whatever_the_umask(
    tmp_path: Path, umask: int, group_access: bool, folder: int, file: int
) -> None:
    _save_three(_store(tmp_path / "runs" / "job", group_access=group_access))
    found = _modes_below(tmp_path)
    assert {"runs/job/owner.json", f"runs/job/{layout.REUSE_DIR}"} <= set(found)
    assert any(p.startswith(f"runs/job/{layout.step_dir(3)}/") for p in found)
    expected = {p: (folder if (tmp_path / p).is_dir() else file) for p in found}
    assert found == expected


def test_a_set_aside_file_takes_the_mode_of_the_save_that_reuses_it(
    tmp_path: Path, umask: int
) -> None:
    root = tmp_path / "run"
    _save_three(_store(root, group_access=True))
    (aside,) = (root / layout.REUSE_DIR).iterdir()
    assert _mode(aside) == 0o640
    inode = aside.stat().st_ino
    store = _store(root, group_access=False)
    store.save(4, {"w": torch.zeros(1 << 19)})
    store.close()
    (data,) = (root / layout.step_dir(4)).glob("000-*.pt")
    assert data.stat().st_ino == inode  # the set-aside file, written over
    assert _mode(data) == 0o600


def test_a_folder_that_was_there_keeps_its_mode(tmp_path: Path, umask: int) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o755)
    _save_three(_store(mine, group_access=False))
    assert _mode(mine) == 0o755
    assert _mode(mine / layout.step_dir(3)) == 0o700
    assert _mode(mine / "owner.json") == 0o600
