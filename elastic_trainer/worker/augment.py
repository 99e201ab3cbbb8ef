"""Per-sample determinism: random augmentation seeded by (seed, epoch, sample index).

A sample must be transformed the same way whichever rank (and whichever world size, after a
restart) happens to process it; seeding from the process's own RNG would tie it to the rank.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar

import torch

from elastic_trainer.worker.plan import mix_seed

# Keeps augmentation streams apart from the epoch permutation's (which mixes seed, epoch).
_AUGMENT_DOMAIN = 0xA06_3E47


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch; independent of rank and world size."""
    return mix_seed(seed, epoch, index, _AUGMENT_DOMAIN)


def sample_generator(
    seed: int, epoch: int, index: int, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A fresh ``torch.Generator`` for one sample: pass it to ``torch.rand(..., generator=g)``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(sample_seed(seed, epoch, index))
    return generator


@contextmanager
def sample_rng(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Seed torch's CPU RNG and Python's ``random`` for one sample, then restore both.

    For transforms that draw from the global RNG (torchvision's), wrap the call in this.
    """
    value = sample_seed(seed, epoch, index)
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(value)
        random.seed(value)
        try:
            yield
        finally:
            random.setstate(python_state)


class _Indexable(Sized, Protocol):
    def __getitem__(self, index: int) -> Any: ...


T = TypeVar("T")


class AugmentedDataset(Generic[T]):
    """Applies ``transform`` to ``dataset[index]`` under :func:`sample_rng`.

    ``TrainingSession.epochs`` calls ``set_epoch`` on the sampler's dataset when it has one.
    With ``persistent_workers=True`` DataLoader workers keep their own copy: call
    ``set_epoch`` before the loader's workers start instead.
    """

    def __init__(self, dataset: _Indexable, transform: Callable[[Any], T], *, seed: int) -> None:
        self.dataset = dataset
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> T:
        with sample_rng(self.seed, self.epoch, index):
            return self.transform(self.dataset[index])
