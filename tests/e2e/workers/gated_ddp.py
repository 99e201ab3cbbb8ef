"""A torchrun-style DDP script that fails once and then waits at a gate.

Rank 1 exits with an error on the first attempt (before joining the process group), unless
``--no-failure`` follows the folder; then every rank trains a step, rank 0 writes the
environment it saw to ``ARGV1/env.json`` and ``ARGV1/waiting``, and all wait until the test
creates ``ARGV1/go`` (the test inspects or attacks the live job meanwhile).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    folder = sys.argv[1]
    fails = "--no-failure" not in sys.argv[2:]
    if fails and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        sys.exit(1)  # before the process group: rank 0 waits in it for the restart
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    model(torch.randn(8, 4)).sum().backward()
    if rank == 0:
        keys = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
        with open(os.path.join(folder, "env.json"), "w") as f:
            json.dump({k: os.environ.get(k) for k in keys}, f)
        open(os.path.join(folder, "waiting"), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.1)  # a worker polling a file the test writes: no timing assumed
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
