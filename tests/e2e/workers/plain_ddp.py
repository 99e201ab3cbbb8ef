"""An unmodified torchrun-style DDP script: no imports from elastic_trainer.

Rank 1 exits with an error on the first attempt (TORCHELASTIC_RESTART_COUNT == 0); the
second attempt trains to the end and rank 0 writes the environment it saw to argv[1].
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        if step == 3 and rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            sys.exit(1)
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    keys = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
    ]
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({k: os.environ.get(k) for k in keys}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
