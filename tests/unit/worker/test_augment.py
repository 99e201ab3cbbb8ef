"""Per-sample augmentation seeds: same sample, same transform, whichever rank runs it."""

from __future__ import annotations

import random

import torch

from elastic_trainer.worker.augment import (
    AugmentedDataset,
    sample_generator,
    sample_rng,
    sample_seed,
)


def test_seed_depends_on_seed_epoch_and_index_only():
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)
    assert len({sample_seed(1, 2, 3), sample_seed(1, 2, 4), sample_seed(1, 3, 3)}) == 3
    assert 0 <= sample_seed(2**70, -1, 5) < 2**63


def test_generator_draws_are_reproducible():
    first = torch.rand(4, generator=sample_generator(0, 1, 42))
    again = torch.rand(4, generator=sample_generator(0, 1, 42))
    other = torch.rand(4, generator=sample_generator(0, 1, 43))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_sample_rng_seeds_global_rngs_and_restores_them():
    torch.manual_seed(123)
    random.seed(123)
    expected_after = (torch.rand(1), random.random())
    torch.manual_seed(123)
    random.seed(123)
    with sample_rng(5, 0, 9):
        inside = (torch.rand(2), random.random())
    # the caller's streams continue as if nothing had happened
    assert torch.equal(torch.rand(1), expected_after[0])
    assert random.random() == expected_after[1]
    with sample_rng(5, 0, 9):
        assert torch.equal(torch.rand(2), inside[0])
        assert random.random() == inside[1]


def _noisy(x):
    return x + torch.rand(()) + random.random()


def test_augmented_dataset_is_independent_of_access_order_and_process_rng():
    data = AugmentedDataset(torch.zeros(6), _noisy, seed=3)
    forward = [data[i] for i in range(6)]
    torch.manual_seed(999)  # another "rank" with another RNG history, reading backwards
    backward = [data[i] for i in reversed(range(6))][::-1]
    assert forward == backward
    data.set_epoch(1)
    assert [data[i] for i in range(6)] != forward
    assert len(data) == 6
