"""Pure parts of bench/join_pause.py: the running group's pause around a join, on its own step
clock, from the workers' audit rows (``step rank world_size time``).

No files, no clocks: tests/bench/test_join_pause.py checks the arithmetic on made-up rows.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Row = tuple[int, int, int, float]
WINDOW = 10  # steps either side of the join searched for its gap


@dataclass(frozen=True, kw_only=True)
class Pause:
    gap_s: float  # the longest gap between two consecutive steps around the join
    step_s: float  # the median step before the join
    pause_s: float  # gap - step: how long the group made no progress
    last_old_t: float  # the step that ends the gap's start (the old group's last, usually)
    first_new_t: float  # the step that ends the gap


def step_clock(rows: Sequence[Row]) -> list[tuple[int, int, float]]:
    """(step, world size, time) per step of the newest group to complete it, in time order:
    a step's first completion across ranks (ranks of one group finish a step together)."""
    first: dict[tuple[int, int], float] = {}
    for step, _, world, t in rows:
        first[(step, world)] = min(t, first.get((step, world), t))
    return sorted(((s, w, t) for (s, w), t in first.items()), key=lambda x: x[2])


def join_pause(rows: Sequence[Row], world_before: int, world_after: int) -> Pause | None:
    """The pause of the group growing from ``world_before`` to ``world_after``: the longest
    gap between consecutive steps within ``WINDOW`` steps of its first step at the new size,
    against the median step at the old size before them. None: it never grew."""
    clock = step_clock(rows)
    grown = next((i for i, (_, w, _) in enumerate(clock) if w == world_after), None)
    if grown is None or grown == 0:
        return None
    before = [t for _, w, t in clock[:grown] if w == world_before]
    gaps_before = [b - a for a, b in itertools.pairwise(before)]
    window = clock[max(0, grown - WINDOW) : grown + WINDOW]
    gaps = [(b[2] - a[2], a[2], b[2]) for a, b in itertools.pairwise(window)]
    if not gaps_before or not gaps:
        return None
    gap, last_old, first_new = max(gaps)
    step = statistics.median(gaps_before[-50:])
    return Pause(gap_s=gap, step_s=step, pause_s=gap - step, last_old_t=last_old,
                 first_new_t=first_new)  # fmt: skip
