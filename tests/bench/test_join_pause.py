"""bench/join_pause.py's arithmetic: the running group's pause on its own step clock."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _join_pause_calc import join_pause, step_clock


def group(first: int, last: int, world: int, start: float, step: float = 0.1) -> list:
    return [(s, rank, world, start + step * (s - first) + 0.002 * rank)
            for s in range(first, last + 1) for rank in range(world)]  # fmt: skip


# two nodes to step 40 (the last at 13.9 s); the group of three resumes at step 41, 0.3 s later
ROWS = group(1, 40, 2, start=10.0) + group(41, 60, 3, start=14.2)


def test_the_pause_is_the_longest_gap_less_the_median_step() -> None:
    p = join_pause(ROWS, 2, 3)
    assert p is not None
    assert p.gap_s == pytest.approx(0.3)
    assert p.step_s == pytest.approx(0.1)
    assert p.pause_s == pytest.approx(0.2)
    assert (p.last_old_t, p.first_new_t) == (pytest.approx(13.9), pytest.approx(14.2))


def test_a_slow_step_just_before_the_join_is_part_of_its_pause() -> None:
    rows = group(1, 39, 2, start=10.0) + group(40, 40, 2, start=14.3) + group(41, 60, 3, 14.5)
    p = join_pause(rows, 2, 3)
    assert p is not None and p.gap_s == pytest.approx(0.5)  # 13.8 -> 14.3


def test_a_step_is_timed_by_its_first_rank_and_no_join_is_none() -> None:
    assert step_clock(group(1, 2, 2, start=1.0)) == [(1, 2, 1.0), (2, 2, pytest.approx(1.1))]
    assert join_pause(group(1, 40, 2, start=10.0), 2, 3) is None


def test_the_running_nodes_are_named_before_the_joining_one() -> None:
    from join_pause import node_names

    assert node_names(4) == ["n0", "n1", "n2", "n3", "n4"]
