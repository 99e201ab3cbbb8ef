"""How long the just-in-time copy into the node's memory takes, by the size of the state.

A survivor writes its state into its node's memory once, when the group ends (a peer lost),
and the new group reads it back (``worker.memory.slots.NodeCopies``: the mapped slots in
``/dev/shm``, checksummed). The write is part of the downtime of every node loss; with
CUDA tensors it includes the copy from the device. For each size (tensors of 16 MB,
float32), ``--repeats`` times: a copy into a new slot file (its pages allocated and mapped
by the copy), a copy into a slot reserved and mapped beforehand by the same process (what
each rank does at an attempt's first counted step: ``MemoryTier.reserve``), and the read
the new group makes; medians, with the throughput in GB/s of state.

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

from elastic_trainer.worker.memory import byte_layout
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
    """Seconds of a copy into a new slot file, of one into a slot reserved beforehand (what
    the session does at an attempt's first step: ``MemoryTier.reserve``), and of the read.
    Each copy maps its slot afresh, as a just-in-time copy does (``MemoryTier.dump``, in a
    process started since the last re-form)."""
    folder = tempfile.mkdtemp(prefix="memory-copy-cost-", dir=where)
    try:
        fresh, reserved = (
            NodeCopies(os.path.join(folder, "a")),
            NodeCopies(os.path.join(folder, "b")),
        )
        payload = {"step": 1, "state": state}
        reserved.reserve(byte_layout.plan(payload).size)
        seconds = [copy_once(device, copies, payload) for copies in (fresh, reserved)]
        seconds.append(timed(device, functools.partial(reserved.read, 1)))
        reserved.unmap()
        return seconds
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def copy_once(device: str, copies: NodeCopies, payload: dict[str, object]) -> float:
    try:
        return timed(device, functools.partial(copies.write, 1, payload))
    finally:
        copies.unmap()


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
        + "".join(f" {name:>13} {'GB/s':>5}" for name in ("new file s", "reserved s"))
        + f" {'read s':>7} {'GB/s':>5}"
    )
    for mb in (int(m) for m in args.mb.split(",")):
        state = state_of(mb, args.device)
        size_gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
        rounds = [one_round(args.device, args.dir, state) for _ in range(args.repeats)]
        medians = [statistics.median(r[i] for r in rounds) for i in range(3)]
        columns = "".join(f" {t:>13.3f} {size_gb / t:>5.2f}" for t in medians[:2])
        columns += f" {medians[2]:>7.3f} {size_gb / medians[2]:>5.2f}"
        print(f"{size_gb * 1e3:>9.0f}{columns}")


if __name__ == "__main__":
    main()
