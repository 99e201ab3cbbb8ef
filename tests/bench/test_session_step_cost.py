"""bench/session_step_cost.py's paired interval of the whole-loop ratio, on made-up blocks."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from session_step_cost import paired_interval


def test_a_constant_ratio_is_its_own_mean_and_interval() -> None:
    base = [1.0, 2.0, 0.5, 3.0]
    mean, low, high = paired_interval([1.02 * b for b in base], base)
    assert mean == pytest.approx(1.02) and low == pytest.approx(1.02)
    assert high == pytest.approx(1.02)


def test_the_machine_slowing_both_arms_of_a_pair_cancels() -> None:
    # the machine's speed swings 3x between pairs; within a pair the session costs 1 %
    speeds = [1.0, 3.0, 0.7, 2.2, 1.4, 0.9] * 5
    _, low, high = paired_interval([1.01 * s for s in speeds], speeds)
    assert low == pytest.approx(1.01) and high == pytest.approx(1.01)


def test_the_interval_holds_the_geometric_mean_and_widens_with_noise() -> None:
    ratios = [0.9, 1.1, 1.0, 1.05, 0.95, 1.2, 0.85, 1.0]
    base = [1.0] * len(ratios)
    mean, low, high = paired_interval(ratios, base)
    assert mean == pytest.approx(math.exp(sum(map(math.log, ratios)) / len(ratios)))
    assert low < mean < high
    _, quiet_low, quiet_high = paired_interval([1 + (r - 1) / 10 for r in ratios], base)
    assert quiet_high - quiet_low < (high - low) / 5
