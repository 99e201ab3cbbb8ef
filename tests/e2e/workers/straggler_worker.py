"""A DDP job under TrainingSession with a fixed amount of compute per step, and the test's
own seam that makes one node slow (docs/stragglers.md).

--slow-node NAME --slow-from STEP --slow-s S: on the node named NAME (its --node), from step
STEP on, the model's forward sleeps S seconds more: slowness inside the step, where a
throttled CPU or a slow device would put it. --trace FILE: this rank appends
"step unix_time pid" after every step, so a test that injects slowness from outside
(SIGSTOP, a CPU quota) knows the process to slow and the step it began at. --slow-while FILE:
the seam sleeps only while FILE exists (the test ends the slowness by removing it).
--base-s S: every rank's forward sleeps S / world size seconds as well: a global batch's time
shared by the ranks (fewer ranks, each takes longer), and one that does not compete for the
machine's cores (three workers on two cores step slower than two, whatever a straggler does).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_trainer as et


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--width", type=int, default=640, help="matrix side of the compute")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--slow-node", default="")
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--slow-s", type=float, default=0.0)
    p.add_argument("--slow-while", default="")
    p.add_argument("--base-s", type=float, default=0.0)
    p.add_argument("--trace", default="")
    return p.parse_args()


class Seam(torch.nn.Module):
    """Sleeps ``seconds`` in forward once ``armed`` (the test's slow node)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return x


def model_of(args: argparse.Namespace, seam: Seam) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [seam]
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    et.init_worker()  # the process group, before DDP
    seam = Seam()
    model = DDP(model_of(args, seam))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    session = et.TrainingSession({"model": model, "optimizer": optimizer}, max_steps=args.steps)
    node = os.environ.get("ELASTIC_TRAIN_NODE", "")
    data = torch.randn(64, args.width)
    while not session.should_stop:
        slow = node == args.slow_node and session.step + 1 >= args.slow_from
        if slow and args.slow_while:
            slow = os.path.exists(args.slow_while)
        share = args.base_s / torch.distributed.get_world_size()
        seam.seconds = share + (args.slow_s if slow else 0.0)
        with session.accumulate(model):
            loss = model(data).square().mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        session.step_done()
        traced(args.trace, session.step)
    session.finish()


def traced(path: str, step: int) -> None:
    if path:
        with open(path, "a") as trace:
            trace.write(f"{step} {time.time()} {os.getpid()}\n")


if __name__ == "__main__":
    main()
