"""Worker bodies for the sharded-snapshot dist tests (torch.multiprocessing.spawn, gloo).

Each phase runs in a fresh world of its own size; rank 0 writes what the test compares
(full, gathered states) with torch.save into the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_trainer.entrypoints.worker import exit_without_finalizing
from snapshots import RNGState, SnapshotSaveError, SnapshotStore
from snapshots.distributed import DistributedSnapshotter
from snapshots.storage import faults

Phase = Callable[[int, int, str, dict[str, Any]], dict[str, Any]]


def spawn_phase(rank: int, world: int, tmp: str, phase: str, args: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    rdzv = Path(tmp, f"rdzv-{phase}-{args.get('tag', '')}")
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        result = PHASES[phase](rank, world, tmp, args)
        Path(tmp, f"result-{phase}-{args.get('tag', '')}-{rank}.json").write_text(
            json.dumps(result)
        )
    finally:
        dist.barrier()  # leave together: a peer closing its sockets first can abort gloo
        dist.destroy_process_group()
    # Done: leave without interpreter finalization. gloo's threads (this group's, the
    # snapshotter's own, FSDP's mesh) can still be releasing work objects, and CPython's
    # finalization then aborts the process (SIGABRT, pytorch #190489): the bootstrap that real
    # workers run under does the same (elastic_trainer.entrypoints.worker).
    exit_without_finalizing(0)


def fsdp_model(world: int, *, seed: int = 0, replicas: int = 1) -> torch.nn.Module:
    """Odd sizes, so that shards are uneven at 2 and 3 ranks; one FSDP unit per block.
    ``replicas`` > 1: HSDP, a (replicate, shard) mesh: ranks r and r + world/replicas hold
    the same shards."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5), torch.nn.LayerNorm(5)
    )
    if replicas == 1:
        mesh = init_device_mesh("cpu", (world,))
    else:
        shape, names = (replicas, world // replicas), ("replicate", "shard")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int) -> None:
    for i in range(steps):
        torch.manual_seed(1000 + 10 * i + rank)
        loss = model(torch.randn(4, 7)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: the gathered model and optimizer state (on rank 0; CPU)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optimizer": osd}


def _snapshotter(tmp: str, args: dict[str, Any]) -> DistributedSnapshotter:
    url = args.get("url") or f"{tmp}/snaps"
    store = SnapshotStore(url, keep=None, storage_options=args.get("storage_options"))
    return DistributedSnapshotter(store, sharded=args.get("sharded"))


def fsdp_save(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    model = fsdp_model(world)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    snap = _snapshotter(tmp, args)
    state = {"model": model, "optimizer": optimizer, "meta": {"note": "x"}}
    out: dict[str, Any] = {}
    for step in args.get("steps", [2]):
        train(model, optimizer, 2, rank)
        handle = snap.save(step, state, per_rank={"rng": RNGState()})
        out["handle"] = handle is not None
        snap.wait()
        gathered = full_state(model, optimizer)
        if rank == 0:
            torch.save(gathered, Path(tmp, f"expected-{step}.pt"))
    out["committed"] = snap.last_committed_step
    out["local"] = _local_digest(model, optimizer)
    snap.close()
    return out


def fsdp_load(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    model = fsdp_model(world, seed=1)  # other weights: the load must replace them all
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    snap = _snapshotter(tmp, args)
    loaded = snap.load(into={"model": model, "optimizer": optimizer}, rank_into={"rng": RNGState()})
    gathered = full_state(model, optimizer)
    if rank == 0:
        torch.save(gathered, Path(tmp, f"loaded-{args['tag']}.pt"))
    snap.close()
    assert loaded is not None
    return {
        "step": loaded.info.step,
        "meta": loaded.state["meta"],
        "local": _local_digest(model, optimizer),
    }


def _local_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Bit-exact fingerprints of this rank's local shards (parameters and Adam state)."""
    import hashlib

    out = []
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out.append(hashlib.sha256(local.detach().contiguous().numpy().tobytes()).hexdigest())
        for value in optimizer.state.get(p, {}).values():
            value = value.to_local() if hasattr(value, "to_local") else value
            out.append(hashlib.sha256(value.detach().contiguous().numpy().tobytes()).hexdigest())
    return out


def ddp_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # replicated: identical on every rank
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])


def ddp_save(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    model = ddp_model()
    snap = _snapshotter(tmp, {**args, "sharded": True})
    snap.save(1, {"model": model}, blocking=True)
    snap.close()
    if rank == 0:
        torch.save(model.state_dict(), Path(tmp, "expected-ddp.pt"))
    return {"committed": snap.last_committed_step}


def ddp_load(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    model = ddp_model(seed=1)
    snap = _snapshotter(tmp, args)
    loaded = snap.load(into={"model": model})
    if rank == world - 1:
        torch.save(model.state_dict(), Path(tmp, f"loaded-ddp-{args['tag']}.pt"))
    snap.close()
    return {"step": loaded.info.step if loaded is not None else None}


def fsdp_kill(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    """Save step 2, then step 4 with one rank SIGKILLed at a fault point of its save."""
    if rank == args["kill_rank"]:
        faults.inject(faults.KillAt.parse(args["kill_at"]))
    return fsdp_save(rank, world, tmp, {**args, "steps": [2, 4]})


def fsdp_deadline(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    """Step 2 saved in the background, then a blocking save of step 4 with a short deadline
    while rank 0's writer is still busy with step 2 (held in its retention pass, as by a
    slow storage listing): rank 0 gives up before copying, the other ranks could start."""
    model = fsdp_model(world)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    snap = _snapshotter(tmp, args)
    snap.commit_timeout_s = args["commit_timeout_s"]
    state = {"model": model, "optimizer": optimizer}
    release = threading.Event()
    if rank == 0:
        prune = snap.store._prune_after_save

        def held(step: int) -> None:
            release.wait()
            prune(step)

        snap.store._prune_after_save = held  # type: ignore[method-assign]
    train(model, optimizer, 2, rank)
    handle = snap.save(2, state)
    if rank != 0 and handle is not None:
        handle.result()  # committed: this rank's writer is idle, rank 0's is not
    began = time.monotonic()
    raised = None
    try:
        with snap.store.deadline(args["deadline_s"]):
            snap.save(4, state, blocking=True)
    except SnapshotSaveError as exc:
        raised = str(exc)
    release.set()
    snap.close()
    return {
        "raised": raised,
        "seconds": time.monotonic() - began,
        "committed": snap.last_committed_step,
    }


PHASES: dict[str, Phase] = {
    "fsdp_deadline": fsdp_deadline,
    "fsdp_save": fsdp_save,
    "fsdp_load": fsdp_load,
    "fsdp_kill": fsdp_kill,
    "ddp_save": ddp_save,
    "ddp_load": ddp_load,
}
