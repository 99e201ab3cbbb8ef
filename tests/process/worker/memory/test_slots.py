"""The in-memory tier's copy path: one copy straight into a slot file kept mapped from step to
step (``slots``, ``byte_layout.write_into``), checksummed (``byte_layout.CHECKSUM_ALGORITHM``)."""

from __future__ import annotations

import errno
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import weakref

import blake3
import pytest
import torch
from structlog.testing import capture_logs

from elastic_trainer.worker.memory import byte_layout, slots
from elastic_trainer.worker.memory import tier as memory_tier
from elastic_trainer.worker.memory.plan import (
    SLOTS,
    Copy,
    part_bounds,
    part_marker,
    shares,
    stale_file,
)
from elastic_trainer.worker.memory.tier import MemoryTier, NodeCopies
from snapshots.format import serialization

ALGORITHM = byte_layout.CHECKSUM_ALGORITHM
MARKER = part_marker(SLOTS[0], 0)  # a one-rank node's marker of the copy in its first slot


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with a bfloat16 layer and a non-contiguous buffer, and Adam (0-dim step
    tensors), after ``steps`` steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4))
    model[1].to(torch.bfloat16)
    model.register_buffer("odd", torch.arange(48.0).reshape(6, 8).t())
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(steps):
        out = model[1](model[0](torch.randn(8, 16)).to(torch.bfloat16))
        out.float().sum().backward()
        optimizer.step()
    return model, optimizer


def _assert_same(back: object, saved: object) -> None:
    """Bit-identical: every tensor equal with its dtype and shape, every other value equal."""
    if isinstance(saved, torch.Tensor):
        assert isinstance(back, torch.Tensor) and back.dtype == saved.dtype
        assert back.shape == saved.shape and torch.equal(back, saved)
    elif isinstance(saved, dict):
        assert isinstance(back, dict) and back.keys() == saved.keys()
        for key in saved:
            _assert_same(back[key], saved[key])
    else:
        assert back == saved


def test_each_copy_is_the_state_of_its_step_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setattr(byte_layout, "CHUNK_BYTES", 256)  # large tensors: piece by piece
    copies = NodeCopies(str(tmp_path))
    model, optimizer = _trained(0)
    for step in range(1, 5):
        model, optimizer = _trained(step)
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        copies.write(step, {"step": step, "state": saved})
        _assert_same(copies.read(step)["state"], saved)


def test_an_empty_tensor_comes_back_with_its_shape_and_dtype(tmp_path):
    # An uneven FSDP2 shard can be empty; torch.frombuffer refuses a count of 0.
    saved = {"empty": torch.empty(0, 7, dtype=torch.bfloat16), "full": torch.arange(5.0)}
    copies = NodeCopies(str(tmp_path))
    copies.write(1, {"step": 1, "state": saved})
    _assert_same(copies.read(1)["state"], saved)
    with open(tmp_path / "copy.bin", "wb") as f:  # the file path (byte_layout.write)
        digest = byte_layout.write({"state": saved}, f)
    data = bytearray((tmp_path / "copy.bin").read_bytes())
    byte_layout.verify(data, digest, "copy.bin")
    _assert_same(byte_layout.read(data)["state"], saved)


def test_a_slot_is_mapped_once_and_copied_into_in_place(tmp_path):
    copies = NodeCopies(str(tmp_path))
    inodes = set()
    for step in range(1, 7):
        copies.write(step, {"step": step, "w": torch.full((300_000,), float(step))})
        inodes.add(os.stat(tmp_path / SLOTS[(step + 1) % 2]).st_ino)
    assert [copies.slots[s].maps for s in SLOTS] == [1, 1]  # no new file, no new mapping
    assert len(inodes) == 2
    copies.write(7, {"step": 7, "w": torch.full((900_000,), 7.0)})  # the layout grew
    assert [copies.slots[s].maps for s in SLOTS] == [2, 1]
    assert torch.equal(copies.read(7)["w"], torch.full((900_000,), 7.0))


def test_a_slot_removed_while_mapped_is_made_again(tmp_path):
    copies = NodeCopies(str(tmp_path))
    copies.write(1, {"step": 1, "w": torch.ones(10)})
    copies.write(2, {"step": 2, "w": torch.ones(10)})
    copies.keep_only(None)  # a restore from storage forgets every copy
    assert sorted(os.listdir(tmp_path)) == sorted(SLOTS) and copies.newest() is None
    with open("/proc/self/maps") as f:  # the folder can go: no mapping keeps its pages
        assert str(tmp_path) not in f.read()
    for slot in SLOTS:
        os.unlink(tmp_path / slot)
    copies.write(3, {"step": 3, "w": torch.full((10,), 3.0)})
    assert torch.equal(copies.read(3)["w"], torch.full((10,), 3.0))


def test_the_copy_after_a_restore_writes_into_the_pages_the_node_has(tmp_path):
    """A restore forgets the other copies but keeps their slot files: the next copy (the
    just-in-time one at the next failure) writes into pages already there, not a new file."""
    copies = NodeCopies(str(tmp_path))
    for step in (3, 4):
        copies.write(step, {"step": step, "w": torch.full((300_000,), float(step))})
    copies.keep_only(4)  # the group resumed from step 4 (slot 1)
    before = os.stat(tmp_path / SLOTS[0])
    after_restore = NodeCopies(str(tmp_path))  # a new worker process
    after_restore.write(5, {"step": 5, "w": torch.full((300_000,), 5.0)})
    now = os.stat(tmp_path / SLOTS[0])
    assert (now.st_ino, now.st_blocks) == (before.st_ino, before.st_blocks)
    assert torch.equal(after_restore.read(5)["w"], torch.full((300_000,), 5.0))


def test_a_slot_keeps_its_mapping_while_the_copy_changes_size_a_little():
    grain = slots.GRAIN_BYTES
    assert slots.fits(grain, grain - 10) and slots.fits(4 * grain, 3 * grain)
    assert not slots.fits(grain, grain + 1)  # too small
    assert not slots.fits(10 * grain, grain)  # far too big: re-made smaller


def _flip_last_byte(path, size: int) -> None:
    data = bytearray(path.read_bytes())
    data[size - 1] ^= 0xFF
    path.write_bytes(bytes(data))


def _recommit(folder, algorithm: str, digest: str) -> None:
    """The marker, with ``digest`` under ``algorithm`` as the only checksum."""
    marker = json.loads((folder / MARKER).read_text())
    marker = {k: v for k, v in marker.items() if k != ALGORITHM}
    marker[algorithm] = digest
    (folder / MARKER).write_text(json.dumps(marker))


def test_a_copy_checksummed_by_another_algorithm_is_not_used(tmp_path):
    copies = NodeCopies(str(tmp_path))
    copies.write(4, {"step": 4, "w": torch.ones(100)})
    size = json.loads((tmp_path / MARKER).read_text())["bytes"]
    data = (tmp_path / SLOTS[0]).read_bytes()[:size]
    _recommit(tmp_path, "blake3", blake3.blake3(data).hexdigest())  # right, but not ours
    with pytest.raises(ValueError, match=f"no valid {ALGORITHM} checksum"):
        copies.read(4)
    _recommit(tmp_path, ALGORITHM, blake3.blake3(data).hexdigest()[:32])  # misnamed
    with pytest.raises(ValueError, match=f"fails its {ALGORITHM} checksum"):
        copies.read(4)


def test_a_copy_that_stops_halfway_leaves_the_committed_one(tmp_path, monkeypatch):
    copies = NodeCopies(str(tmp_path))
    copies.write(1, {"step": 1, "a": torch.ones(1000), "b": torch.ones(1000)})
    copies.write(2, {"step": 2, "a": torch.full((1000,), 2.0), "b": torch.full((1000,), 2.0)})
    real = byte_layout._copy_tensor

    def one_then_fail(t, slot, offset):
        if offset > 1000:
            raise OSError(errno.EFAULT, "stopped halfway")
        yield from real(t, slot, offset)

    monkeypatch.setattr(byte_layout, "_copy_tensor", one_then_fail)
    with pytest.raises(OSError, match="halfway"):
        copies.write(3, {"step": 3, "a": torch.full((1000,), 3.0), "b": torch.zeros(1000)})
    assert copies.newest() == 2 and torch.equal(copies.read(2)["b"], torch.full((1000,), 2.0))
    monkeypatch.setattr(byte_layout, "_copy_tensor", real)
    copies.write(3, {"step": 3, "a": torch.full((1000,), 3.0), "b": torch.zeros(1000)})
    assert torch.equal(copies.read(3)["b"], torch.zeros(1000))  # the torn slot, made whole


def test_the_test_kill_leaves_a_torn_slot_and_the_committed_copy(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from elastic_trainer.worker.memory.tier import NodeCopies
        from snapshots.storage import faults
        faults.inject(faults.KillAt("mid_memory_write", step=2))
        copies = NodeCopies({str(tmp_path)!r})
        for step in (1, 2):
            copies.write(step, {{"step": step, "w": torch.full((5000,), float(step))}})
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=120, check=False)
    assert done.returncode == -signal.SIGKILL
    copies = NodeCopies(str(tmp_path))
    assert copies.newest() == 1 and torch.equal(copies.read(1)["w"], torch.ones(5000))
    torn = (tmp_path / SLOTS[1]).read_bytes()
    assert b"\xee" * 64 in torn and torch.full((10,), 2.0).numpy().tobytes() in torn


def test_the_tier_copies_without_staging_buffers(tmp_path, one_rank, monkeypatch):
    staged = []
    monkeypatch.setattr(serialization, "staging_buffer", lambda *a: staged.append(a))
    model, optimizer = _trained(1)
    tier = MemoryTier(str(tmp_path / "tier"), every=1)
    tier.save(1, {"model": model, "optimizer": optimizer}, {})
    tier.flush()  # the optimizer's tensors are copied in the background
    assert staged == [] and tier.copies.newest() == 1
    _assert_same(tier.copies.read(1)["state"]["model"], model.state_dict())


def test_a_full_tmpfs_skips_the_copy_and_training_goes_on(tmp_path, one_rank, monkeypatch):
    model, _ = _trained(0)
    tier = MemoryTier(str(tmp_path / "tier"), every=1)
    tier.save(1, {"model": model}, {})

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with capture_logs() as logs:
        tier.save(2, {"model": model}, {})
        tier.save(3, {"model": model}, {})
    failed = [e for e in logs if e["event"] == "snapshot.memory_failed"]
    assert len(failed) == 1 and "No space left" in failed[0]["error"]  # once per streak
    assert tier.copies.newest() == 1  # storage, or this older copy, is the fallback


# --- the ranks of a node split its copy ------------------------------------------------------
def test_a_nodes_ranks_take_parts_in_rank_order():
    assert shares(["a", "a", "b", "a"]) == [(0, 3), (1, 3), (0, 1), (2, 3)]


def test_parts_tile_the_copy_in_about_equal_shares_after_the_per_rank_bytes():
    offsets = [64, 128, 1024, 2048, 3072, 4096]  # 1 KB tensors from 1024 on
    bounds = part_bounds(offsets, split_from=1024, end=5120, size=5200, parts=4)
    assert bounds == [0, 1024, 3072, 4096, 5200]  # nearest tensor starts to 1300, 2600, 3900
    assert part_bounds(offsets, 1024, 5120, 5200, parts=1) == [0, 5200]
    tiny = part_bounds([64], split_from=64, end=128, size=200, parts=4)
    assert tiny[0] == 0 and tiny[-1] == 200 and tiny == sorted(tiny)  # some parts empty


def _split_state(buffer: float) -> tuple[dict, object]:
    """A state whose parameters and optimizer state are replicated (as under DDP) and whose
    buffer is the rank's own (BatchNorm's running statistics before the next forward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.BatchNorm1d(300))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 300)).sum().backward()
    optimizer.step()
    model[1].running_mean.fill_(buffer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return state, memory_tier._replicated({"model": model, "optimizer": optimizer})


def _markers(folder, slot: str) -> list[dict]:
    return [json.loads((folder / part_marker(slot, p)).read_text()) for p in (0, 1)]


def test_two_ranks_copy_one_half_each_and_the_copy_is_whole_only_with_both(tmp_path):
    ranks = [NodeCopies(str(tmp_path), part=p, parts=2) for p in (0, 1)]
    states = [_split_state(buffer=float(p)) for p in (0, 1)]
    for step in (1, 2):
        ranks[0].write(step, {"step": step, "state": states[0][0]}, states[0][1])
        assert ranks[1].newest() == (step - 1 or None)  # not whole yet
        ranks[1].write(step, {"step": step, "state": states[1][0]}, states[1][1])
        assert NodeCopies(str(tmp_path)).newest() == step
    back = NodeCopies(str(tmp_path)).read(2)["state"]
    _assert_same(back["optimizer"], states[0][0]["optimizer"])
    _assert_same(back["model"], states[0][0]["model"])  # rank 0's buffer, not rank 1's
    first, second = _markers(tmp_path, SLOTS[1])
    assert first["stop"] == second["start"] and second["stop"] == first["bytes"]
    assert abs(first["stop"] - second["stop"] / 2) < 0.2 * second["stop"]  # about half each


def test_a_part_torn_or_missing_leaves_the_previous_whole_copy(tmp_path):
    ranks = [NodeCopies(str(tmp_path), part=p, parts=2) for p in (0, 1)]
    state, replicated = _split_state(buffer=0.0)
    for rank in ranks:
        rank.write(1, {"step": 1, "state": state}, replicated)
    ranks[0].write(2, {"step": 2, "state": state}, replicated)  # rank 1 killed before its part
    assert ranks[1].newest() == 1 and ranks[1].read(1)["step"] == 1
    ranks[1].write(2, {"step": 2, "state": state}, replicated)  # the same slot: now whole
    assert ranks[0].newest() == 2
    second = _markers(tmp_path, SLOTS[1])[1]
    _flip_last_byte(tmp_path / SLOTS[1], second["stop"])  # rank 1's bytes, after its commit
    with pytest.raises(ValueError, match=f"bytes {second['start']}-{second['stop']}.*fails"):
        ranks[0].read(2)


def test_forgetting_copies_removes_other_parts_and_leftovers(tmp_path):
    keep = Copy(step=4, slot=SLOTS[1], size=10, parts=({},))
    names = {
        SLOTS[0]: False, SLOTS[1]: False, part_marker(SLOTS[1], 0): False,
        part_marker(SLOTS[1], 1): True, part_marker(SLOTS[0], 0): True,
        f"{part_marker(SLOTS[1], 0)}.abc.tmp": True, "ranks": False,
    }  # fmt: skip
    assert {name: stale_file(name, keep) for name in names} == names
    assert not stale_file(SLOTS[1], None) and not stale_file("ranks", None)
    assert stale_file(part_marker(SLOTS[1], 0), None)


def _bn_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def _state_at(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_optimizer_step_waits_for_the_copy_taken_during_forward_and_backward(
    tmp_path, one_rank, monkeypatch
):
    """The optimizer's tensors are copied on a background thread; its next step must not
    change them before that copy is done (a step pre-hook), and BatchNorm's statistics, which
    the next forward changes, are copied at the call. The copy is the state at the save."""
    model, optimizer = _bn_model()
    saved = _state_at(model)
    tier = MemoryTier(str(tmp_path / "tier"), every=1)
    entered, go, seen = threading.Event(), threading.Event(), []
    optimizer.register_step_pre_hook(lambda *_: entered.set())  # runs before the tier's hook
    finish = tier._finish
    monkeypatch.setattr(tier, "_finish", lambda step, rest: (go.wait(60), finish(step, rest)))
    tier.save(1, {"model": model, "optimizer": optimizer}, {})
    optimizer.register_step_pre_hook(  # runs after the tier's hook: the copy must be done
        lambda *_: seen.append((tier._in_flight is None, tier.copies.newest()))
    )
    model(torch.randn(8, 16)).sum().backward()  # the next step's forward and backward
    step = threading.Thread(target=optimizer.step)
    step.start()
    assert entered.wait(60)
    assert tier.copies.newest() is None  # nothing committed while the copy is held back
    go.set()
    step.join(60)
    assert seen == [(True, 1)]
    _assert_same(tier.copies.read(1)["state"]["model"], saved)
    assert not torch.equal(model[0].weight, saved["0.weight"])  # the step did change them
    assert not torch.equal(model[1].running_mean, saved["1.running_mean"])  # so did forward


def test_a_failed_background_copy_is_reported_and_training_goes_on(tmp_path, one_rank, monkeypatch):
    model, optimizer = _bn_model()
    tier = MemoryTier(str(tmp_path / "tier"), every=1)

    def tmpfs_full() -> None:  # the deferred rest of the copy fails
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(NodeCopies, "write", lambda self, *a, **k: tmpfs_full)
    with capture_logs() as logs:
        tier.save(1, {"model": model, "optimizer": optimizer}, {})
        optimizer.step()  # waits for the failed copy, then steps
        assert not tier.holds(1)
    failed = [e for e in logs if e["event"] == "snapshot.memory_failed"]
    assert len(failed) == 1 and "No space left" in failed[0]["error"]


def test_a_closed_tier_is_not_kept_alive_by_its_optimizer(tmp_path, one_rank):
    model, optimizer = _bn_model()
    tier = MemoryTier(str(tmp_path / "tier"), every=1)
    tier.save(1, {"model": model, "optimizer": optimizer}, {})
    tier.close()
    gone = weakref.ref(tier)
    del tier
    gc.collect()
    assert gone() is None  # its pre-hook was removed, with the slot mappings it held
    optimizer.step()  # and the optimizer steps on without it


def test_a_read_copy_owns_its_memory_and_outlives_its_buffer(tmp_path):
    """The tensors read back live in anonymous memory of their own (``read_buffer``): the
    next copy written into the same slot file leaves them as they were, and they stay valid
    once nothing but them refers to that memory."""
    copies = NodeCopies(str(tmp_path))
    copies.write(1, {"step": 1, "w": torch.full((300_000,), 1.0)})
    copies.keep_only(1)
    back = copies.read(1)["w"]
    copies.write(2, {"step": 2, "w": torch.full((300_000,), 2.0)})
    copies.write(3, {"step": 3, "w": torch.full((300_000,), 3.0)})  # slot 0 again: step 1's
    gc.collect()
    assert torch.equal(back, torch.full((300_000,), 1.0))
    back += 1  # writable, like any restored tensor
    assert torch.equal(copies.read(3)["w"], torch.full((300_000,), 3.0))


def test_a_small_tensor_kept_from_a_read_does_not_keep_the_whole_copy_alive(tmp_path, monkeypatch):
    """An optimizer keeps its CPU step counters as restored (``load_state_dict``): were they
    views of the read buffer, the whole copy's memory would stay for the run (on a GPU, host
    memory the size of the state, its large tensors long copied to the device)."""
    buffers: list[weakref.ref] = []
    real = byte_layout.read_buffer

    def tracked(size: int, **kwargs: bool):
        buffer = real(size, **kwargs)
        buffers.append(weakref.ref(buffer))
        return buffer

    monkeypatch.setattr(byte_layout, "read_buffer", tracked)
    copies = NodeCopies(str(tmp_path))
    step = torch.tensor(41.0)
    copies.write(1, {"step": 1, "state": {"w": torch.randn(300_000), "step": step}})
    state = copies.read(1)["state"]
    assert torch.equal(state["step"], step)
    kept = state["step"]
    del state
    gc.collect()
    (buffer,) = buffers
    assert buffer() is None  # the 1.2 MB copy went with the large tensor
    kept += 1  # and the counter is its own, writable
    assert kept.item() == 42.0


def test_the_read_buffer_is_zeroed_writable_memory_of_the_size_asked():
    for size in (0, 1, 4097, 3 << 20):
        buffer = byte_layout.read_buffer(size)
        assert len(buffer) == size
        view = memoryview(buffer)
        assert not view.readonly and not any(view[:64]) and not any(view[-64:])
        view.release()


def test_reserving_gives_the_next_copy_s_slot_its_pages_ahead(tmp_path):
    copies = NodeCopies(str(tmp_path))
    copies.write(1, {"step": 1, "w": torch.ones(10)})  # slot 0 holds the newest copy
    payload = {"step": 2, "w": torch.full((300_000,), 2.0)}
    size = byte_layout.plan(payload).size
    copies.reserve(size)
    reserved = os.stat(tmp_path / SLOTS[1])
    assert reserved.st_blocks * 512 >= size and copies.newest() == 1  # pages, not a copy
    copies.reserve(size)  # it has them: the same file
    assert os.stat(tmp_path / SLOTS[1]).st_ino == reserved.st_ino
    NodeCopies(str(tmp_path)).write(2, payload)  # another rank's copy, at a failure
    written = os.stat(tmp_path / SLOTS[1])
    assert (written.st_ino, written.st_blocks) == (reserved.st_ino, reserved.st_blocks)
    assert torch.equal(copies.read(2)["w"], payload["w"])
    copies.write(3, {"step": 3, "w": torch.full((300_000,), 3.0)})  # slot 0: mapped on write
    copies.keep_only(2)
    copies.reserve(size)  # this rank's own mapping of slot 0, then its copy through it
    maps = copies.slots[SLOTS[0]].maps
    copies.write(4, {"step": 4, "w": torch.full((300_000,), 4.0)})
    assert copies.slots[SLOTS[0]].maps == maps and copies.read(4)["w"][0] == 4.0


def test_a_mapping_of_a_slot_another_process_made_shorter_is_made_again(tmp_path):
    """A rank's kept mapping (``reserve``) past the end of a slot another rank sized anew
    would fault (SIGBUS) when written: it is mapped again instead."""
    mapped = slots.MappedFile(str(tmp_path / SLOTS[0]))
    mapped.tensor(2 * slots.GRAIN_BYTES)
    os.truncate(tmp_path / SLOTS[0], slots.GRAIN_BYTES)  # another process's _map, smaller
    again = mapped.tensor(slots.GRAIN_BYTES)
    assert mapped.maps == 2 and len(again) == slots.GRAIN_BYTES
    again[-1] = 1  # within the file: no fault
    mapped.close()


def test_a_reservation_tmpfs_cannot_hold_is_reported_once_and_training_goes_on(
    tmp_path, one_rank, monkeypatch
):
    model, optimizer = _trained(1)
    tier = MemoryTier(str(tmp_path / "tier"), every=0)

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with capture_logs() as logs:
        tier.reserve(1, {"model": model, "optimizer": optimizer})
        tier.flush()
    failed = [e for e in logs if e["event"] == "snapshot.memory_failed"]
    assert len(failed) == 1 and failed[0]["error"].startswith("reserving")
    assert "No space left" in failed[0]["error"]
    tier.close()
