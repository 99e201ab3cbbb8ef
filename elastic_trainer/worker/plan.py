"""Pure data-order math: the epoch permutation, the global cursor and the split over ranks.

Nothing here touches ``torch.distributed``; the sampler and the session are thin shells over
these functions, so the exactly-once guarantees are proved by fast property tests.

Terms (all positions are offsets into the epoch's permutation):

* **permutation** — one order of ``range(num_samples)`` per ``(seed, epoch)``, independent of
  the world size.
* **cursor** — how many positions of the epoch completed optimizer steps have consumed.
* **step** — with a fixed ``global_batch_size`` B, step k of an epoch covers positions
  ``[k*B, min((k+1)*B, end))``; only the last step of an epoch can be shorter (never with
  ``drop_last``, which drops the ``num_samples % B`` tail).
* **rank share** — rank r of W takes the step's positions ``r, r+W, r+2W, ...`` (strided).
  Strided keeps shares balanced (sizes differ by at most one) and makes the consumed part of
  the epoch a *prefix* of the permutation whenever every rank consumed the same count, which
  is what lets a single integer (the cursor) describe progress at any world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elastic_trainer.errors import ConfigError, SamplerStateError

_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    # A fixed integer mixer (Steele et al.): stable across Python/torch versions and platforms.
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """Mix integers (seed, epoch, index...) into one 63-bit generator seed, order-sensitive.

    Unlike ``seed + epoch`` (DistributedSampler), (seed=1, epoch=0) and (seed=0, epoch=1)
    give unrelated streams.
    """
    state = 0x243F6A8885A308D3  # any fixed non-zero start value
    for part in parts:
        state = _splitmix64(state ^ (int(part) & _MASK64))
    return state & _MASK63


def epoch_permutation(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The order of the epoch as an int64 tensor; identical on every rank and world size."""
    if not shuffle:
        return torch.arange(num_samples, dtype=torch.int64)
    generator = torch.Generator()
    generator.manual_seed(mix_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def epoch_end(num_samples: int, global_batch_size: int | None, drop_last: bool) -> int:
    """How many positions of the permutation an epoch trains (fixed-global-batch mode)."""
    if drop_last and global_batch_size:
        return num_samples - num_samples % global_batch_size
    return num_samples


def plain_end(num_samples: int, stream_start: int, world_size: int, drop_last: bool) -> int:
    """Epoch end without a global batch: like DistributedSampler, drop_last trims the
    remainder (from where this attempt's iteration started) to a multiple of the world size."""
    if not drop_last:
        return num_samples
    remaining = max(num_samples - stream_start, 0)
    return stream_start + remaining - remaining % world_size


def strided_share(start: int, stop: int, rank: int, world_size: int) -> range:
    """Positions of ``[start, stop)`` that rank ``rank`` of ``world_size`` takes."""
    return range(start + rank, stop, world_size)


def share_size(count: int, rank: int, world_size: int) -> int:
    """len(strided_share(0, count, rank, world_size)) without building it."""
    return max(0, -(-(count - rank) // world_size))


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How one rank assembles its part of each full optimizer step.

    ``per_rank = micro_batch_size * accumulation_steps``; the micro-batch size is the largest
    divisor of ``per_rank`` not above the maximum that fits, so a DataLoader with
    ``batch_size=micro_batch_size`` never straddles two steps.
    """

    global_batch_size: int
    world_size: int
    per_rank: int
    micro_batch_size: int
    accumulation_steps: int


def batch_plan(
    global_batch_size: int, world_size: int, max_micro_batch_size: int | None = None
) -> BatchPlan:
    """Derive per-rank share, micro-batch size and accumulation count; reject impossible ones."""
    if global_batch_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size} must be >= 1")
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be >= 1")
    if global_batch_size < world_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} is smaller than the world size "
            f"{world_size}: every rank needs at least one sample per step; use a global batch "
            f">= {world_size} or fewer ranks"
        )
    if global_batch_size % world_size:
        lower = global_batch_size - global_batch_size % world_size
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not divisible by the world size "
            f"{world_size}: use a multiple of {world_size} (e.g. {lower} or "
            f"{lower + world_size}) or a world size that divides it"
        )
    per_rank = global_batch_size // world_size
    limit = per_rank if max_micro_batch_size is None else max_micro_batch_size
    if limit < 1:
        raise ConfigError(f"max_micro_batch_size={max_micro_batch_size} must be >= 1")
    micro = _largest_divisor_at_most(per_rank, limit)
    return BatchPlan(
        global_batch_size=global_batch_size,
        world_size=world_size,
        per_rank=per_rank,
        micro_batch_size=micro,
        accumulation_steps=per_rank // micro,
    )


def _largest_divisor_at_most(value: int, limit: int) -> int:
    best = 1
    for small in range(1, math.isqrt(value) + 1):
        if value % small == 0:
            for candidate in (small, value // small):
                if best < candidate <= limit:
                    best = candidate
    return best


@dataclass(frozen=True, kw_only=True)
class StepShare:
    """One rank's part of one optimizer step (fixed-global-batch mode).

    ``positions`` index the permutation. A rank with nothing to train in the epoch's short
    last step gets one *padding* position (the step's first) with ``padding=True``: it must
    still run forward/backward so DDP's all-reduce has every rank, and its loss is weighted 0.
    """

    step_in_epoch: int
    step_size: int  # samples of the whole step, all ranks together
    positions: range
    padding: bool
    micro_batches: int  # how many DataLoader batches this rank sees for the step
    loss_scale: float  # multiply a sum-reduced loss by this (0 for padding)

    @property
    def num_samples(self) -> int:
        """Samples this rank really trains in the step (0 for padding)."""
        return 0 if self.padding else len(self.positions)


def step_share(cursor: int, *, end: int, plan: BatchPlan, rank: int) -> StepShare:
    """The share of rank ``rank`` of the step that starts at ``cursor``."""
    batch = plan.global_batch_size
    if cursor % batch or cursor >= end:
        raise SamplerStateError(
            f"cursor {cursor} is not the start of a step (global batch {batch}, epoch end "
            f"{end}); the sampler state is corrupt or from another global batch size"
        )
    stop = min(cursor + batch, end)
    positions = strided_share(cursor, stop, rank, plan.world_size)
    padding = len(positions) == 0
    if padding:
        positions = range(cursor, cursor + 1)
    micro = -(-len(positions) // plan.micro_batch_size)
    # DDP averages gradients over W ranks; scaling each rank's summed loss by W / step_size
    # makes the update the mean over the step's samples, whatever W is.
    scale = 0.0 if padding else plan.world_size / (stop - cursor)
    return StepShare(
        step_in_epoch=cursor // batch,
        step_size=stop - cursor,
        positions=positions,
        padding=padding,
        micro_batches=micro,
        loss_scale=scale,
    )


def steps_per_epoch(num_samples: int, global_batch_size: int, drop_last: bool) -> int:
    end = epoch_end(num_samples, global_batch_size, drop_last)
    return -(-end // global_batch_size)
