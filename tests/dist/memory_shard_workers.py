"""Worker bodies for the sharded in-memory tier's node-loss tests (``worker.memory.shards``,
``worker.memory.mirror``), run through ``sharded_workers.spawn_phase``: each rank plays a
node of its own, with its own memory folder ``<tmp>/node<rank>``."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from elastic_trainer.entrypoints.worker import exit_without_finalizing
from elastic_trainer.worker.memory.shards import ShardedMemoryTier
from elastic_trainer.worker.snapshotting import (
    SessionSnapshots,
    open_failure_copy,
    restore_state,
)
from snapshots import RNGState
from snapshots.storage import faults
from tests.dist import sharded_workers
from tests.dist.sharded_workers import fsdp_model, full_state


def spawn_phase(rank: int, world: int, tmp: str, phase: str, args: dict[str, Any]) -> None:
    sharded_workers.PHASES.update(PHASES)  # this process's copy of the table
    sharded_workers.spawn_phase(rank, world, tmp, phase, args)


def _state(model: Any, optimizer: Any, step: int) -> dict[str, Any]:
    return {"model": model, "optimizer": optimizer, "elastic_session": {"step": step, "epoch": 0}}


def train_with_copies(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    """``steps`` steps with an in-memory copy after each (mirrored to the other node) and a
    storage snapshot at step 2; rank 0 saves the full state of step ``expect_at`` (default:
    the last). ``kill_at``: rank 1 is killed while sending its copy of that step."""
    if args.get("kill_at") is not None and rank == 1:
        faults.inject(faults.KillAt("mid_mirror_send", step=args["kill_at"]))
    expect_at = args.get("expect_at", args["steps"])
    blocked = Path(tmp, "node0", "shards", "mirror-00001")  # ``block_mirror_until``
    if args.get("block_mirror_until") and rank == 0:  # a file where the folder goes: the
        blocked.parent.mkdir(parents=True, exist_ok=True)  # mirror's writes fail until then
        blocked.write_text("not a folder")
    model = fsdp_model(world)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    snapshots = SessionSnapshots(f"{tmp}/snaps", keep=None)
    state = _state(model, optimizer, 0)
    tier = ShardedMemoryTier(f"{tmp}/node{rank}", every=1, state=state)
    context = SimpleNamespace(control_dir=None, local_rank=rank)
    # FSDP without replicas: a lost rank's shards are nowhere else, no copy just in time
    failure_copy = open_failure_copy(tier, state, lambda _: None, context)  # type: ignore[arg-type]
    for step in range(1, args["steps"] + 1):
        sharded_workers.train(model, optimizer, 1, rank)
        tier.save(step, _state(model, optimizer, step), {"rng": RNGState()})
        tier.flush()  # every step's copy made (else a busy machine skips some): exact steps
        if step == args.get("block_mirror_until") and rank == 0:
            blocked.unlink()  # before rank 1's next copy: the training step between orders it
        if step == 2:
            snapshots.save(step, _state(model, optimizer, step), epoch=0, blocking=True)
        if step == expect_at:
            gathered = full_state(model, optimizer)
            if rank == 0:
                torch.save(gathered, Path(tmp, "expected.pt"))
    tier.close()  # the mirrors hold the last step once this returns on every rank
    if args.get("kill_at") is not None:  # the peer is dead: no collective, no result
        exit_without_finalizing(0)
    snapshots.close()
    return {"skipped": tier.skipped, "failure_copy": failure_copy is not None}


def train_hsdp(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    """HSDP on two nodes (ranks 0-1 and 2-3; ranks r and r + 2 are replicas): 5 steps, a
    periodic copy every 3 steps, a storage snapshot at step 2. Then node 0's ranks make the
    copy just in time (``on_failure``), as when node 1 is lost: first with rank 1 inside its
    optimizer's step (its copy is declined; the node's folder is kept as ``node0-torn``),
    then consistent. Rank 0 saves the full state of steps 3 and 5."""
    model = fsdp_model(world, replicas=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    snapshots = SessionSnapshots(f"{tmp}/snaps", keep=None)
    state = _state(model, optimizer, 0)
    tier = ShardedMemoryTier(f"{tmp}/node{rank // 2}", every=3, state=state)
    counted = 0

    def capture(stepped: bool) -> tuple[int, dict[str, Any]]:
        return counted + stepped, _state(model, optimizer, counted + stepped)

    context = SimpleNamespace(control_dir=None, local_rank=rank)  # no supervisor to ask
    failure_copy = open_failure_copy(tier, state, capture, context)  # type: ignore[arg-type]
    assert failure_copy is not None  # HSDP: the copy made just in time is on
    for step in range(1, 6):
        sharded_workers.train(model, optimizer, 1, rank)
        with failure_copy.lock:
            counted = step
            failure_copy.counted()
        if tier.due(step):
            tier.save(step, _state(model, optimizer, step), {"rng": RNGState()})
            tier.flush()
        if step == 2:
            snapshots.save(step, _state(model, optimizer, step), epoch=0, blocking=True)
        if step in (3, 5):
            gathered = full_state(model, optimizer)
            if rank == 0:
                torch.save(gathered, Path(tmp, f"expected-{step}.pt"))
    dist.barrier()  # every periodic copy made
    copied = [None, None]
    if rank == 0:
        copied[0] = failure_copy.copy()
    if rank == 1:
        failure_copy._entering()  # inside optimizer.step(), as the group ends
        copied[0] = failure_copy.copy()
    dist.barrier()
    if rank == 0:
        shutil.copytree(Path(tmp, "node0"), Path(tmp, "node0-torn"))
        shutil.copytree(Path(tmp, "snaps"), Path(tmp, "snaps-torn"))
    dist.barrier()
    if rank == 1:
        failure_copy.counted()  # the step is done: its state is consistent again
        copied[1] = failure_copy.copy()
    failure_copy.close()
    tier.close()
    snapshots.close()
    return {"copied": copied, "replicas": list(tier.replicas), "targets": tier.targets}


def resume(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    """The surviving node(s) restore at the new world size; ``lose`` lists node folders
    (``node1``, or a mirror folder too) gone with the lost node. ``folder``: every rank's
    node folder (one node), else ``node<rank>``; ``snaps``: the storage folder."""
    for lost in args.get("lose", []):
        shutil.rmtree(Path(tmp, lost), ignore_errors=True)
    model = fsdp_model(world, seed=1)  # other weights: the restore must replace them all
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    snapshots = SessionSnapshots(f"{tmp}/{args.get('snaps', 'snaps')}", keep=None)
    tier = ShardedMemoryTier(f"{tmp}/{args.get('folder', f'node{rank}')}", every=1)
    with capture_logs() as logs:
        restored = restore_state(tier, snapshots, {"model": model, "optimizer": optimizer})
    tier.after_restore(None if restored is None else restored[0])
    gathered = full_state(model, optimizer)
    if rank == 0:
        torch.save(gathered, Path(tmp, f"loaded-{args['tag']}.pt"))
    tier.close()
    snapshots.close()
    events = [e for e in logs if e.get("event") == "snapshot.restored"]
    return {"step": None if restored is None else restored[0], "restored": events}


PHASES: dict[str, sharded_workers.Phase] = {
    "train_with_copies": train_with_copies,
    "train_hsdp": train_hsdp,
    "resume": resume,
}
