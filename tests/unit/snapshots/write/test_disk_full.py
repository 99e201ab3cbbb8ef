"""Disk full at several fill levels: the save fails cleanly, the previous snapshot stays the
newest and loads right, and saving works again once there is room."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from snapshots import SnapshotSaveError, SnapshotStore
from snapshots.format import layout
from snapshots.storage import Entry, LocalStorage, Storage


class Full:
    """Wraps a storage: writes fail with ENOSPC once ``capacity`` bytes have been written
    (nothing of the failing write lands, as LocalStorage removes its temp file)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.capacity: int | None = None
        self.used = 0

    def check(self, *, create: bool = True) -> None:
        self.inner.check(create=create)

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        if self.capacity is not None and self.used + len(data) > self.capacity:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        self.inner.write(path, data, exclusive=exclusive)
        self.used += len(data)

    def read(self, path: str) -> bytes:
        return self.inner.read(path)

    def list(self, path: str = "") -> list[Entry]:
        return self.inner.list(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)


def _state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=gen), "b": torch.randn(16, generator=gen)}


def _store(root: Path, **kwargs: object) -> tuple[SnapshotStore, Full]:
    full = Full(LocalStorage(str(root)))
    store = SnapshotStore(str(root), keep=3, storage=full, **kwargs)  # type: ignore[arg-type]
    return store, full


# Fractions of one save's bytes that still fit: none, part of the first file, all data but
# not the manifest (its bytes are the last few), everything but one byte.
LEVELS = [0.0, 0.01, 0.3, 0.6, 0.97, -1]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_fails_the_save_and_keeps_the_previous(
    tmp_path: Path, level: float, async_save: bool
) -> None:
    store, full = _store(tmp_path, async_save=async_save)
    store.save(1, _state(1)).result()
    one_save = full.used
    room = one_save - 1 if level == -1 else int(one_save * level)
    full.capacity, full.used = room, 0
    with pytest.raises(SnapshotSaveError, match="No space left"):
        store.save(2, _state(2)).result()
    latest = store.latest()
    assert latest is not None and latest.step == 1
    assert torch.equal(store.load().state["w"], _state(1)["w"])  # type: ignore[arg-type]
    assert not (tmp_path / layout.manifest_path(2)).exists()
    full.capacity = None  # room again: the next save commits and housekeeping tidies up
    store.save(3, _state(3)).result()
    store.close()
    assert [i.step for i in store.list()] == [1, 3]
    assert not (tmp_path / layout.step_dir(2)).exists()
