"""A torchrun-style script that records the ranks each worker was given.

Each worker writes ``ARGV1/NODE_TAG-LOCAL_RANK.json`` with its RANK, GROUP_RANK and the rank
the process group agrees on. The worker on node ``n1`` with local rank 0 fails once (first
attempt), so the ranks are checked again after the re-rendezvous of the restart.
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    tag, local = os.environ["NODE_TAG"], os.environ["LOCAL_RANK"]
    if tag == "n1" and local == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        sys.exit(1)
    ranks = torch.zeros(dist.get_world_size())
    ranks[dist.get_rank()] = 1
    dist.all_reduce(ranks)  # every rank taken exactly once
    seen = {k: os.environ[k] for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE")}
    seen["pg_rank"] = dist.get_rank()
    seen["GLIBC_TUNABLES"] = os.environ.get("GLIBC_TUNABLES")  # the supervisor's malloc tuning
    seen["all_ranks_once"] = bool((ranks == 1).all())
    with open(os.path.join(sys.argv[1], f"{tag}-{local}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
