"""examples/fault_tolerant_ddp.py with knobs for the supervisor session e2e tests.

The loop is the example's, unchanged; the test adds an audit directory, the run length and a
per-step sleep (so the test can act mid-epoch on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elastic_trainer as et


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--audit-dir", required=True)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard), not DDP")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds slept per step")
    parser.add_argument(
        "--hold-file",
        help="while it exists, a step at world size 1 takes HOLD_STEP_S: the job "
        "cannot end before the test has grown it again, however loaded the machine",
    )
    parser.add_argument(
        "--die-once",
        help="if this file does not exist yet: create it and exit 3 before joining the group "
        "(a node whose worker dies while a new group forms)",
    )
    return parser.parse_args()


HOLD_STEP_S = 1.0
DIED_ONCE = 3


def _hold(hold_file: str | None) -> None:
    """Up to HOLD_STEP_S per step while ``hold_file`` exists at world size 1 (then a step
    resumes at once when the test removes it)."""
    if not hold_file or torch.distributed.get_world_size() != 1:
        return
    deadline = time.monotonic() + HOLD_STEP_S
    while os.path.exists(hold_file) and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> None:
    args = parse()
    if args.die_once:
        try:
            open(args.die_once, "x").close()
        except FileExistsError:
            pass
        else:
            raise SystemExit(DIED_ONCE)
    ctx = et.init_worker()
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(args.samples, 16), torch.randint(0, 4, (args.samples,)))
    model = torch.nn.Linear(16, 4).to(ctx.device)
    if args.fsdp:  # its parameters become DTensors: each rank keeps its own shards
        mesh = init_device_mesh(ctx.device.type, (torch.distributed.get_world_size(),))
        model = fully_shard(model, mesh=mesh)
    else:
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = et.ElasticSampler(dataset, seed=0, global_batch_size=args.global_batch)
    loader = DataLoader(dataset, batch_size=sampler.micro_batch_size, sampler=sampler)
    session = et.TrainingSession(
        {"model": model, "optimizer": optimizer}, sampler, audit_dir=args.audit_dir
    )
    for _epoch in session.epochs(args.epochs):
        for x, y in loader:
            x, y = x.to(ctx.device), y.to(ctx.device)
            with session.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                session.scale_loss(loss, len(x)).backward()
            if session.step_ready:
                time.sleep(args.step_time)  # a slow step: the test acts mid-epoch
                _hold(args.hold_file)
                optimizer.step()
                optimizer.zero_grad()
                session.step_done()
                if session.should_stop:
                    break
    session.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
