"""The in-memory tier's pure decisions (``plan``) and its node folder (``NodeCopies``)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import blake3
import pytest
import torch

from elastic_trainer.contract import protocol
from elastic_trainer.errors import EnvironmentProblem
from elastic_trainer.supervisor.cli import args
from elastic_trainer.supervisor.processes import workerenv
from elastic_trainer.worker.memory import byte_layout
from elastic_trainer.worker.memory.plan import (
    SLOTS,
    Copy,
    Source,
    next_slot,
    part_marker,
    plan_restore,
    shares,
    whole_copy,
)
from elastic_trainer.worker.memory.tier import NodeCopies, RankStreams

ALGORITHM = byte_layout.CHECKSUM_ALGORITHM
MARKER = part_marker(SLOTS[0], 0)  # a one-rank node's marker of the copy in its first slot


# --- which part of its node's copy each rank copies --------------------------------------------
def test_the_ranks_of_each_node_split_its_copy_in_rank_order():
    assert shares(["a", "a", "b", "b"]) == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert shares(["a", "b", "a", "b"]) == [(0, 2), (0, 2), (1, 2), (1, 2)]  # any rank layout
    assert shares(["x"]) == [(0, 1)]


# --- where a (re)started group restores from ---------------------------------------------------
def test_every_node_holding_the_newest_copy_restores_it_locally():
    plan = plan_restore([9, 9, 9, 9], storage_newest=6)
    assert (plan.source, plan.step, plan.reason) == (Source.MEMORY, 9, None)
    assert [plan.source_of(r, [9, 9, 9, 9]) for r in range(4)] == [Source.MEMORY] * 4


def test_a_node_without_the_newest_copy_gets_it_from_the_lowest_holder():
    held = [None, None, 8, 9, 9]  # node 0 replaced; node 1 was writing step 9 when killed
    plan = plan_restore(held, storage_newest=6)
    assert (plan.source, plan.step, plan.src_rank) == (Source.MIRROR, 9, 3)
    assert [plan.source_of(r, held) for r in range(5)] == [
        Source.MIRROR, Source.MIRROR, Source.MIRROR, Source.MEMORY, Source.MEMORY,
    ]  # fmt: skip


def test_no_copy_anywhere_falls_back_to_storage_and_says_why():
    plan = plan_restore([None, None], storage_newest=6)
    assert plan.source is Source.STORAGE and plan.step is None
    assert "no node holds an in-memory copy" in (plan.reason or "")
    assert plan_restore([None], storage_newest=None).source is Source.STORAGE  # fresh start


def test_a_newer_storage_snapshot_wins_over_an_older_copy():
    plan = plan_restore([5, 5], storage_newest=10)
    assert plan.source is Source.STORAGE
    assert "step 10" in (plan.reason or "") and "step 5" in (plan.reason or "")
    assert plan_restore([10, 10], storage_newest=10).source is Source.MEMORY  # a tie: memory


def test_the_next_copy_never_overwrites_the_committed_one():
    assert next_slot(None) == SLOTS[0]
    assert next_slot(Copy(step=4, slot=SLOTS[0], size=10, parts=())) == SLOTS[1]
    assert next_slot(Copy(step=5, slot=SLOTS[1], size=10, parts=())) == SLOTS[0]
    part = {"step": 5, "slot": SLOTS[0], "bytes": 10, "part": 0, "parts": 1, "start": 0}
    assert whole_copy(SLOTS[0], {0: {**part, "stop": 10}}) is not None
    assert whole_copy(SLOTS[1], {0: {**part, "stop": 10}}) is None  # another slot's
    assert whole_copy(SLOTS[0], {0: {**part, "stop": 9}}) is None  # short of its size
    assert whole_copy(SLOTS[0], {0: {**part, "step": "5", "stop": 10}}) is None


# --- the node folder -----------------------------------------------------------------------------
def test_a_committed_copy_supersedes_the_previous_one_in_two_slots(tmp_path):
    copies = NodeCopies(str(tmp_path / "node"))
    assert copies.newest() is None
    for step in range(1, 6):
        copies.write(step, {"step": step, "w": torch.arange(step)})
        assert copies.newest() == step
        assert torch.equal(copies.read(step)["w"], torch.arange(step))
    assert sorted(os.listdir(tmp_path / "node")) == sorted(
        [*SLOTS, *(part_marker(slot, 0) for slot in SLOTS)]
    )  # two copies at most
    with pytest.raises(FileNotFoundError):
        copies.read(4)  # superseded


def test_a_torn_slot_is_never_read(tmp_path):
    copies = NodeCopies(str(tmp_path))
    copies.write(3, {"step": 3, "w": torch.ones(100)})
    copies.write(4, {"step": 4, "w": torch.ones(100)})
    with open(tmp_path / SLOTS[0], "r+b") as f:  # the next copy's slot, torn by a crash
        f.truncate(10)
    assert copies.newest() == 4 and torch.equal(copies.read(4)["w"], torch.ones(100))
    with open(tmp_path / SLOTS[1], "r+b") as f:  # a committed slot of the wrong size
        f.truncate(10)
    with pytest.raises(ValueError, match="bytes"):
        copies.read(4)


def _flip_last_byte(path, size: int | None = None) -> None:
    """Flip the last byte of the file's first ``size`` bytes (all of them: None)."""
    data = bytearray(path.read_bytes())
    data[(size or len(data)) - 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_copy_is_refused_before_its_skeleton_is_unpickled(tmp_path, monkeypatch):
    copies = NodeCopies(str(tmp_path))
    copies.write(4, {"step": 4, "w": torch.ones(100)})
    size = json.loads((tmp_path / MARKER).read_text())["bytes"]
    _flip_last_byte(tmp_path / SLOTS[0], size)  # same size: only the checksum can tell
    unpickled = []
    monkeypatch.setattr(byte_layout.torch, "load", lambda *a, **k: unpickled.append(a))
    with pytest.raises(ValueError, match=f"fails its {ALGORITHM} checksum"):
        copies.read(4)
    assert unpickled == []


def test_a_copy_whose_marker_has_no_checksum_is_not_used(tmp_path):
    copies = NodeCopies(str(tmp_path))
    copies.write(4, {"step": 4})
    marker = json.loads((tmp_path / MARKER).read_text())
    del marker[ALGORITHM]
    (tmp_path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(ValueError, match=f"no valid {ALGORITHM} checksum"):
        copies.read(4)


def test_a_damaged_streams_file_is_refused(tmp_path):
    streams = RankStreams(str(tmp_path), 0)
    streams.write(3, {"rng": torch.arange(8)}, committed=None)
    assert torch.equal(streams.read(3)["rng"], torch.arange(8))
    _flip_last_byte(tmp_path / "ranks" / "0-000000000003.pt")
    with pytest.raises(ValueError, match=f"fails its {ALGORITHM} checksum"):
        streams.read(3)


def test_a_streams_file_checksummed_by_another_algorithm_is_refused(tmp_path):
    streams = RankStreams(str(tmp_path), 0)
    streams.write(3, {"rng": torch.arange(8)}, committed=None)
    path = tmp_path / "ranks" / "0-000000000003.pt"
    body = path.read_bytes().partition(b"\n")[2]
    for line in (f"blake3 {blake3.blake3(body).hexdigest()}", byte_layout.checksum(body)):
        path.write_bytes(line.encode() + b"\n" + body)  # another's, or unnamed (older files)
        with pytest.raises(ValueError, match=f"no valid {ALGORITHM} checksum"):
            streams.read(3)


def test_forgetting_copies_keeps_only_the_restored_step(tmp_path):
    copies = NodeCopies(str(tmp_path))
    copies.write(3, {"step": 3})
    copies.write(4, {"step": 4})
    copies.keep_only(4)
    assert sorted(os.listdir(tmp_path)) == sorted([part_marker(SLOTS[1], 0), *SLOTS])
    assert copies.newest() == 4
    copies.keep_only(2)  # the group resumed from an older step: this copy is of no use
    assert sorted(os.listdir(tmp_path)) == sorted(SLOTS) and copies.newest() is None


def test_a_write_that_fails_leaves_the_previous_copy(tmp_path):
    copies = NodeCopies(str(tmp_path))
    copies.write(1, {"step": 1})
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        copies.write(2, {"step": 2, "bad": lambda: None})  # cannot be pickled
    assert copies.newest() == 1 and copies.read(1)["step"] == 1


# --- the settings ---------------------------------------------------------------------------------
def test_memory_settings_round_trip_and_zero_means_no_periodic_copies():
    settings = protocol.WorkerSettings(memory_dir="/dev/shm/x/1", memory_snapshot_every=0)
    assert protocol.WorkerSettings.from_env(settings.to_env()) == settings
    assert protocol.DEFAULT_SHARDED_MEMORY_SNAPSHOT_EVERY == "auto"
    with pytest.raises(EnvironmentProblem, match=protocol.ENV_MEMORY_SNAPSHOT_EVERY):
        protocol.WorkerSettings.from_env({protocol.ENV_MEMORY_SNAPSHOT_EVERY: "-1"})


def test_the_supervisor_flag_and_variable_reach_the_workers_with_this_agents_folder():
    cfg = args.parse(["--memory-snapshot-every", "0", "x.py"])
    assert cfg.worker.memory_snapshot_every == 0
    cfg = args.parse(["x.py"], env={"ELASTIC_TRAIN_MEMORY_SNAPSHOT_EVERY": "5"})
    folder = workerenv.memory_dir(cfg)
    assert str(os.getpid()) in folder and cfg.job_id in folder  # stable per agent, per job
    env = cfg.worker_settings("/ctl", folder).to_env()
    assert env[protocol.ENV_MEMORY_SNAPSHOT_EVERY] == "5"
    assert env[protocol.ENV_MEMORY_DIR] == folder
    assert (
        protocol.ENV_MEMORY_SNAPSHOT_EVERY
        not in args.parse(["x.py"]).worker_settings("/ctl").to_env()
    )  # unset: the script's keyword, else the default


def test_the_supervisor_removes_its_folder_at_exit_and_those_of_dead_agents():
    cfg = args.parse(["--job-id", f"memtier-test-{os.getpid()}", "x.py"])
    folder = workerenv.memory_dir(cfg)
    job_dir = os.path.dirname(folder)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getppid()):  # an agent that was SIGKILLed, one still running
        NodeCopies(os.path.join(job_dir, str(pid))).write(1, {"step": 1})
    NodeCopies(folder).write(1, {"step": 1})
    workerenv.remove_stale_memory_dirs(cfg)
    assert sorted(os.listdir(job_dir)) == sorted([str(os.getppid()), str(os.getpid())])
    shutil.rmtree(os.path.join(job_dir, str(os.getppid())))
    workerenv.remove_memory_dir(cfg)
    assert not os.path.exists(folder) and not os.path.exists(job_dir)


# --- the byte layout of a copy ---------------------------------------------------
def test_a_copy_round_trips_every_kind_of_value():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    payload = {
        "model": model.state_dict(),  # an OrderedDict with _metadata, 0-dim int tensors
        "optimizer": optimizer.state_dict(),
        "odd": [torch.ones(2, 3).t(), torch.zeros(2, dtype=torch.bfloat16), (1, "x", None)],
    }
    f = io.BytesIO()
    byte_layout.write(payload, f)
    back = byte_layout.read(bytearray(f.getvalue()))
    for key in ("model", "optimizer"):
        torch.testing.assert_close(back[key], payload[key], rtol=0, atol=0)
    torch.testing.assert_close(back["odd"][:2], payload["odd"][:2], rtol=0, atol=0)
    assert back["model"]._metadata == payload["model"]._metadata
    assert back["odd"][2] == (1, "x", None)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    fresh.load_state_dict(back["model"])
    with pytest.raises(ValueError, match="truncated"):
        byte_layout.read(bytearray(f.getvalue()[:-5]))


def test_a_ranks_streams_are_kept_from_its_nodes_committed_copy_on(tmp_path):
    mine, other = RankStreams(str(tmp_path), 1), RankStreams(str(tmp_path), 10)
    other.write(1, {"rng": torch.ones(1)}, committed=None)
    for step, committed in [(1, None), (2, None), (3, 1), (4, 3)]:
        mine.write(step, {"rng": torch.full((2,), step)}, committed=committed)
    assert mine.read(2) is None  # older than the committed copy: of no use any more
    assert torch.equal(mine.read(3)["rng"], torch.full((2,), 3))
    assert torch.equal(mine.read(4)["rng"], torch.full((2,), 4))
    (tmp_path / "ranks" / "1-000000000005.pt.dead.tmp").write_bytes(b"torn")
    mine.forget(lambda s: s != 3)  # the group resumed from step 3
    assert sorted(os.listdir(tmp_path / "ranks")) == ["1-000000000003.pt", "10-000000000001.pt"]


def test_both_tiers_offer_the_session_s_interface_with_the_same_signatures():
    import inspect

    from elastic_trainer.worker.memory.interface import InMemoryTier
    from elastic_trainer.worker.memory.shards import ShardedMemoryTier
    from elastic_trainer.worker.memory.tier import MemoryTier

    wanted = {
        name: inspect.signature(member)
        for name, member in vars(InMemoryTier).items()
        if callable(member) and not name.startswith("_")
    }
    assert set(wanted) == {"due", "save", "holds", "restore", "after_restore", "flush", "close"}
    for tier in (MemoryTier, ShardedMemoryTier):
        for name, signature in wanted.items():
            got = inspect.signature(getattr(tier, name))
            assert list(got.parameters) == list(signature.parameters), (tier.__name__, name)
