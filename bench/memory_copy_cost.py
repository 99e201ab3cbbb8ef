"""How long the just-in-time copy into the node's memory takes, by the size of the state.

A survivor writes its state into its node's memory once, when the group ends (a peer lost),
and the new group reads it back (``worker.memory.slots.NodeCopies``: the mapped slots in
``/dev/shm``, checksummed). The write is part of the downtime of every node loss; with
CUDA tensors it includes the copy from the device. For each size (tensors of 16 MB,
float32), ``--repeats`` times, each of ``ARMS``: copies into a new slot file and into a slot
reserved beforehand (on a GPU page-locked, and not), the read with one thread and as the tier
makes it, and (GPU) the read with the tensors moved to the device; medians, in seconds and
seconds per GB of state.

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

from elastic_trainer.worker.memory import byte_layout, checked_read, leaf_checksum, pinning
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


ARMS = {
    "new file": "a copy into a new slot file (its pages allocated and mapped by the copy)",
    "reserved": "a copy into a slot reserved and mapped beforehand (MemoryTier.reserve); on a "
    "GPU also page-locked for the device, as the tier does",
    "unpinned": "(GPU) the same into a reserved slot not page-locked",
    "read 1 thread": "the new group's read, one thread (fill, then checksum, in turn)",
    "read": "the read as the tier makes it: several threads fill while one checksums",
    "to device": "(GPU) the read, then every tensor moved to the device (what the restore's "
    "load_state_dict does)",
    "pinned to device": "(GPU) the same with the read buffer page-locked once read (not what "
    "the tier does: does it pay?)",
}


def one_round(device: str, where: str, state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Seconds of each of ``ARMS`` once. Each copy maps its slot afresh, as a just-in-time
    copy in a process started since the last re-form does (``MemoryTier.dump``)."""
    on_gpu = device.startswith("cuda")
    folder = tempfile.mkdtemp(prefix="memory-copy-cost-", dir=where)
    try:
        payload = {"step": 1, "state": state}
        size = byte_layout.plan(payload).size
        seconds = {"new file": copy_once(device, NodeCopies(os.path.join(folder, "a")), payload)}
        shutil.rmtree(os.path.join(folder, "a"))
        if on_gpu:
            unpinned = NodeCopies(os.path.join(folder, "u"))
            unpinned.reserve(size, pin=False)
            seconds["unpinned"] = copy_once(device, unpinned, payload)
            shutil.rmtree(os.path.join(folder, "u"))
        reserved = NodeCopies(os.path.join(folder, "b"))
        reserved.reserve(size, pin=on_gpu)
        seconds["reserved"] = copy_once(device, reserved, payload, unmap=False)
        leaf_checksum.MAX_THREADS, cap = 1, leaf_checksum.MAX_THREADS
        try:
            seconds["read 1 thread"] = timed(device, functools.partial(reserved.read, 1))
        finally:
            leaf_checksum.MAX_THREADS = cap
        seconds["read"] = timed(device, functools.partial(reserved.read, 1))
        if on_gpu:
            seconds["to device"] = timed(device, functools.partial(to_device, reserved, device))
            pinned = functools.partial(pinned_to_device, reserved, device)
            seconds["pinned to device"] = timed(device, pinned)
        reserved.unmap()
        return seconds
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def to_device(copies: NodeCopies, device: str) -> None:
    restored = copies.read(1)["state"]
    for value in restored.values():
        value.to(device)


def pinned_to_device(copies: NodeCopies, device: str) -> None:
    copy = copies.newest_copy()
    assert copy is not None
    path = os.path.join(copies.directory, copy.slot)
    ranges = [(part["start"], part["stop"]) for part in copy.parts]
    data, digests = checked_read.read_file(path, copy.size, ranges)
    for part, digest in zip(copy.parts, digests, strict=True):
        byte_layout.compare(digest, part.get(byte_layout.CHECKSUM_ALGORITHM), copy.slot)
    whole = torch.frombuffer(data, dtype=torch.uint8)
    if not pinning.register(whole):
        raise SystemExit("the read buffer could not be page-locked")
    try:
        restored = byte_layout.read(data)["state"]
        for value in restored.values():
            value.to(device)
    finally:
        pinning.unregister(whole)


def copy_once(
    device: str, copies: NodeCopies, payload: dict[str, object], *, unmap: bool = True
) -> float:
    try:
        return timed(device, functools.partial(copies.write, 1, payload))
    finally:
        if unmap:
            copies.unmap()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="64,256,1024", help="state sizes, MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dir", default="/dev/shm", help="where the node's memory folder goes")
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    threads = leaf_checksum.worker_threads()
    print(f"device {name}, torch {torch.__version__}, folder under {args.dir}, {threads} threads")
    arms = [a for a in ARMS if on_gpu or a not in ("unpinned", "to device", "pinned to device")]
    for arm in arms:
        print(f"  {arm}: {ARMS[arm]}")
    print(f"{'state MB':>9}" + "".join(f" | {arm:>13} s  s/GB" for arm in arms))
    for mb in (int(m) for m in args.mb.split(",")):
        state = state_of(mb, args.device)
        size_gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
        rounds = [one_round(args.device, args.dir, state) for _ in range(args.repeats)]
        medians = {arm: statistics.median(r[arm] for r in rounds) for arm in arms}
        columns = "".join(f" | {medians[a]:>15.3f} {medians[a] / size_gb:>5.3f}" for a in arms)
        print(f"{size_gb * 1e3:>9.0f}{columns}", flush=True)
        del state
        if on_gpu:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
