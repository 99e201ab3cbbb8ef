"""DistributedSnapshotter on 2 gloo ranks (torch.multiprocessing.spawn, file:// rendezvous):
per-rank RNG streams, which only processes have (threads share one global RNG; the
decisions alone are tested in-process, tests/inprocess/snapshots/test_distributed.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from snapshots import RNGState, SnapshotStore
from snapshots.distributed import DistributedSnapshotter
from snapshots.format import layout
from tests.dist import spawning

WORLD = 2


def _run(rank: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=WORLD)
    try:
        result = _scenario(rank, tmp)
        Path(tmp, f"result-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _scenario(rank: int, tmp: str) -> dict:
    torch.manual_seed(0)  # replicated model, identical on every rank
    model = torch.nn.Linear(4, 2)
    snap = DistributedSnapshotter(SnapshotStore(f"{tmp}/snaps", keep=5))
    out: dict = {"empty_load": snap.load() is None}

    torch.manual_seed(100 + rank)  # per-rank RNG streams differ
    snap.save(1, {"model": model}, per_rank={"rng": RNGState(), "rank": rank})
    expected_rng = torch.get_rng_state().clone()
    snap.save(2, {"model": model}, per_rank={"rng": RNGState(), "rank": rank})
    out["committed_at_second_save"] = snap.last_committed_step
    out["committed_after_wait"] = snap.wait()

    torch.manual_seed(999)  # scramble, then restore step 2's per-rank RNG
    loaded = snap.load(rank_into={"rng": RNGState()})
    out["loaded_step"] = loaded.info.step  # type: ignore[union-attr]
    out["loaded_world_size"] = loaded.info.world_size  # type: ignore[union-attr]
    out["own_rank_entry"] = loaded.rank_state["rank"]  # type: ignore[union-attr,index]
    out["rng_restored"] = bool(torch.equal(torch.get_rng_state(), expected_rng))
    out["model_equal"] = all(
        torch.equal(a, b)
        for a, b in zip(loaded.state["model"].values(), model.state_dict().values(), strict=True)
    )  # type: ignore[union-attr]

    # A snapshot saved by a world of 1: rank 1 has no per-rank entry and gets None.
    if rank == 0:
        SnapshotStore(f"{tmp}/small", async_save=False).save(
            7, {"model": model}, per_rank=[{"rank": 0}], world_size=1
        )
    dist.barrier()
    small = DistributedSnapshotter(SnapshotStore(f"{tmp}/small")).load()
    out["small_rank_state"] = small.rank_state  # type: ignore[union-attr]
    snap.close()
    return out


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_two_ranks_save_once_gather_rng_and_agree(tmp_path: Path) -> None:
    spawning.spawn(_run, args=(str(tmp_path),), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(WORLD)]
    for rank, res in enumerate(results):
        assert res["empty_load"] is True
        assert res["committed_at_second_save"] == 1  # learnt at the next synchronous point
        assert res["committed_after_wait"] == 2
        assert (res["loaded_step"], res["loaded_world_size"]) == (2, WORLD)
        assert res["own_rank_entry"] == rank
        assert res["rng_restored"] and res["model_equal"]
    assert [r["small_rank_state"] for r in results] == [{"rank": 0}, None]
    # replicated state written once: one data file per entry, one file per rank
    names = sorted(p.name for p in (tmp_path / "snaps" / layout.step_dir(2)).iterdir())
    assert len([n for n in names if "-model." in n]) == 1
    assert len([n for n in names if n.startswith("rank-")]) == WORLD
