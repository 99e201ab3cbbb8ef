"""bench/straggler.py's arithmetic on made-up events and traces."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from straggler import ArmResult, judge, recovered_share, step_times, table, wall_after


def trace(times: list[float], first: int = 1) -> list[tuple[int, float]]:
    return [(first + i, t) for i, t in enumerate(times)]


def test_step_times_skip_the_steps_before_the_onset_and_gaps():
    steps = [(1, 0.0), (2, 0.1), (3, 0.2), (5, 0.9), (6, 1.4)]
    assert step_times(steps, after_step=2) == pytest.approx([0.1, 0.5])


def test_the_slow_nodes_first_detection_after_the_onset_gives_the_delay():
    events = [
        {"node": "b", "step": 62},
        {"node": "a", "step": 30},  # before the onset, another node: false
        {"node": "b", "step": 70},  # a later episode of the same node: not false
    ]
    result = judge("sleep", events, 50, "b", trace([0.0, 0.1, 0.3]))
    assert (result.detected_node, result.delay_steps, result.false_reports) == ("b", 12, 1)


def test_every_detection_of_a_healthy_run_is_false():
    events = [{"node": "c", "step": 400}, {"node": "a", "step": 900}]
    result = judge("healthy", events, 50, None, [])
    assert result.false_reports == 2 and result.delay_steps is None and result.step_s is None


def test_the_recovered_share_is_the_part_of_the_cost_given_back():
    assert recovered_share(0.10, 0.20, 0.12) == pytest.approx(0.8)
    assert recovered_share(0.10, 0.20, 0.09) == pytest.approx(1.1)  # two nodes beat three
    assert recovered_share(0.10, 0.10, 0.09) is None  # nothing was lost


def test_the_table_names_each_arm_and_the_share():
    def arm(name, step_s, node=None, delay=None):
        return ArmResult(name, node, delay, 0, step_s)

    text = table(
        {
            "healthy": [arm("healthy", 0.10)],
            "sleep": [arm("sleep", 0.20, "b", 9), arm("sleep", 0.22, "b", 11)],
            "two-nodes": [arm("two-nodes", 0.11)],
        }
    )
    assert "9..11" in text and "2/2" in text
    assert "recovered by leaving b out (sleep): 91 %" in text  # (0.21 - 0.11) / (0.21 - 0.10)


def test_the_wall_after_the_onset_runs_from_the_onsets_newest_time_to_the_last_step():
    steps = [(49, 0.0), (50, 1.0), (51, 2.0), (50, 5.0), (51, 6.0), (52, 7.5)]  # 50 again
    assert wall_after(steps, 50) == pytest.approx(2.5)
    assert wall_after(steps, 80) is None and wall_after([], 50) is None


def test_the_table_gives_what_eviction_recovered_of_the_wall_time():
    def arm(name, wall):
        return ArmResult(name, None, None, 0, 0.1, after_onset_s=wall)

    runs = {"healthy": [arm("healthy", 10.0)], "sleep": [arm("sleep", 30.0)]}
    text = table({**runs, "evict": [arm("evict", 14.0)]})
    assert "recovered by --evict-stragglers: 80 %" in text  # (30 - 14) / (30 - 10)
