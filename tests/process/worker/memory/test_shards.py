"""The sharded in-memory tier's pure decisions (``shard_plan``) and a rank's slot
folder (``memory_shards.RankSlots``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from elastic_trainer.worker.memory import rank_slots
from elastic_trainer.worker.memory import shard_plan as plan
from elastic_trainer.worker.memory.plan import SLOTS, Source
from elastic_trainer.worker.memory.rank_slots import RankSlots
from elastic_trainer.worker.memory.shards import ShardedMemoryTier
from tests import ROOT


def facts(*held: list[tuple[int, int]]) -> list[plan.RankFacts]:
    return [plan.RankFacts(copies=tuple(h)) for h in held]


# --- which step a (re)started group restores ---------------------------------------------------
def test_the_newest_step_every_rank_holds_is_restored():
    # rank 0 committed step 9, rank 1 was killed while writing it: both still hold 8
    chosen = plan.plan_restore(facts([(9, 2), (8, 2)], [(8, 2), (7, 2)]), 2, storage_newest=6)
    assert (chosen.source, chosen.step, chosen.reason) == (Source.MEMORY, 8, None)


def test_a_rank_without_a_copy_sends_every_rank_to_storage_with_the_reason():
    chosen = plan.plan_restore(facts([(9, 2)], []), 2, storage_newest=6)
    assert chosen.source is Source.STORAGE and chosen.step is None
    assert "rank(s) 1 hold no in-memory copy" in (chosen.reason or "")


def test_no_step_in_common_falls_back_to_storage():
    chosen = plan.plan_restore(facts([(9, 2)], [(7, 2)]), 2, storage_newest=6)
    assert chosen.source is Source.STORAGE
    assert "no step is held in memory by every rank" in (chosen.reason or "")


def test_a_changed_world_size_restores_from_storage_and_says_so():
    chosen = plan.plan_restore(facts([(9, 2)]), 1, storage_newest=6)  # a node of two lost
    assert chosen.source is Source.STORAGE
    assert "the world size changed (2 -> 1)" in (chosen.reason or "")


def test_a_newer_storage_snapshot_wins_and_nothing_at_all_is_a_fresh_start():
    newer = plan.plan_restore(facts([(9, 2)], [(9, 2)]), 2, storage_newest=12)
    assert newer.source is Source.STORAGE and "step 12 is newer" in (newer.reason or "")
    fresh = plan.plan_restore(facts([], []), 2, storage_newest=None)
    assert fresh.source is Source.STORAGE and "no rank holds" in (fresh.reason or "")


# --- a rank's two slots and marker ---------------------------------------------------------------
def copy(step: int, slot: str) -> plan.RankCopy:
    return plan.RankCopy(step=step, slot=slot, nbytes=10, digest="ab", world_size=2)


def test_the_next_copy_never_overwrites_the_newest_and_uncommits_the_one_it_overwrites():
    assert plan.slot_to_write([]) == (SLOTS[0], [])
    newest, older = copy(9, SLOTS[1]), copy(8, SLOTS[0])
    slot, kept = plan.slot_to_write([newest, older])
    assert (slot, kept) == (SLOTS[0], [newest])
    assert plan.after_write(kept, copy(10, slot)) == [copy(10, SLOTS[0]), newest]


def test_a_malformed_marker_lists_no_copy():
    good = copy(3, SLOTS[0]).to_json()
    assert plan.copies_of({"copies": [good, {**good, "slot": "../x"}, "junk"]}) == [
        copy(3, SLOTS[0])
    ]
    assert plan.copies_of({"copies": [{**good, "step": True}]}) == []
    assert plan.copies_of(["not", "a", "marker"]) == []
    assert plan.copies_of({"copies": [{**good, "replicas": [1, 2]}]}) == []  # world of 2
    assert plan.copies_of({"copies": [{**good, "replicas": "0"}]}) == []


def test_a_copy_names_the_ranks_holding_the_same_shards_and_a_marker_keeps_them(tmp_path):
    slots = RankSlots(str(tmp_path / "rank-00001"))
    slots.write(4, 4, payload(4), replicas=(1, 3))
    slots.write(5, 4, payload(5))  # unknown (a mirror's copy): only its own rank
    assert [(c.step, c.replicas) for c in slots.copies()] == [(5, ()), (4, (1, 3))]


def test_layout_problems_name_the_tensor():
    saved = {"w": {"shape": [4, 2], "offsets": [2, 0]}}
    assert plan.layout_problem(saved, saved) is None
    moved = plan.layout_problem(saved, {"w": {"shape": [4, 2], "offsets": [0, 0]}})
    assert moved is not None and "tensor w" in moved
    assert "differ" in (plan.layout_problem(saved, {"v": {}}) or "")


def payload(step: int, size: int = 1000) -> dict:
    return {"step": step, "tensors": {"w": torch.full((size,), float(step))}}


def test_a_rank_keeps_at_most_two_copies_whatever_the_number_of_steps(tmp_path):
    slots = RankSlots(str(tmp_path / "rank-00000"))
    for step in range(1, 30):
        slots.write(step, 2, payload(step))
        assert sorted(os.listdir(slots.directory)) == sorted([plan.MARKER, *SLOTS[: min(step, 2)]])
    assert [c.step for c in slots.copies()] == [29, 28]
    assert torch.equal(slots.read(28)["tensors"]["w"], torch.full((1000,), 28.0))
    slots.keep_only(28)
    assert [c.step for c in slots.copies()] == [28]
    assert len([n for n in os.listdir(slots.directory) if n in SLOTS]) == 1


def test_a_damaged_or_truncated_slot_is_never_read(tmp_path):
    slots = RankSlots(str(tmp_path / "rank-00001"))
    slots.write(4, 2, payload(4))
    (only,) = slots.copies()
    path = os.path.join(slots.directory, only.slot)
    with open(path, "r+b") as f:
        f.seek(only.nbytes // 2)  # in the copy (its slot is rounded up to its mapping's size)
        f.write(b"\xff\xfe")
    with pytest.raises(ValueError, match="checksum"):
        slots.read(4)
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="bytes"):
        slots.read(4)
    with pytest.raises(FileNotFoundError):
        slots.read(5)


def test_a_crash_while_writing_leaves_only_whole_copies_listed(tmp_path, monkeypatch):
    slots = RankSlots(str(tmp_path / "rank-00000"))
    slots.write(1, 2, payload(1))
    slots.write(2, 2, payload(2))

    def torn(layout, slot, *_):  # killed halfway through the copy of step 3 (into step 1's slot)
        slot[: layout.size // 2] = 0xEE
        raise KeyboardInterrupt

    monkeypatch.setattr("elastic_trainer.worker.memory.byte_layout.write_into", torn)
    with pytest.raises(KeyboardInterrupt):
        slots.write(3, 2, payload(3))
    assert [c.step for c in slots.copies()] == [2]  # step 1's slot was uncommitted first
    assert torch.equal(slots.read(2)["tensors"]["w"], torch.full((1000,), 2.0))
    with open(os.path.join(slots.directory, plan.MARKER)) as f:
        marker = json.load(f)
    assert [c["step"] for c in marker["copies"]] == [2]


# --- mirrors and a lost node's shards -----------------------------------------------------------
def test_each_rank_is_mirrored_by_the_same_local_rank_of_the_next_node():
    assert plan.mirror_targets(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert plan.mirror_targets(["a", "b", "c"]) == [1, 2, 0]
    assert plan.mirror_targets(["a", "a", "a", "b"]) == [3, 3, 3, 0]  # uneven nodes
    assert plan.mirror_targets(["a", "a"]) == [None, None]  # one node: nowhere else
    # HSDP: a rank whose replica is on another node needs no mirror; one on its own node does
    across, within = [[0, 2], [1, 3], [0, 2], [1, 3]], [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert plan.mirror_targets(["a", "a", "b", "b"], across) == [None] * 4
    assert plan.mirror_targets(["a", "a", "b", "b"], within) == [2, 3, 0, 1]


def test_a_lost_node_s_shards_are_read_from_the_lowest_rank_holding_them():
    # world 4 on nodes (0,1) and (2,3), node 2-3 lost: ranks 0 and 1 of the new world hold
    # their own copies and the mirrors of old ranks 2 and 3, up to step 9
    held = [[(0, 9, 4), (2, 9, 4), (0, 8, 4), (2, 8, 4)], [(1, 9, 4), (3, 9, 4), (3, 8, 4)]]
    rebuild = plan.plan_rebuild(held, storage_newest=6)
    assert (rebuild.step, rebuild.saved_world_size, rebuild.holders) == (9, 4, (0, 1, 0, 1))
    assert plan.plan_rebuild(held, storage_newest=9).step is None  # storage has it already


def test_a_mirror_lost_with_its_node_names_the_lost_ranks():
    rebuild = plan.plan_rebuild([[(0, 9, 2)]], storage_newest=6)
    assert rebuild.step is None
    assert "rank(s) 1 were lost with their node" in (rebuild.reason or "")


def test_a_changed_world_is_rebuilt_from_mirrors_a_same_world_crash_restores_in_place():
    own = facts([(9, 2)])
    chosen, rebuild = plan.plan_sharded(own, [[(0, 9, 2), (1, 9, 2)]], 1, storage_newest=6)
    assert (chosen.source, chosen.step) == (Source.MIRROR, 9) and rebuild is not None
    same = facts([(9, 2), (8, 2)], [(8, 2)])  # rank 1 crashed writing 9: 8 in place
    chosen, rebuild = plan.plan_sharded(same, [[(0, 9, 2), (0, 8, 2), (1, 8, 2)]] * 2, 2, 6)
    assert (chosen.source, chosen.step, rebuild) == (Source.MEMORY, 8, None)
    # no step in common, and none whole elsewhere either: storage, with the own copies' reason
    apart = facts([(9, 2)], [(7, 2)])
    chosen, rebuild = plan.plan_sharded(apart, [[(0, 9, 2), (1, 7, 2)]] * 2, 2, None)
    assert chosen.source is Source.STORAGE and rebuild is None
    assert "no step is held in memory by every rank" in (chosen.reason or "")


# --- HSDP: a replica's copy stands in for a lost rank's ----------------------------------------
# world 4 as a 2x2 mesh (replicate, shard): ranks 0 and 2 hold the same shards, 1 and 3 too;
# nodes (0, 1) and (2, 3). The copy made just in time (step 9) is mirrored nowhere.
R02, R13 = (0, 2), (1, 3)


def test_a_lost_node_s_shards_come_from_their_replicas_each_written_once():
    held = [
        [(0, 9, 4, R02), (0, 6, 4, R02), (2, 6, 4, ())],
        [(1, 9, 4, R13), (1, 6, 4, R13), (3, 6, 4, ())],
    ]
    rebuild = plan.plan_rebuild(held, storage_newest=6)
    assert (rebuild.step, rebuild.saved_world_size) == (9, 4)
    assert (rebuild.holders, rebuild.sources) == ((0, 1, 0, 1), (0, 1, 0, 1))
    assert rebuild.writes == (True, True, False, False)  # the replicas' shards: once
    # without the replicas' names (copies of an older version) only the mirrors serve: step 6
    plain = [[(o, s, w) for o, s, w, _ in copies] for copies in held]
    assert plan.plan_rebuild(plain, storage_newest=None).step == 6


def test_a_rank_s_own_copy_is_read_before_a_replica_s():
    held = [[(0, 9, 4, R02)], [(1, 9, 4, R13), (2, 9, 4, ())], [(3, 9, 4, R13)]]
    rebuild = plan.plan_rebuild(held, storage_newest=None)
    assert (rebuild.holders, rebuild.sources) == ((0, 1, 1, 2), (0, 1, 2, 3))
    assert rebuild.writes == (True, True, False, False)


def test_shards_lost_with_every_replica_name_the_ranks_and_storage_serves():
    rebuild = plan.plan_rebuild([[(0, 9, 4, R02)], [(2, 9, 4, R02)]], storage_newest=6)
    assert rebuild.step is None
    assert "rank(s) 1, 3 were lost with their nodes, mirrors and replicas" in (rebuild.reason or "")


def test_a_worker_crash_under_hsdp_restores_the_survivors_newer_step_from_a_replica():
    # rank 3 crashed: the others copied step 9 just in time; every rank holds 6 in place
    own = facts([(9, 4), (6, 4)], [(9, 4), (6, 4)], [(9, 4), (6, 4)], [(6, 4)])
    node = [(0, 9, 4, R02), (1, 9, 4, R13), (2, 9, 4, R02)]
    node += [(r, 6, 4, g) for r, g in enumerate((R02, R13, R02, R13))]
    chosen, rebuild = plan.plan_sharded(own, [node] * 4, 4, storage_newest=6)
    assert (chosen.source, chosen.step) == (Source.MIRROR, 9) and rebuild is not None
    assert rebuild.sources == (0, 1, 2, 1)
    # with no storage to rebuild into, the step every rank holds in place
    chosen, rebuild = plan.plan_sharded(own, [node] * 4, 4, None, storage=False)
    assert (chosen.source, chosen.step, rebuild) == (Source.MEMORY, 6, None)


def test_a_rank_holds_a_step_only_once_its_copy_is_committed(tmp_path, one_rank, monkeypatch):
    # What a restarting stop asks before it skips the storage save (session._resumes_from_memory)
    tier = ShardedMemoryTier(str(tmp_path / "memory"), every=1)
    state = {"model": {"w": torch.arange(4.0)}}
    tier.save(1, state, {})
    assert tier.holds(1) and not tier.holds(2)  # waits for the writer thread

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rank_slots.RankSlots, "write", full)
    tier.save(2, state, {})
    assert not tier.holds(2) and tier.holds(1)
    tier.close()


def test_the_copy_made_just_in_time_is_written_at_once_and_never_over_a_slot_being_sent(
    tmp_path, one_rank, monkeypatch
):
    tier = ShardedMemoryTier(str(tmp_path / "memory"), every=3)
    weight = torch.nn.Parameter(torch.arange(4.0))
    optimizer = torch.optim.Adam([weight])
    state = {"model": {"w": weight}, "optimizer": optimizer}
    assert not tier.dump(1, state, {}) and not optimizer.state  # no state yet: never stepped
    weight.grad = torch.ones(4)
    optimizer.step()
    assert tier.dump(1, state, {}) and tier.holds(1) and tier.dump(1, state, {})  # once
    sending = tier.slots.slot_to_write()  # as if the writer thread still sent that slot
    monkeypatch.setattr(tier._writer, "busy", lambda: True)
    tier._sending = sending
    assert not tier.dump(2, state, {}) and not tier.holds(2)
    tier._sending = next(slot for slot in SLOTS if slot != sending)
    assert tier.dump(2, state, {})
    monkeypatch.undo()
    assert [c.step for c in tier.slots.copies()] == [2, 1]
    tier.close()


# --- copies into kept mappings, no staging ---------------------------------------------------
def test_copies_go_into_slots_mapped_once_without_write_calls(tmp_path, monkeypatch):
    def no_write(*_):
        raise AssertionError("a copy goes into the slot's mapping, not through write()")

    monkeypatch.setattr("elastic_trainer.worker.memory.byte_layout.write", no_write)
    slots = RankSlots(str(tmp_path / "rank-00000"))
    for step in range(1, 7):
        slots.write(step, 2, payload(step))
    assert [mapped.maps for mapped in slots.slots.values()] == [1, 1]  # once each, not per copy
    assert torch.equal(slots.read(6)["tensors"]["w"], torch.full((1000,), 6.0))


def test_a_mirror_s_copy_is_received_into_its_slot_and_reads_back_checked(tmp_path):
    own = RankSlots(str(tmp_path / "rank-00000"))
    sent = own.write(3, 2, payload(3))
    mirror = RankSlots(str(tmp_path / "mirror-00000"))
    got = mirror.receive(
        3, 2, sent.nbytes, sent.digest, lambda into: into.copy_(own.committed(sent))
    )
    assert (got.step, got.nbytes, got.digest) == (3, sent.nbytes, sent.digest)
    assert torch.equal(mirror.read(3)["tensors"]["w"], torch.full((1000,), 3.0))
    mirror.receive(4, 2, sent.nbytes, sent.digest, lambda into: into.fill_(7))  # not step 3's
    with pytest.raises(ValueError, match="checksum"):
        mirror.read(4)


_NO_STAGING = """
import sys, torch, torch.distributed as dist
from elastic_trainer.worker.memory.shards import ShardedMemoryTier
from snapshots import RNGState
from snapshots.format import serialization
from tests.dist.sharded_workers import fsdp_model, train

folder = sys.argv[1]
dist.init_process_group("gloo", store=dist.FileStore(folder + "/pg-store", 1), rank=0, world_size=1)
staged = []
serialization.staging_buffer = lambda *a: staged.append(a)
model = fsdp_model(1)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
train(model, optimizer, 1, 0)
tier = ShardedMemoryTier(folder + "/node0", every=1)
for step in (1, 2, 3):
    tier.save(step, {"model": model, "optimizer": optimizer}, {"rng": RNGState()})
tier.close()
assert staged == [], staged
assert [mapped.maps for mapped in tier.slots.slots.values()] == [1, 1]
copy = tier.slots.read(3)
assert copy["step"] == 3
assert torch.equal(copy["tensors"]['["model","0.weight"]'], model[0].weight.to_local())
dist.destroy_process_group()
"""


def test_the_sharded_tier_copies_without_staging_buffers(tmp_path):
    # In a process of its own: FSDP2 in this one leaves native threads behind, and the
    # fork-based crash tests (tests/process/snapshots/test_crash.py) deadlock on a lock one of
    # them held.
    root = str(ROOT)
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _NO_STAGING, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
