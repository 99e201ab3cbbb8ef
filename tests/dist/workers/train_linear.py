"""A tiny fault-tolerant training script, run by the dist tests through the real launcher.

It is also the README example in executable form: a plain torchrun DDP script plus the
elastic_trainer lines marked ``# +``.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elastic_trainer as et
from elastic_trainer import protocol


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=61)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--max-micro-batch", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--snapshot-dir", required=True)
    parser.add_argument("--snapshot-every", type=int, default=3)
    parser.add_argument("--audit-dir", required=True)
    parser.add_argument("--out", required=True, help="final parameters (rank 0, when done)")
    parser.add_argument(
        "--stop-at-step", type=int, default=None, help="rank 0 touches the stop file"
    )
    parser.add_argument(
        "--control-dir-per-rank", action="store_true", help="each rank plays a node of its own"
    )
    return parser.parse_args()


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
        samples, 1, generator=generator
    )
    return TensorDataset(x, y)


def main() -> None:
    args = parse()
    if args.control_dir_per_rank:
        base = os.environ[protocol.ENV_CONTROL_DIR]
        os.environ[protocol.ENV_CONTROL_DIR] = os.path.join(base, f"rank{os.environ['RANK']}")
        os.makedirs(os.environ[protocol.ENV_CONTROL_DIR], exist_ok=True)
    ctx = et.init_worker()  # + (replaces dist.init_process_group)
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = dataset(args.samples)
    sampler = et.ElasticSampler(  # + (was DistributedSampler)
        data, seed=3, global_batch_size=args.global_batch, max_micro_batch_size=args.max_micro_batch
    )
    loader = DataLoader(data, batch_size=sampler.micro_batch_size, sampler=sampler)
    session = et.TrainingSession(  # +
        {"model": model, "optimizer": optimizer},
        sampler,
        snapshot_dir=args.snapshot_dir,
        snapshot_every=args.snapshot_every,
        audit_dir=args.audit_dir,
        max_steps=args.max_steps,
    )
    for _epoch in session.epochs(args.epochs):  # + (was range(epochs) + set_epoch)
        for x, y in loader:
            with session.accumulate(model):  # +
                loss = nn.functional.mse_loss(model(x), y)
                session.scale_loss(loss, len(x)).backward()  # + (was loss.backward())
            if session.step_ready:  # +
                optimizer.step()
                optimizer.zero_grad()
                session.step_done()  # +
                _maybe_request_stop(args, ctx, session.step)
                if session.should_stop:  # +
                    break
    if session.stop_reason is None and ctx.rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, args.out)
    session.finish()  # + (final snapshot; exits with the supervisor's code after a stop)


def _maybe_request_stop(args: argparse.Namespace, ctx: et.WorkerContext, step: int) -> None:
    # Simulates the supervisor's preemption signal: rank 0 creates the node's stop file.
    if args.stop_at_step == step and ctx.rank == 0 and ctx.stop_file:
        open(ctx.stop_file, "w").close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
