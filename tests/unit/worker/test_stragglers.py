"""The straggler verdict from scripted per-step compute times (worker/stragglers.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from elastic_trainer.worker import stragglers
from elastic_trainer.worker.stragglers import (
    DETECTED,
    RECOVERED,
    StragglerPolicy,
    Watch,
    observe,
)

POLICY = StragglerPolicy()
BASE = 0.100  # seconds of compute per step on a healthy rank
# healthy steps before a scripted slowdown: the warm-up and the noise's first two windows
LEAD = POLICY.warmup_steps + 2 * POLICY.window + 2


def run(steps, policy=POLICY):
    """Feed ``steps`` (a list of per-rank compute vectors, step 1 first); the verdicts."""
    watch, verdicts = Watch(), []
    for step, compute in enumerate(steps, start=1):
        watch, changes = observe(watch, step, compute, policy)
        verdicts.extend(changes)
    return watch, verdicts


def noisy(rng, n, spread=0.3):
    """One step of ``n`` healthy ranks with multiplicative noise up to ``spread``."""
    return [BASE * (1 + rng.uniform(0, spread)) for _ in range(n)]


def test_a_slowdown_is_detected_within_the_window_of_its_onset_and_names_the_rank():
    healthy = [[BASE] * 3] * LEAD
    slow = [[BASE, BASE * 1.5, BASE]] * 30
    _, verdicts = run(healthy + slow)
    (detected,) = verdicts
    assert detected.kind == DETECTED and detected.straggler.rank == 1
    onset = LEAD + 1
    assert detected.straggler.since_step == onset
    assert 0 < detected.step - onset <= 20
    assert detected.straggler.slowdown == pytest.approx(1.5)


def test_the_slowdown_reported_is_the_steps_since_the_onset_not_the_windows_median():
    """A window turns slow with just over half its steps slow; its median then is the rank's
    slowest step before the onset. Recorded beside a busy neighbour: b 1.2x the others now and
    then before it slept 0.3 s a step, a 4.5x straggler, read 1.23 (under an eviction
    threshold of 1.3, so ``--evict-stragglers 1.3`` kept it)."""
    healthy = [[BASE, BASE * (1.2 if step % 3 == 0 else 1.0), BASE] for step in range(LEAD)]
    slow = [[BASE, BASE * 4.5, BASE]] * 20
    _, verdicts = run(healthy + slow)
    (detected,) = verdicts
    assert detected.kind == DETECTED and detected.straggler.rank == 1
    assert detected.straggler.slowdown == pytest.approx(4.5)


def test_a_slowdown_from_the_first_step_is_detected_once_the_window_is_full():
    _, verdicts = run([[BASE, BASE, BASE * 2]] * 40)
    (detected,) = verdicts
    assert detected.straggler.rank == 2
    # the noise is measured over two windows first; the whole window is slow by then (far more
    # than ``sustain_s``), so the window saying slow for ``confirm`` steps is all it takes
    assert detected.step == POLICY.warmup_steps + 2 * POLICY.window + POLICY.confirm


def test_a_short_burst_at_short_steps_is_not_reported():
    # a co-tenant takes one rank's shared core for 0.58 s: 1.6x for 12 steps of 30 ms
    steps = [[0.03] * 3] * LEAD + [[0.03, 0.048, 0.03]] * 12 + [[0.03] * 3] * 30
    assert run(steps)[1] == []
    # the same burst, with no time or step count to last, would be
    _, verdicts = run(steps, StragglerPolicy(sustain_s=0, sustain_steps=POLICY.confirm))
    assert [(v.kind, v.straggler.rank) for v in verdicts] == [(DETECTED, 1), (RECOVERED, 1)]


@pytest.mark.parametrize("burst", [POLICY.sustain_steps - 2, POLICY.sustain_steps + 1])
def test_a_burst_that_ended_before_it_lasted_is_not_reported(burst):
    # the window says slow for half a window after a burst ends: by the time the run has lasted
    # ``sustain_steps`` a burst two steps shorter is over, one a step longer is not
    steps = [[0.03] * 3] * LEAD + [[0.03, 0.036, 0.03]] * burst + [[0.03] * 3] * 30
    _, verdicts = run(steps)
    reported = [(v.kind, v.straggler.rank) for v in verdicts]
    assert reported == ([] if burst < POLICY.sustain_steps else [(DETECTED, 1), (RECOVERED, 1)])


@pytest.mark.parametrize(
    ("healthy_s", "slow_s", "lasted"),
    [
        (0.1, 0.15, 5),  # 0.7 s of slow steps: 5 of 150 ms
        (0.03, 0.036, POLICY.sustain_steps),  # 0.7 s would be 20 steps: 16 bound the delay
    ],
)
def test_a_lasting_slowdown_is_reported_after_sustain_s_or_sustain_steps(healthy_s, slow_s, lasted):
    onset = LEAD + 1
    steps = [[healthy_s] * 3] * LEAD + [[healthy_s, slow_s, healthy_s]] * 40
    (detected,) = run(steps)[1]
    assert detected.straggler.rank == 1
    assert lasted == min(POLICY.sustain_steps, math.ceil(POLICY.sustain_s / slow_s))
    # counted from the onset; the window says slow from the 8th slow step (onset + 7) on, and
    # then for ``confirm`` steps
    said_slow = onset + 7 + POLICY.confirm - 1
    assert detected.step == max(said_slow, onset + lasted - 1) <= onset + 20
    # the onset, though the window may have moved past it by then
    assert detected.straggler.since_step == onset


# a rank stopped and continued on a duty cycle (a hypervisor's steal, a swapping neighbour):
# slow in about two steps of three, never for long in a row (one recorded in the e2e test)
DUTY_CYCLE = "XXXXX.X..XX.XX.XXX.XXX.XXXXX.XX.XXX..XXX.XX.X"


def test_a_duty_cycled_slowdown_of_short_steps_is_named_within_20_steps():
    onset = LEAD + 1
    slowed = [[0.015, 0.06 if at == "X" else 0.015, 0.015] for at in DUTY_CYCLE]
    (detected,) = run([[0.015] * 3] * LEAD + slowed)[1]
    assert detected.straggler.rank == 1
    assert 0 <= detected.step - onset <= 20


def test_recovery_is_reported_once_the_median_ratio_falls_below_recover_below():
    steps = [[BASE] * 3] * LEAD + [[BASE * 1.4, BASE, BASE]] * 20 + [[BASE] * 3] * 20
    watch, verdicts = run(steps)
    assert [v.kind for v in verdicts] == [DETECTED, RECOVERED]
    recovered = verdicts[1]
    healthy_again = LEAD + 21
    assert recovered.straggler.rank == 0
    assert healthy_again <= recovered.step <= healthy_again + POLICY.window
    # the others waited 0.4 * BASE for it at each slow step after the detection
    slow_after = LEAD + 20 - verdicts[0].step
    assert recovered.straggler.waited_s == pytest.approx(slow_after * 0.4 * BASE, rel=0.01)
    assert not watch.flagged


def test_hovering_between_the_two_thresholds_does_not_flap():
    steps = [[BASE] * 3] * LEAD + [[BASE * 1.2, BASE, BASE]] * 15
    steps += [[BASE * 1.07, BASE, BASE]] * 40  # under 1.10, above 1.05: still slow
    _, verdicts = run(steps)
    assert [v.kind for v in verdicts] == [DETECTED]


@pytest.mark.parametrize("spikes", [1, 4, 7])
def test_spikes_shorter_than_half_the_window_are_never_reported(spikes):
    steps = [[BASE] * 3] * LEAD + [[BASE * 4, BASE, BASE]] * spikes + [[BASE] * 3] * 30
    _, verdicts = run(steps)
    assert verdicts == []


def test_a_noisy_healthy_group_is_never_reported():
    rng = random.Random(39)
    steps = [noisy(rng, 4, spread=0.2) for _ in range(5000)]  # each step within ±10 %
    # now and then one rank has a bad scheduling tick (a snapshot, a neighbour's burst)
    for step in rng.sample(range(5000), 300):
        steps[step][rng.randrange(4)] *= 3
    watch, verdicts = run(steps)
    assert verdicts == []
    assert watch.waited_s > 0  # the slowest rank is always someone: the others wait


def test_a_ten_percent_slowdown_in_noise_is_still_found():
    rng = random.Random(7)
    steps = [noisy(rng, 3, spread=0.05) for _ in range(30)]
    steps += [[c * (1.25 if r == 2 else 1) for r, c in enumerate(noisy(rng, 3, 0.05))]
              for _ in range(30)]  # fmt: skip
    _, verdicts = run(steps)
    assert [(v.kind, v.straggler.rank) for v in verdicts] == [(DETECTED, 2)]
    assert verdicts[0].step - 31 <= 20


def test_a_relative_slowdown_of_tiny_steps_below_the_absolute_floor_is_jitter():
    tiny = 0.001  # 1 ms steps: 50 % is 0.5 ms, under min_excess_s
    _, verdicts = run([[tiny, tiny, tiny * 1.5]] * 40)
    assert verdicts == []


def test_two_ranks_compare_with_each_other():
    _, verdicts = run([[BASE, BASE]] * LEAD + [[BASE, BASE * 1.3]] * 20)
    assert [(v.kind, v.straggler.rank) for v in verdicts] == [(DETECTED, 1)]


def test_a_single_rank_has_nothing_to_compare_with():
    _, verdicts = run([[BASE]] * 40)
    assert verdicts == []


def test_both_ranks_of_a_slow_node_are_named():
    steps = [[BASE] * 6] * LEAD + [[BASE, BASE, BASE * 2, BASE * 2, BASE, BASE]] * 20
    _, verdicts = run(steps)
    assert sorted(v.straggler.rank for v in verdicts if v.kind == DETECTED) == [2, 3]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"threshold": 1.1, "recover_below": 1.2},
        {"recover_below": 1.0},
        {"window": 0},
        {"min_excess_s": -1.0},
    ],
    ids=["recover-above-threshold", "recover-at-one", "no-window", "negative-floor"],
)
def test_a_policy_that_cannot_work_is_refused(kwargs):
    with pytest.raises(ValueError, match="StragglerPolicy"):
        StragglerPolicy(**kwargs)


def _onset_step_by_step(steps, ratios, threshold, gap):
    """The onset by its definition: back from the newest step until ``gap`` healthy steps in
    a row; the earliest slow step passed on the way (the newest step if none)."""
    onset, healthy = steps[-1], 0
    for at, ratio in zip(reversed(steps), reversed(ratios), strict=True):
        if ratio >= threshold:
            onset, healthy = at, 0
        else:
            healthy += 1
            if healthy == gap:
                break
    return onset


@pytest.mark.parametrize("gap", [2, 3])
def test_the_onsets_of_all_ranks_at_once_are_each_ranks_onset_by_its_definition(gap):
    rng = random.Random(3)
    for _ in range(200):
        n, ranks = rng.randint(1, 14), rng.randint(1, 6)
        steps = tuple(range(100, 100 + n))
        ratios = torch.tensor(
            [[rng.choice([1.0, 1.0, 1.5]) for _ in range(ranks)] for _ in range(n)],
            dtype=torch.float64,
        )
        got = stragglers._onsets(steps, ratios, 1.1, gap).tolist()
        want = [_onset_step_by_step(steps, ratios[:, r].tolist(), 1.1, gap) for r in range(ranks)]
        assert got == want, (ratios, got, want)


def test_blips_before_a_slowdown_are_not_its_onset():
    # a busy machine: rank 1 slow every other step just before it really slows down
    onset = LEAD + 7
    healthy, slow = [BASE] * 3, [BASE, BASE * 1.5, BASE]
    steps = [healthy] * LEAD + [slow, healthy] * 3 + [slow] * 30
    (detected,) = run(steps)[1]
    assert detected.straggler.rank == 1
    # the steps that made the window's majority, not the blips of the healthy steps before
    assert onset - 2 <= detected.straggler.since_step <= onset
