"""DistributedSnapshotter's decisions on 3 gloo ranks as threads of this process
(``tests/inprocess/harness.py``): when one rank cannot load a snapshot every rank falls back
to an older one together, and when none loads every rank raises, none is left waiting."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from snapshots import NoValidSnapshotError, SnapshotStore
from snapshots.distributed import DistributedSnapshotter
from tests.inprocess.harness import Rank, run_attempt, thread_local_world
from tests.tamper import evil_bytes, resign

FALLBACK_WORLD = 3


def _fall_back(rank: Rank, tmp: Path) -> dict:
    root = tmp / "snaps"
    snap = DistributedSnapshotter(SnapshotStore(str(root), keep=None))
    for step in (1, 2):
        snap.save(step, {"w": torch.ones(3) * step}, per_rank={"rank": rank.rank, "step": step})
    snap.wait()
    if rank.rank == 0:  # only rank 2's own file of step 2 does not load; its checksum matches
        resign(root, 2, lambda f: f.get("rank") == 2, evil_bytes(tmp / "pwned"))
    dist.barrier()
    loaded = snap.load()
    snap.close()
    return {"step": loaded.info.step, "rank_state": loaded.rank_state}  # type: ignore[union-attr]


def _none_loads(rank: Rank, tmp: Path) -> str:
    root = tmp / "snaps"
    snap = DistributedSnapshotter(SnapshotStore(str(root), keep=None))
    if rank.rank == 0:  # now nothing loads anywhere: every rank raises, none hangs
        for step in (1, 2):
            resign(root, step, lambda f: f.get("key") == "w", b"garbage")
    dist.barrier()
    try:
        snap.load()
        return "loaded"
    except NoValidSnapshotError as exc:
        return str(exc)
    finally:
        snap.close()


def test_all_ranks_fall_back_together_when_one_rank_cannot_load(tmp_path: Path) -> None:
    with thread_local_world():
        with capture_logs() as logs:
            fell_back = run_attempt(lambda rank: _fall_back(rank, tmp_path), FALLBACK_WORLD)
        none_loads = run_attempt(lambda rank: _none_loads(rank, tmp_path), FALLBACK_WORLD)
    fell_back.raise_first()
    none_loads.raise_first()
    for rank, res in enumerate(fell_back.values()):
        assert res["step"] == 1 and res["rank_state"] == {"rank": rank, "step": 1}
    assert all("none loads" in message for message in none_loads.values())
    # reported once (by rank 0), naming the failing rank
    (corrupt,) = [(e["step"], e["problem"]) for e in logs if e["event"] == "snapshot.corrupt"]
    assert corrupt[0] == 2 and corrupt[1].startswith("rank 2: ")
    assert "posix.system" in corrupt[1] and "weights_only` set to `False" not in corrupt[1]
    assert not (tmp_path / "pwned").exists()
