"""A node lost under FSDP2: the survivors rebuild the lost node's shards from the mirrors of
its in-memory copies (``worker.memory.mirror``), so at most one step is lost; with the
mirror lost too, storage serves and the event says why. gloo, each rank a node of its own."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from snapshots import SnapshotStore
from tests.dist import memory_shard_workers, spawning
from tests.dist.test_snapshot_sharded import assert_state_equal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 5  # storage has step 2 only


def run_phase(tmp: Path, phase: str, world: int, **args: Any) -> list[dict[str, Any]]:
    tag = args.setdefault("tag", f"w{world}")
    spawning.spawn(
        memory_shard_workers.spawn_phase,
        args=(world, str(tmp), phase, args),
        nprocs=world,
        join=True,
    )
    return [json.loads((tmp / f"result-{phase}-{tag}-{r}.json").read_text()) for r in range(world)]


def test_a_lost_node_s_shards_are_rebuilt_from_its_mirror_losing_no_step(tmp_path):
    trained = run_phase(tmp_path, "train_with_copies", 2, steps=STEPS)
    assert [r["failure_copy"] for r in trained] == [False, False]  # no replicas: no JIT copy
    (survivor,) = run_phase(tmp_path, "resume", 1, lose=["node1"], tag="lost")
    assert survivor["step"] == STEPS
    (event,) = survivor["restored"]
    assert (event["source"], event["step"], event["saved_world_size"]) == ("mirror", STEPS, 2)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    loaded = torch.load(tmp_path / "loaded-lost.pt", weights_only=True)
    assert_state_equal(loaded, expected)  # the full model and Adam state, bit for bit
    info = SnapshotStore(str(tmp_path / "snaps"), create=False).latest()
    assert info is not None and (info.step, info.world_size) == (STEPS, 2)
    # one node now: the old rank 1's mirror is freed, rank 0 keeps the restored step's copy
    assert sorted(os.listdir(tmp_path / "node0" / "shards")) == ["rank-00000"]


def test_a_mirror_that_could_not_be_written_for_a_while_catches_up(tmp_path):
    """The mirror's writes fail for the first steps (tmpfs full, say): the receiver goes on
    receiving, never leaving its sender waiting, and holds the last step once it can."""
    run_phase(tmp_path, "train_with_copies", 2, steps=STEPS, block_mirror_until=2)
    (survivor,) = run_phase(tmp_path, "resume", 1, lose=["node1"], tag="lost")
    (event,) = survivor["restored"]
    assert (event["source"], event["step"]) == ("mirror", STEPS)


def test_a_mirror_lost_with_its_node_restores_from_storage_and_says_why(tmp_path):
    run_phase(tmp_path, "train_with_copies", 2, steps=STEPS)
    lose = ["node1", "node0/shards/mirror-00001"]  # the mirror's node went too
    (survivor,) = run_phase(tmp_path, "resume", 1, lose=lose, tag="both")
    assert survivor["step"] == 2
    (event,) = survivor["restored"]
    assert (event["source"], event["step"]) == ("storage", 2)
    assert "rank(s) 1 were lost with their node" in event["fallback_reason"]


def test_a_sender_killed_mid_transfer_leaves_the_previous_mirror_which_is_used(tmp_path):
    """Rank 1 (its node) dies halfway through sending its copy of the last step: the mirror
    never commits a half copy, and the survivor rebuilds the step before (one step lost)."""
    context = spawning.spawn(
        memory_shard_workers.spawn_phase,
        args=(2, str(tmp_path), "train_with_copies", {"steps": STEPS, "kill_at": STEPS,
              "expect_at": STEPS - 1, "tag": "kill"}),
        nprocs=2, join=False,
    )  # fmt: skip
    for process in context.processes:  # not context.join(): it would kill rank 0 at once
        process.join(240)
    assert context.processes[1].exitcode == -9  # killed mid-send, as injected
    (survivor,) = run_phase(tmp_path, "resume", 1, lose=["node1"], tag="lost")
    (event,) = survivor["restored"]
    assert (event["source"], event["step"]) == ("mirror", STEPS - 1)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    assert_state_equal(torch.load(tmp_path / "loaded-lost.pt", weights_only=True), expected)
