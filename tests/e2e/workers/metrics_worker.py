"""A TrainingSession worker for the metrics e2e tests: DDP on random data, the loss logged
with ``session.log_metrics`` every step, and one injectable hang.

--hang-at STEP: rank 0 stops making progress before that step, once (the --marker file
remembers it), so the restarted attempt trains on.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_trainer as et


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--marker", default="")
    return p.parse_args()


def hang_once(marker: str) -> None:
    if os.path.exists(marker):
        return
    with open(marker, "w"):
        pass
    while True:  # no progress, no exit: only the watchdog ends this
        time.sleep(1)


def main() -> None:
    args = parse()
    ctx = et.init_worker()
    torch.manual_seed(ctx.rank)
    model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = et.TrainingSession({"model": model, "optimizer": optimizer}, max_steps=args.steps)
    while not session.should_stop:
        if session.step + 1 == args.hang_at and ctx.rank == 0:
            hang_once(args.marker)
        x = torch.randn(16, 8)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        time.sleep(args.step_time)
        optimizer.step()
        optimizer.zero_grad()
        session.step_done()
        session.log_metrics(loss=loss.item())
    session.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
