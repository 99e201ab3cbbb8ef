"""HSDP (a replicate dimension in the mesh): a lost node's shards have replicas on the
survivors, so their copies made just in time when the group ends stand in for the lost
ranks' (``worker.memory.on_failure``, ``shard_plan.plan_rebuild``): no step is lost, and no
mirror is kept. gloo, two nodes of two ranks; the survivors resume as one node of two."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from snapshots import SnapshotStore
from tests.dist.test_memory_shards_node_loss import pytestmark, run_phase  # noqa: F401
from tests.dist.test_snapshot_sharded import assert_state_equal


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One training run; each test resumes from its own copy of node 0's folder."""
    tmp = tmp_path_factory.mktemp("hsdp")
    return tmp, run_phase(tmp, "train_hsdp", 4)


def test_a_lost_node_s_shards_come_from_the_replicas_copied_just_in_time(trained):
    tmp_path, ranks = trained
    assert [r["replicas"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert ranks[0]["targets"] == [None] * 4  # each replica is on the other node already
    assert (ranks[0]["copied"][0], ranks[1]["copied"]) == (True, [False, True])
    assert sorted(os.listdir(tmp_path / "node0" / "shards")) == ["rank-00000", "rank-00001"]

    args = {"lose": ["node1"], "folder": "node0", "tag": "jit"}
    survivors = run_phase(tmp_path, "resume", 2, **args)
    assert [r["step"] for r in survivors] == [5, 5]
    (event,) = survivors[0]["restored"]
    assert (event["source"], event["step"], event["saved_world_size"]) == ("mirror", 5, 4)
    expected = torch.load(tmp_path / "expected-5.pt", weights_only=True)
    assert_state_equal(torch.load(tmp_path / "loaded-jit.pt", weights_only=True), expected)
    info = SnapshotStore(str(tmp_path / "snaps"), create=False).latest()
    assert info is not None and (info.step, info.world_size) == (5, 4)


def test_a_rank_inside_its_optimizer_step_is_never_copied_its_replica_s_older_copy_serves(
    trained,
):
    tmp_path, _ = trained
    args = {"lose": ["node1"], "folder": "node0-torn", "snaps": "snaps-torn", "tag": "torn"}
    survivors = run_phase(tmp_path, "resume", 2, **args)
    (event,) = survivors[0]["restored"]
    # old rank 1's shards of step 5: rank 1 was torn, rank 3 was lost; step 3's periodic
    # copies make the old world whole (ranks 2 and 3 through their replicas 0 and 1)
    assert (event["source"], event["step"]) == ("mirror", 3)
    expected = torch.load(tmp_path / "expected-3.pt", weights_only=True)
    assert_state_equal(torch.load(tmp_path / "loaded-torn.pt", weights_only=True), expected)
