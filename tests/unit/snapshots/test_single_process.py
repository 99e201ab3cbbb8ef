"""DistributedSnapshotter without a process group behaves as rank 0 of a world of 1."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from snapshots import RNGState, SnapshotStore
from snapshots.distributed import DistributedSnapshotter


def test_single_process_save_wait_load(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    snap = DistributedSnapshotter(SnapshotStore(str(tmp_path)))
    assert snap.load() is None
    torch.manual_seed(5)
    snap.save(1, {"w": torch.ones(2)}, per_rank={"rng": RNGState()})
    expected = torch.get_rng_state().clone()
    assert snap.wait() == 1
    torch.manual_seed(6)
    loaded = snap.load(rank_into={"rng": RNGState()})
    assert loaded is not None and loaded.info.world_size == 1
    assert torch.equal(torch.get_rng_state(), expected)
    snap.close()
