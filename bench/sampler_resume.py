"""Resume cost of ElasticSampler vs naive batch skipping, on a 1M-sample epoch.

Time from "restore the data position" to the first batch, at cursor 0, 50% and 99% of the
epoch. ElasticSampler: ``load_state_dict`` + ``next(iter(loader))`` (index arithmetic over
the epoch permutation). Naive: a fresh DistributedSampler loader, fetching and discarding
batches up to the position (what fast-forwarding a loader costs). Both measured here, in
the same run; the ratio is the figure to read.

    python bench/sampler_resume.py [--samples 1000000] [--world-size 2] [--batch 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from elastic_trainer.worker.sampler import ElasticSampler


class Indices(Dataset[torch.Tensor]):
    """A sample is its index as a small tensor: the cheapest dataset a loader can fetch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


def elastic_resume(data: Indices, cursor: int, world: int, batch: int) -> float:
    sampler = ElasticSampler(
        data, num_replicas=world, rank=0, seed=0, global_batch_size=batch * world
    )
    state = {**sampler.state_dict(), "epoch": 1, "cursor": cursor}
    started = time.perf_counter()
    fresh = ElasticSampler(
        data, num_replicas=world, rank=0, seed=0, global_batch_size=batch * world
    )
    fresh.load_state_dict(state)
    next(iter(DataLoader(data, batch_size=fresh.micro_batch_size, sampler=fresh)))
    return time.perf_counter() - started


def naive_resume(data: Indices, cursor: int, world: int, batch: int) -> float:
    started = time.perf_counter()
    sampler = DistributedSampler(data, num_replicas=world, rank=0, seed=0)
    sampler.set_epoch(1)
    batches = iter(DataLoader(data, batch_size=batch, sampler=sampler))
    for _ in range(cursor // (batch * world)):
        next(batches)  # fetched and thrown away
    next(batches)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256, help="per-rank batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data, step = Indices(args.samples), args.batch * args.world_size
    elastic_resume(data, 0, args.world_size, args.batch)  # warm-up: first-call costs of torch
    print(f"{args.samples} samples, world size {args.world_size}, global batch {step}")
    print(
        f"{'position':>8} {'cursor':>9} {'elastic ms':>11} {'naive ms':>10} {'naive/elastic':>14}"
    )
    for fraction in (0.0, 0.5, 0.99):
        cursor = int(args.samples * fraction) // step * step
        ours = statistics.median(
            elastic_resume(data, cursor, args.world_size, args.batch) for _ in range(args.repeats)
        )
        naive = naive_resume(data, cursor, args.world_size, args.batch)  # once: it is slow
        print(
            f"{fraction:>8.0%} {cursor:>9} {ours * 1e3:>11.1f} {naive * 1e3:>10.1f} "
            f"{naive / ours:>14.1f}"
        )


if __name__ == "__main__":
    main()
