"""A user script that uses CUDA, for the warm-pool test: it writes which GPU it got and
whether CUDA was initialised before its own code ran, then one NCCL all-reduce; rank
``world_size - 1`` kills itself once (restart 0) so the restart forks from the pool."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

CUDA_BEFORE = torch.cuda.is_initialized()  # inherited from the pool if True

import torch.distributed as dist  # noqa: E402

import elastic_trainer  # noqa: E402

out = sys.argv[1]
ctx = elastic_trainer.init_worker()
tensor = torch.ones(1, device=ctx.device)
dist.all_reduce(tensor)
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
with open(os.path.join(out, f"probe-{restart}-{ctx.local_rank}.json"), "w") as f:
    json.dump(
        {
            "local_rank": ctx.local_rank,
            "env_local_rank": int(os.environ["LOCAL_RANK"]),
            "device": str(ctx.device),
            "current": torch.cuda.current_device(),
            "cuda_before": CUDA_BEFORE,
            "sum": tensor.item(),
            "backend": dist.get_backend(),
        },
        f,
    )
if restart == 0 and ctx.rank == ctx.world_size - 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
