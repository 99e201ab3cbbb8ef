"""A sharded snapshot whose shard file is a link or a FIFO is damage, on the load path as on
verify: the load falls back to the older snapshot, never restores through a link and never
hangs on a FIFO.

A link's listed size is the length of the path it holds, so each link here holds a path
padded to the shard's own size: the listing alone cannot tell it from the real file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import SnapshotStore
from snapshots.distributed import DistributedSnapshotter
from snapshots.errors import NotRegularFileError
from snapshots.format import layout
from snapshots.storage import LocalStorage, read_range
from tests.unit.snapshots.sharded.test_sharded import _model_and_optimizer


def _two_sharded(root: Path) -> None:
    model, optimizer = _model_and_optimizer(0)
    snap = DistributedSnapshotter(SnapshotStore(str(root), keep=None), sharded=True)
    for step in (1, 2):
        snap.save(step, {"model": model, "optimizer": optimizer, "n": step}, blocking=True)
    snap.close()


def _shard(root: Path) -> Path:
    return next((root / layout.step_dir(2)).glob("shard-*.bin"))


def _link_of_length(link: Path, target: Path, length: int) -> None:
    """A symlink to ``target`` holding a path of exactly ``length`` bytes ("//", "./")."""
    folder, name = str(target.parent), target.name
    pad = length - len(folder) - 1 - len(name)
    assert pad >= 0, "the test's folder path is longer than the shard file"
    link.symlink_to(folder + "/" * (1 + pad % 2) + "./" * (pad // 2) + name)
    assert os.lstat(link).st_size == length


def _link_to_copy(shard: Path) -> None:
    copy = shard.parent.parent / "elsewhere.bin"
    shutil.copyfile(shard, copy)  # the very same bytes: only the link is wrong
    size = shard.stat().st_size
    shard.unlink()
    _link_of_length(shard, copy, size)


def _link_to_fifo(shard: Path) -> None:
    fifo = shard.parent.parent / "pipe"
    os.mkfifo(fifo)
    size = shard.stat().st_size
    shard.unlink()
    _link_of_length(shard, fifo, size)


def _fifo(shard: Path) -> None:
    shard.unlink()
    os.mkfifo(shard)


CASES: dict[str, Callable[[Path], None]] = {
    "link of the shard's length to a valid copy": _link_to_copy,
    "link of the shard's length to a FIFO": _link_to_fifo,
    "FIFO": _fifo,
}


@pytest.mark.timeout(60)  # a FIFO opened for reading waits for a writer: fail, never hang
@pytest.mark.parametrize("case", list(CASES))
def test_a_shard_that_is_no_regular_file_is_damage_and_the_load_falls_back(
    tmp_path: Path, case: str
) -> None:
    root = tmp_path / "snaps"
    _two_sharded(root)
    CASES[case](_shard(root))
    store = SnapshotStore(str(root), create=False)
    assert not store.verify(2).ok
    fresh, _ = _model_and_optimizer(1)
    with capture_logs() as logs:
        loaded = DistributedSnapshotter(store).load(into={"model": fresh})
    assert loaded is not None and loaded.info.step == 1 and loaded.state["n"] == 1
    corrupt = [e for e in logs if e["event"] == "snapshot.corrupt"]
    assert [e["step"] for e in corrupt] == [2]
    original, _ = _model_and_optimizer(0)
    torch.testing.assert_close(fresh.state_dict(), original.state_dict(), rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_a_range_read_follows_no_link_and_waits_on_no_fifo(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    storage.write("real.bin", b"0123456789")
    (tmp_path / "link.bin").symlink_to(tmp_path / "real.bin")
    os.mkfifo(tmp_path / "pipe.bin")
    assert read_range(storage, "real.bin", 2, 5) == b"23456"
    for name in ("link.bin", "pipe.bin"):
        with pytest.raises(NotRegularFileError):
            read_range(storage, name, 0, 1)
