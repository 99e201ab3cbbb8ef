"""Tiny gloo worker for the standalone-store tests.

Every step all-reduces a one and checks the sum equals the world size (so a step counts
only when every rank of the current world took part), then rewrites
``OUT/rank-<rank>.json`` with what the test needs to see. Runs until ``OUT/done`` exists,
then all ranks agree to stop and exit 0.

Plain torchrun environment only (RANK, WORLD_SIZE, MASTER_ADDR...): the same script runs
under ``elastic-train`` and ``python -m torch.distributed.run``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

STEP_S = 0.1  # paces the loop so a 2-core machine is not saturated; not a synchronisation


def publish(out: str, rank: int, record: dict) -> None:
    path = os.path.join(out, f"rank-{rank}.json")
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def main(out: str) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    record = {
        "rank": rank,
        "world_size": world_size,
        "node": os.environ.get("STORE_TEST_NODE", ""),
        "pid": os.getpid(),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    step = 0
    while True:
        flags = torch.tensor([1.0, float(os.path.exists(os.path.join(out, "done")))])
        dist.all_reduce(flags)
        if int(flags[0]) != world_size:
            raise RuntimeError(f"all_reduce gave {flags[0]}, expected {world_size}")
        if flags[1] > 0:
            break
        step += 1
        publish(out, rank, {**record, "step": step, "time": time.time()})
        time.sleep(STEP_S)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
