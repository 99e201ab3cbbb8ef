"""An unmodified torchrun-style DDP script that trains STEPS steps of STEP_TIME seconds and
appends ``rank world_size step`` to ARGV1/steps-<rank> after each (no elastic_trainer
imports; a restart starts it over from step 0, as a plain script does)."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    folder, steps, step_time = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        with open(os.path.join(folder, f"steps-{rank}"), "a") as f:
            f.write(f"{rank} {world} {step}\n")
        time.sleep(step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
