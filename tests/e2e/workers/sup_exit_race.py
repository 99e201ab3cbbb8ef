"""An unmodified torchrun-style DDP script (no imports from elastic_trainer) whose every exit
races gloo's worker threads against interpreter shutdown.

Each attempt trains a few DDP steps, then starts one more all-reduce it never waits for (a
fire-and-forget metric) and leaves. The collective completes on gloo's thread while the main
thread is already exiting; its clean-up needs the GIL. Run plainly (``python script``) this
aborts the process with SIGABRT ("terminate called without an active exception") in most
runs: see elastic_trainer/worker/bootstrap.py. Rank 1 exits with ``--fail-code`` on the
first ``--fail-attempts`` attempts, so one supervisor run exercises several exits.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-attempts", type=int, default=0)
    p.add_argument("--fail-code", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    dist.all_reduce(torch.ones(1000), async_op=True)  # never waited for
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    return args.fail_code if rank == 1 and attempt < args.fail_attempts else 0


if __name__ == "__main__":
    sys.exit(main())
