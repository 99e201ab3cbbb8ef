"""Worker body for the FSDP2 straggler test (``tests/dist/test_stragglers_fsdp.py``), run
through ``sharded_workers.spawn_phase``: each rank trains a tiny FSDP2 model under a
``TrainingSession`` and returns the ``straggler.detected`` events it emitted."""

from __future__ import annotations

from typing import Any

import torch
from structlog.testing import capture_logs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_trainer.worker.context import WorkerContext
from elastic_trainer.worker.session import TrainingSession
from tests.dist import sharded_workers
from tests.slow_modules import Block


def spawn_phase(rank: int, world: int, tmp: str, phase: str, args: dict[str, Any]) -> None:
    sharded_workers.PHASES.update(PHASES)  # this process's copy of the table
    sharded_workers.spawn_phase(rank, world, tmp, phase, args)


def train(rank: int, world: int, tmp: str, args: dict[str, Any]) -> dict[str, Any]:
    """``steps`` steps; from step ``slow_from`` rank ``slow_rank``'s middle block sleeps
    ``forward_s`` in its forward and ``backward_s`` in its backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(16), Block(16), Block(16))
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # the group is this process's own (spawn_phase): the session keeps it
    context = WorkerContext(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=1)
    session = TrainingSession(
        {"model": model, "optimizer": optimizer},
        context=context,
        exit_on_stop=False,
        configure_logs=False,
    )
    with capture_logs() as logs:
        for step in range(1, args["steps"] + 1):
            if rank == args.get("slow_rank") and step == args["slow_from"]:
                model[1].forward_s = args.get("forward_s", 0.0)
                model[1].backward_s = args.get("backward_s", 0.0)
            with session.accumulate(model):
                model(torch.randn(8, 16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            session.step_done(num_samples=8)
        session.close()
    detected = [e for e in logs if e["event"] == "straggler.detected"]
    keys = ("rank", "step", "since_step", "slowdown")
    return {"detected": [{k: e[k] for k in keys} for e in detected]}


PHASES = {"train": train}
