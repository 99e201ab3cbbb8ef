"""Pure plan math: permutations, batch plans, step shares and loss scaling."""

from __future__ import annotations

import pytest
import torch

from elastic_trainer.errors import ConfigError, SamplerStateError
from elastic_trainer.worker import plan as P


def test_permutation_depends_on_seed_and_epoch_only():
    first = P.epoch_permutation(100, seed=3, epoch=1, shuffle=True)
    assert torch.equal(first, P.epoch_permutation(100, seed=3, epoch=1, shuffle=True))
    assert sorted(first.tolist()) == list(range(100))
    assert not torch.equal(first, P.epoch_permutation(100, seed=3, epoch=2, shuffle=True))
    # seed+epoch collisions of DistributedSampler (seed 1/epoch 0 == seed 0/epoch 1) are gone
    assert not torch.equal(
        P.epoch_permutation(100, seed=1, epoch=0, shuffle=True),
        P.epoch_permutation(100, seed=0, epoch=1, shuffle=True),
    )


def test_permutation_is_stable_across_releases():
    # Literals: changing the mixer or the generator would silently reorder resumed epochs.
    assert P.mix_seed(0, 0) == 1416872143380894341
    assert P.mix_seed(7, 3) == 4718995000918919189
    assert P.epoch_permutation(10, seed=0, epoch=0, shuffle=True).tolist() == [
        5, 9, 6, 1, 4, 8, 7, 2, 3, 0
    ]  # fmt: skip
    assert P.epoch_permutation(10, seed=12345, epoch=7, shuffle=True).tolist() == [
        9, 7, 3, 5, 0, 6, 8, 1, 2, 4
    ]  # fmt: skip


def test_unshuffled_order_is_the_identity():
    assert P.epoch_permutation(5, seed=9, epoch=4, shuffle=False).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("batch", "world", "max_micro", "per_rank", "micro", "accum"),
    [
        (64, 2, None, 32, 32, 1),
        (64, 2, 8, 32, 8, 4),
        (60, 4, 7, 15, 5, 3),  # 7 does not divide 15: the largest divisor below it is used
        (12, 3, 100, 4, 4, 1),
        (13, 1, 4, 13, 1, 13),  # a prime share forces micro-batches of one
    ],
)
def test_batch_plan_derives_micro_batch_and_accumulation(
    batch, world, max_micro, per_rank, micro, accum
):
    plan = P.batch_plan(batch, world, max_micro)
    assert (plan.per_rank, plan.micro_batch_size, plan.accumulation_steps) == (
        per_rank,
        micro,
        accum,
    )


@pytest.mark.parametrize(
    ("batch", "world", "max_micro", "words"),
    [
        (10, 4, None, ["global_batch_size=10", "world size 4", "8 or 12"]),
        (2, 3, None, ["global_batch_size=2", "smaller than the world size 3"]),
        (0, 1, None, ["global_batch_size=0"]),
        (4, 2, 0, ["max_micro_batch_size=0"]),
    ],
)
def test_impossible_batch_plans_name_the_numbers(batch, world, max_micro, words):
    with pytest.raises(ConfigError) as info:
        P.batch_plan(batch, world, max_micro)
    for word in words:
        assert word in str(info.value)


def test_full_step_is_split_strided_with_equal_loss_scale():
    plan = P.batch_plan(6, 3)
    shares = [P.step_share(6, end=20, plan=plan, rank=r) for r in range(3)]
    assert [list(s.positions) for s in shares] == [[6, 9], [7, 10], [8, 11]]
    assert {s.loss_scale for s in shares} == {3 / 6}
    assert all(s.step_in_epoch == 1 and not s.padding for s in shares)


def test_short_last_step_pads_ranks_without_samples_with_zero_weight():
    plan = P.batch_plan(8, 4, 1)
    shares = [P.step_share(16, end=18, plan=plan, rank=r) for r in range(4)]
    assert [list(s.positions) for s in shares] == [[16], [17], [16], [16]]
    assert [s.padding for s in shares] == [False, False, True, True]
    assert [s.num_samples for s in shares] == [1, 1, 0, 0]
    assert [s.loss_scale for s in shares] == [2.0, 2.0, 0.0, 0.0]
    assert [s.micro_batches for s in shares] == [1, 1, 1, 1]


def test_loss_scales_make_the_ddp_average_a_mean_over_the_step():
    # DDP divides the summed gradients by W: sum over ranks of scale * samples / W == 1.
    for world in (1, 2, 4):
        plan = P.batch_plan(8, world)
        for cursor, end in ((0, 30), (24, 30), (24, 25)):
            shares = [P.step_share(cursor, end=end, plan=plan, rank=r) for r in range(world)]
            total = sum(s.loss_scale * s.num_samples for s in shares) / world
            assert total == pytest.approx(1.0)


def test_cursor_inside_a_step_is_rejected():
    with pytest.raises(SamplerStateError, match="cursor 5 is not the start of a step"):
        P.step_share(5, end=20, plan=P.batch_plan(4, 1), rank=0)


def test_epoch_end_and_steps_per_epoch():
    assert P.epoch_end(10, 4, drop_last=True) == 8
    assert P.epoch_end(10, 4, drop_last=False) == 10
    assert P.steps_per_epoch(10, 4, drop_last=False) == 3
    assert P.steps_per_epoch(10, 4, drop_last=True) == 2
    assert P.plain_end(10, 3, 4, drop_last=True) == 7
    assert P.plain_end(10, 3, 4, drop_last=False) == 10


def test_share_size_matches_the_strided_range():
    for count in range(12):
        for world in range(1, 5):
            for rank in range(world):
                expected = len(P.strided_share(0, count, rank, world))
                assert P.share_size(count, rank, world) == expected
