"""How long the just-in-time copy into the node's memory takes, by the size of the state.

A survivor writes its state into its node's memory once, when the group ends (a peer lost),
and the new group reads it back (``worker.memory.slots.NodeCopies``: the mapped slots in
``/dev/shm``, checksummed). The write is part of the downtime of every node loss; with
CUDA tensors it includes the copy from the device. For each size (tensors of 16 MB,
float32), ``--repeats`` times: the copies of a node's first, second and third failure (a
restore between them), and the read the new group makes; medians, with the throughput in
GB/s of state. The first two copies go into new slot files (their pages allocated then);
the third into a file the node has, since a restore keeps the slot files.

    python bench/memory_copy_cost.py [--mb 64,256,1024] [--repeats 3]
    python bench/memory_copy_cost.py --device cuda --mb 256,1024,4096
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from elastic_trainer.worker.memory.slots import NodeCopies

TENSOR_MB = 16


def state_of(mb: int, device: str) -> dict[str, torch.Tensor]:
    count = max(1, mb // TENSOR_MB)
    numel = TENSOR_MB * 2**20 // 4
    return {f"w{i}": torch.randn(numel, device=device) for i in range(count)}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, run: Callable[[], object]) -> float:
    synchronize(device)
    began = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - began


def one_round(device: str, where: str, state: dict[str, torch.Tensor]) -> list[float]:
    """Seconds of the copies of three failures in a row, each followed by the restore's
    ``keep_only`` (which forgets the other copies), then of the last restore's read. Each
    copy maps its slot afresh, as a just-in-time copy does (``MemoryTier.dump``, in a
    process started since the last re-form); the slots alternate."""
    folder = tempfile.mkdtemp(prefix="memory-copy-cost-", dir=where)
    try:
        node = os.path.join(folder, "node")
        seconds = []
        for step in (1, 2, 3):
            copies = NodeCopies(node)
            seconds.append(timed(device, functools.partial(copies.write, step, {"state": state})))
            copies.unmap()
            copies.keep_only(step)
        copies = NodeCopies(node)
        seconds.append(timed(device, functools.partial(copies.read, 3)))
        copies.unmap()
        return seconds
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="64,256,1024", help="state sizes, MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dir", default="/dev/shm", help="where the node's memory folder goes")
    args = parser.parse_args()
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"device {name}, torch {torch.__version__}, folder under {args.dir}")
    print(
        f"{'state MB':>9}"
        + "".join(f" {f'copy {n} s':>9} {'GB/s':>5}" for n in (1, 2, 3))
        + f" {'read s':>7} {'GB/s':>5}"
    )
    for mb in (int(m) for m in args.mb.split(",")):
        state = state_of(mb, args.device)
        size_gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
        rounds = [one_round(args.device, args.dir, state) for _ in range(args.repeats)]
        medians = [statistics.median(r[i] for r in rounds) for i in range(4)]
        columns = "".join(f" {t:>9.3f} {size_gb / t:>5.2f}" for t in medians)
        print(f"{size_gb * 1e3:>9.0f}{columns}")


if __name__ == "__main__":
    main()
