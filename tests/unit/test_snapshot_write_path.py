"""The writer's hot path on local disk: serialised straight into the file, hashed on the way,
read back in chunks; the same bytes and checksums as serialising into memory first."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from pathlib import Path

import pytest
import torch

from snapshots import SnapshotStore, UnsafeStateError, _writer, layout
from snapshots._capture import Capturer
from snapshots._local_storage import CHUNK, LocalStorage
from snapshots.manifest import checksum, from_json
from snapshots.serialization import OWN_PAGES_BYTES, Stager, serialize, serialize_into


def _state() -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(CHUNK // 2, generator=gen)  # 2 MiB: written as it is, not gathered
    return {"w": {"big": big, "small": torch.arange(7)}, "meta": {"step": 3, "name": "x"}}


def test_streamed_bytes_and_checksum_equal_serialising_in_memory() -> None:
    sink = io.BytesIO()
    size, digest = serialize_into(_state(), sink, "sha256")
    data = serialize(_state())
    assert sink.getvalue() == data
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())


def test_local_save_never_holds_a_whole_serialised_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(obj: object) -> bytes:
        raise AssertionError("serialised into memory on the local write path")

    monkeypatch.setattr("snapshots._commit.serialize", refuse)
    monkeypatch.setattr("snapshots._catalog.Catalog.verify", refuse)  # read back in chunks
    with SnapshotStore(str(tmp_path), async_save=False) as store:
        store.save(3, _state())
        loaded = store.load(3).state
    assert torch.equal(loaded["w"]["big"], _state()["w"]["big"])  # type: ignore[index]
    manifest = from_json((tmp_path / layout.manifest_path(3)).read_bytes(), expected_step=3)
    for f in manifest.files:
        data = (tmp_path / layout.step_dir(3) / f.name).read_bytes()
        assert manifest.checksum_algorithm == "blake3"  # what new snapshots use
        assert (len(data), checksum(data, "blake3")) == (f.size, f.checksum)


def test_local_digest_reads_in_chunks_what_is_on_disk(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    data = bytes(range(256)) * (CHUNK // 100)  # a few chunks and a partial last one
    storage.write("a/file.bin", data)
    for algorithm in ("sha256", "blake3"):  # old snapshots' files, new ones'
        assert storage.digest("a/file.bin", algorithm) == (len(data), checksum(data, algorithm))
    assert (tmp_path / "a" / "file.bin").read_bytes() == data


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread nice values")
def test_asynchronous_saves_are_written_at_a_lower_cpu_priority(tmp_path: Path) -> None:
    seen: list[int] = []
    real = SnapshotStore._write

    def spy(self: SnapshotStore, job: object, **kwargs: object) -> object:
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))  # 0: the calling (writer) thread
        return real(self, job, **kwargs)  # type: ignore[arg-type]

    base = os.getpriority(os.PRIO_PROCESS, 0)
    with pytest.MonkeyPatch.context() as mp, SnapshotStore(str(tmp_path)) as store:
        mp.setattr(SnapshotStore, "_write", spy)
        store.save(1, _state()).result()
        store.save(2, _state(), blocking=True)
    assert seen[0] == min(19, base + _writer.WRITER_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the training thread keeps its own
    if os.geteuid() == 0:  # raising a thread's priority back needs root (or RLIMIT_NICE)
        assert seen[1] == base  # a blocking save (a final snapshot) is not slowed down


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_large_staging_buffers_have_pages_of_their_own() -> None:
    """Outside the malloc heap the training loop allocates from: long-lived buffers placed
    there by the first save made every later step fault ~18 MB of fresh pages."""
    stager = Stager()
    big = torch.randn(OWN_PAGES_BYTES)  # 4x the threshold, in float32
    staged = stager.capture({"w": {"big": big, "small": torch.ones(3)}})["w"]
    with open("/proc/self/maps") as maps:
        starts = {int(line.split("-", 1)[0], 16) for line in maps}
    assert staged["big"].data_ptr() in starts  # a mapping starts exactly at its data
    assert torch.equal(staged["big"], big) and torch.equal(staged["small"], torch.ones(3))
    again = stager.capture({"w": {"big": big * 2, "small": torch.ones(3)}})["w"]
    assert again["big"].data_ptr() == staged["big"].data_ptr()  # reused, not re-allocated


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # momentum buffers exist
    return model, opt


def _step_within(opt: torch.optim.Optimizer, seconds: float) -> bool:
    """opt.step() on another thread; whether it returned in time (it hung before)."""
    worker = threading.Thread(target=opt.step, daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive()


def test_optimizer_step_copies_itself_what_the_writer_has_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer kept off the CPU (busy node, low priority) must not hold up training."""
    model, opt = _model_and_optimizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    release = threading.Event()
    real = Capturer.finish_deferred

    def held(self: Capturer, job: object) -> None:
        assert release.wait(60)
        real(self, job)  # type: ignore[arg-type]

    monkeypatch.setattr(Capturer, "finish_deferred", held)
    with SnapshotStore(str(tmp_path)) as store:
        handle = store.save(1, {"model": model, "optimizer": opt}, overlap_with=opt)
        assert _step_within(opt, 30), "optimizer.step() waited for the held writer"
        release.set()
        handle.result()
        saved = store.load(1).state["model"]
    for key, value in before.items():
        assert torch.equal(saved[key], value)  # the weights from before that step
    assert not torch.equal(model.weight, before["weight"])


def test_a_refused_overlapped_save_leaves_the_optimizer_free(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    with SnapshotStore(str(tmp_path)) as store:
        with pytest.raises(UnsafeStateError):
            store.save(1, {"model": model, "optimizer": opt, "bad": object()}, overlap_with=opt)
        assert _step_within(opt, 30), "optimizer.step() waited for a save that never ran"
