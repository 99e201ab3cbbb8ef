"""Whether a straggling node leaves (supervisor/core/eviction.py), from scripted figures."""

from __future__ import annotations

import pytest

from elastic_trainer.supervisor.core.eviction import (
    MAX_COOLDOWNS,
    EvictionHistory,
    EvictionPolicy,
    SlowNode,
    decide,
    projected_gain_s,
    reform_estimate_s,
    rejoin_now,
    slow_node,
)

POLICY = EvictionPolicy(threshold=1.3, min_nodes=2, cooldown_s=120, backoff_s=600)


def slow(**changes) -> SlowNode:
    figures = dict(slowdown=2.0, median_step_s=0.1, steps_left=5000, num_nodes=4, slowest=True)
    return SlowNode(**{**figures, **changes})


def test_a_slow_node_with_much_work_left_leaves_and_may_rejoin_after_the_cooldown():
    decision = decide(POLICY, EvictionHistory(), slow(), reform_s=10.0, now=0.0)
    assert decision.evict and decision.rejoin_after_s == 120
    # now 0.2 s a step, without it 0.1333 s: 5000 steps save 333 s, two re-forms cost 20 s
    assert decision.projected_gain_s == pytest.approx(5000 * (0.2 - 0.4 / 3) - 20, abs=1e-3)
    assert "1.3" in decision.reason


def test_little_work_left_does_not_pay_for_the_re_forms():
    decision = decide(POLICY, EvictionHistory(), slow(steps_left=100), reform_s=10.0, now=0.0)
    assert not decision.evict and decision.projected_gain_s < 0
    assert "re-forms cost more" in decision.reason


def test_below_the_threshold_no_node_leaves_however_much_work_is_left():
    decision = decide(POLICY, EvictionHistory(), slow(slowdown=1.2), reform_s=0.0, now=0.0)
    assert not decision.evict and "1.2 < 1.3" in decision.reason


def test_never_below_min_nodes():
    decision = decide(POLICY, EvictionHistory(), slow(num_nodes=2), reform_s=0.0, now=0.0)
    assert not decision.evict and "--min-nodes 2" in decision.reason


def test_of_two_slow_nodes_only_the_slowest_leaves():
    decision = decide(POLICY, EvictionHistory(), slow(slowest=False), reform_s=0.0, now=0.0)
    assert not decision.evict and "slower" in decision.reason


def test_a_node_evicted_before_waits_a_doubling_backoff():
    once = EvictionHistory().evicted(now=1000.0)
    assert not decide(POLICY, once, slow(), reform_s=1.0, now=1500.0).evict
    assert decide(POLICY, once, slow(), reform_s=1.0, now=1600.0).evict
    twice = once.evicted(now=2000.0)
    assert not decide(POLICY, twice, slow(), reform_s=1.0, now=3000.0).evict  # 1200 s now
    assert decide(POLICY, twice, slow(), reform_s=1.0, now=3200.0).evict


def test_without_a_step_budget_the_gain_is_judged_over_a_horizon():
    assert projected_gain_s(slow(steps_left=None), 0.0) > 0
    assert projected_gain_s(slow(slowdown=1.3, num_nodes=3), 0.0) < 0  # 3 -> 2 costs 1.5x


@pytest.mark.parametrize("threshold", [1.0, 0.5], ids=["one", "below-one"])
def test_a_threshold_that_would_evict_healthy_nodes_is_refused(threshold):
    with pytest.raises(ValueError, match="--evict-stragglers"):
        EvictionPolicy(threshold=threshold, min_nodes=1, cooldown_s=0)


DETECTED = {"event": "straggler.detected", "rank": 1, "slowdown": 1.8, "median_ms": 120.0,
            "steps_left": 400, "slowest": True}  # fmt: skip


def test_a_detected_event_reads_as_the_slow_node_it_describes():
    node = slow_node(DETECTED, num_nodes=3)
    assert node == SlowNode(
        slowdown=1.8, median_step_s=0.12, steps_left=400, num_nodes=3, slowest=True
    )
    assert slow_node({**DETECTED, "steps_left": None}, num_nodes=3).steps_left is None


@pytest.mark.parametrize(
    "bad",
    [
        {"slowdown": "2"},
        {"slowdown": float("nan")},
        {"median_ms": None},
        {"slowest": "yes"},
        {"steps_left": -1},
        {"steps_left": 2.5},
        {"slowdown": True},
    ],
    ids=["text", "nan", "no-median", "slowest-text", "negative-left", "float-left", "bool"],
)
def test_a_malformed_detected_event_is_no_slow_node(bad):
    assert slow_node({**DETECTED, **bad}, num_nodes=3) is None


def test_a_re_form_costs_the_mean_measured_recovery_else_the_first_start():
    assert reform_estimate_s(recoveries_s=9.0, recoveries=3, cold_start_s=20.0) == 3.0
    assert reform_estimate_s(recoveries_s=0.0, recoveries=0, cold_start_s=20.0) == 20.0
    assert reform_estimate_s(recoveries_s=0.0, recoveries=0, cold_start_s=None) > 0


@pytest.mark.parametrize(
    ("probe_ratio", "cooldowns", "rejoins"),
    [
        (1.0, 1, True),  # as fast as at its start
        (1.29, 1, True),  # below the threshold it was evicted at
        (1.3, 1, False),  # still that slow: another cool-down
        (2.0, MAX_COOLDOWNS - 1, False),
        (2.0, MAX_COOLDOWNS, True),  # the group's verdict judges it again
        (None, 1, True),  # no probe figure: nothing holds it
    ],
)
def test_an_evicted_node_rejoins_once_its_own_probe_finds_it_healthy(
    probe_ratio, cooldowns, rejoins
):
    assert rejoin_now(POLICY, probe_ratio=probe_ratio, cooldowns=cooldowns) is rejoins
