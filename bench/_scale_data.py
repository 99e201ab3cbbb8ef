"""bench/scale.py --data-plane W: the gloo process group of W ranks on this machine, apart from
the control plane: ``init_process_group`` (every rank connects to every other through the
TCPStore rendezvous) and the first all-reduce, per rank.

The ranks are forked from this process after its ``import torch`` (as the agents are, so W is
bounded by CPU and sockets, not by W copies of torch's import-time memory); each writes its
times to a pipe.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from _recovery_run import free_port


def _rank(rank: int, world: int, port: int, out: int) -> None:
    began = time.monotonic()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    formed = time.monotonic()
    tensor = torch.ones(1024)
    dist.all_reduce(tensor)
    reduced = time.monotonic()
    ok = bool(tensor[0].item() == world)
    os.write(out, (json.dumps([formed - began, reduced - formed, ok]) + "\n").encode())
    dist.destroy_process_group()


def run_ranks(world: int) -> list[list[float]]:
    """[init s, first all-reduce s, correct] of every rank."""
    port = free_port()
    read, write = os.pipe()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                _rank(rank, world, port, write)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(write)
    with os.fdopen(read) as lines:
        found = [json.loads(line) for line in lines]
    for pid in pids:
        os.waitpid(pid, 0)
    return found


def data_plane(world: int) -> str:
    ranks = run_ranks(world)
    if len(ranks) < world or not all(r[2] for r in ranks):
        return f"data plane, gloo, {world} ranks: {len(ranks)} of {world} ranks finished"
    init = sorted(r[0] for r in ranks)
    first = sorted(r[1] for r in ranks)
    return (
        f"| gloo ranks | init_process_group (s), median / max | first all-reduce (s), "
        f"median / max |\n|---|---|---|\n| {world} | {init[len(init) // 2]:.2f} / "
        f"{init[-1]:.2f} | {first[len(first) // 2]:.3f} / {first[-1]:.3f} |"
    )
