"""How a sharded save writes and checks its files: row-block chunks that tile the shard file,
no read-back of any shard file at save time (damage is caught at load and by verify), and
no commit when a rank's write fails."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from snapshots import SnapshotSaveError, SnapshotStore
from snapshots.distributed import DistributedSnapshotter
from snapshots.format import layout, sharding
from snapshots.format.serialization import Stager
from snapshots.sharded import shards as _shards
from snapshots.storage import LocalStorage


class Recording:
    """A storage that records reads of shard files and can damage what it stores."""

    def __init__(self, inner: Any, *, damage_shards: bool = False) -> None:
        self.inner, self.url = inner, inner.url
        self.damage_shards = damage_shards
        self.whole_reads: list[str] = []
        self.range_bytes = 0

    def check(self, *, create: bool = True) -> None:
        self.inner.check(create=create)

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        if self.damage_shards and _is_shard(path):
            data = bytearray(data)
            data[len(data) // 3] ^= 0x01  # stored with one bit flipped
        self.inner.write(path, bytes(data), exclusive=exclusive)

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        if _is_shard(path):
            self.whole_reads.append(path)
        return self.inner.read(path, limit=limit)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        if _is_shard(path):
            self.range_bytes += length
        return self.inner.read_range(path, start, length)

    def list(self, path: str = "") -> list[Any]:
        return self.inner.list(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)


def _is_shard(path: str) -> bool:
    return path.rsplit("/", 1)[-1].startswith("shard-")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Linear(40, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(store: SnapshotStore) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = _model()
    snap = DistributedSnapshotter(store, sharded=True)
    try:
        snap.save(1, {"model": model, "optimizer": optimizer}, blocking=True)
    finally:
        snap.close()
    return model, optimizer


def test_tensors_are_stored_as_row_blocks_that_tile_the_shard_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_shards, "CHUNK_BYTES", 256)  # a 40x8 float32 weight: 8 rows a chunk
    model, optimizer = _save(SnapshotStore(str(tmp_path), keep=None))
    folder = tmp_path / layout.step_dir(1)
    table = sharding.from_json(next(folder.glob("shards.*.json")).read_bytes())
    weight = table.tensors[sharding.fqn(["model", "0.weight"])]
    assert [c.offsets for c in weight.chunks] == [(r, 0) for r in range(0, 40, 8)]
    assert all(c.sizes == (8, 8) and c.nbytes == 256 for c in weight.chunks)
    # Back to back, no padding: every byte of the file is under some chunk's checksum.
    (shard,) = folder.glob("shard-*.bin")
    spans = sorted((c.byte_offset, c.nbytes) for _, c in table.files()[shard.name])
    ends = [0] + [start + length for start, length in spans]
    assert [start for start, _ in spans] == ends[:-1] and ends[-1] == shard.stat().st_size
    fresh, fresh_opt = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    DistributedSnapshotter(SnapshotStore(str(tmp_path), create=False)).load(
        into={"model": fresh, "optimizer": fresh_opt}
    )
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(
        fresh_opt.state_dict()["state"], optimizer.state_dict()["state"], rtol=0, atol=0
    )


def test_a_load_reads_consecutive_chunks_in_one_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_shards, "CHUNK_BYTES", 256)  # dozens of chunks, one shard file
    _save(SnapshotStore(str(tmp_path), keep=None))
    recording = Recording(LocalStorage(str(tmp_path)))
    store = SnapshotStore(str(tmp_path), create=False, storage=recording)
    calls = []
    read_range = recording.read_range

    def counted(path: str, start: int, length: int) -> bytes:
        calls.append(path)
        return read_range(path, start, length)

    recording.read_range = counted  # type: ignore[method-assign]
    fresh, fresh_opt = _model()
    DistributedSnapshotter(store).load(into={"model": fresh, "optimizer": fresh_opt})
    (shard,) = (tmp_path / layout.step_dir(1)).glob("shard-*.bin")
    assert len(calls) == 1 and recording.range_bytes == shard.stat().st_size


def test_a_sharded_save_reads_no_shard_file_back(tmp_path: Path) -> None:
    recording = Recording(LocalStorage(str(tmp_path)))
    store = SnapshotStore(str(tmp_path), keep=None, storage=recording)
    _save(store)
    assert recording.whole_reads == [] and recording.range_bytes == 0
    assert SnapshotStore(str(tmp_path), create=False).verify(1).ok


def test_a_shard_file_stored_damaged_is_caught_at_load_and_by_verify(tmp_path: Path) -> None:
    """The save does not read its shard file back (its chunks are hashed from the buffer
    it wrote): damage on the way to storage commits, and every reader catches it."""
    _save(SnapshotStore(str(tmp_path), keep=None))
    damaging = Recording(LocalStorage(str(tmp_path)), damage_shards=True)
    store = SnapshotStore(str(tmp_path), keep=None, storage=damaging)
    model, optimizer = _model()
    snap = DistributedSnapshotter(store, sharded=True)
    snap.save(2, {"model": model, "optimizer": optimizer}, blocking=True)
    snap.close()
    reader = SnapshotStore(str(tmp_path), create=False)
    assert reader.committed_steps() == [1, 2]  # the damaged save committed
    result = reader.verify(2)
    (shard,) = (tmp_path / layout.step_dir(2)).glob("shard-*.bin")
    assert not result.ok and any(shard.name in p for p in result.problems)
    fresh, fresh_opt = _model()
    loaded = DistributedSnapshotter(reader).load(into={"model": fresh, "optimizer": fresh_opt})
    assert loaded is not None and loaded.info.step == 1  # fell back past the damaged one


def test_a_rank_whose_shard_write_fails_commits_nothing(tmp_path: Path) -> None:

    class Failing(Recording):
        def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
            if _is_shard(path):
                raise OSError(28, "No space left on device")
            super().write(path, data, exclusive=exclusive)

    failing = Failing(LocalStorage(str(tmp_path)))
    store = SnapshotStore(str(tmp_path), keep=None, storage=failing)
    with pytest.raises(SnapshotSaveError, match="No space left"):
        _save(store)
    assert SnapshotStore(str(tmp_path), create=False).committed_steps() == []


def test_an_overlapped_sharded_save_copies_step_tensors_before_the_step_changes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer thread is held before its deferred copy: optimizer.step()'s hook copies the
    shards' tensors itself (a hook that copied only format-1 tensors would let the step change
    the weights before the writer copied them)."""
    held, gate = threading.Event(), threading.Event()
    copy_deferred = Stager.copy_deferred

    def hold_the_writer(stager: Stager) -> None:
        if threading.current_thread() is not threading.main_thread() and stager.deferred:
            held.set()
            gate.wait(timeout=60)
        copy_deferred(stager)

    monkeypatch.setattr(Stager, "copy_deferred", hold_the_writer)
    model, optimizer = _model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    store = SnapshotStore(str(tmp_path), keep=None)
    snap = DistributedSnapshotter(store, sharded=True)
    snap.save(1, {"model": model, "optimizer": optimizer}, overlap_with=optimizer)
    assert held.wait(timeout=30)  # the call returned before the parameters were copied
    assert not store._capturer.copy_done.is_set()
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # copies what is left, then changes the weights
    gate.set()
    snap.close()
    assert not torch.equal(model.state_dict()["0.weight"], saved["0.weight"])
    fresh, _ = _model()
    DistributedSnapshotter(SnapshotStore(str(tmp_path), create=False)).load(into={"model": fresh})
    torch.testing.assert_close(fresh.state_dict(), saved, rtol=0, atol=0)
