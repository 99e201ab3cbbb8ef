"""DistributedSnapshotter on 2 gloo ranks (torch.multiprocessing.spawn, file:// rendezvous)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from snapshots import NoValidSnapshotError, RNGState, SnapshotStore
from snapshots.distributed import DistributedSnapshotter
from snapshots.format import layout
from tests.dist import spawning
from tests.tamper import evil_bytes, resign

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


FALLBACK_WORLD = 3


def _run_fallback(rank: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rdzv-fb", rank=rank, world_size=FALLBACK_WORLD
    )
    try:
        result = _fallback_scenario(rank, Path(tmp))
        Path(tmp, f"fallback-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _fallback_scenario(rank: int, tmp: Path) -> dict:
    root = tmp / "snaps"
    snap = DistributedSnapshotter(SnapshotStore(str(root), keep=None))
    for step in (1, 2):
        snap.save(step, {"w": torch.ones(3) * step}, per_rank={"rank": rank, "step": step})
    snap.wait()
    if rank == 0:  # only rank 2's own file of step 2 does not load; its checksum matches
        resign(root, 2, lambda f: f.get("rank") == 2, evil_bytes(tmp / "pwned"))
    dist.barrier()
    out: dict = {}
    with capture_logs() as logs:
        loaded = snap.load()
    out["step"] = loaded.info.step  # type: ignore[union-attr]
    out["rank_state"] = loaded.rank_state  # type: ignore[union-attr]
    out["corrupt"] = [(e["step"], e["problem"]) for e in logs if e["event"] == "snapshot.corrupt"]
    if rank == 0:  # now nothing loads anywhere: every rank raises, none hangs
        for step in (1, 2):
            resign(root, step, lambda f: f.get("key") == "w", b"garbage")
    dist.barrier()
    try:
        snap.load()
        out["none_loads"] = "loaded"
    except NoValidSnapshotError as exc:
        out["none_loads"] = str(exc)
    snap.close()
    return out


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_all_ranks_fall_back_together_when_one_rank_cannot_load(tmp_path: Path) -> None:
    spawning.spawn(_run_fallback, args=(str(tmp_path),), nprocs=FALLBACK_WORLD, join=True)
    results = [
        json.loads((tmp_path / f"fallback-{r}.json").read_text()) for r in range(FALLBACK_WORLD)
    ]
    for rank, res in enumerate(results):
        assert res["step"] == 1 and res["rank_state"] == {"rank": rank, "step": 1}
        assert "none loads" in res["none_loads"]
    (corrupt,) = results[0]["corrupt"]  # reported once, by rank 0, naming the failing rank
    assert corrupt[0] == 2 and corrupt[1].startswith("rank 2: ")
    assert "posix.system" in corrupt[1] and "weights_only` set to `False" not in corrupt[1]
    assert not results[1]["corrupt"] and not results[2]["corrupt"]
    assert not (tmp_path / "pwned").exists()
