"""Pure parts of bench/ettr.py's validation: the constants one bench/goodput.py run measured,
and the model's prediction of that run's goodput from them.

No files, no clocks: bench/ettr.py reads the run's JSON and kept logs and hands their parsed
contents here. Each failure's phases are bench/recovery.py's (``_recovery_parse.result``, on
the node that keeps running): detect, rendezvous, worker start, restore, first step; a node
loss also has the replacement's join, whose pause is the longest gap in the group's steps
around it less a step.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from _ettr_model import NODE_LOSS, WORKER_CRASH, Failure, KindCost, Replay, replay
from _recovery_parse import OUR_DETECT, Row, first_after, restore_after, result

# the world size each kind of failure leaves the two-node job at (the node loss: one)
WORLD_AFTER = {NODE_LOSS: 1, WORKER_CRASH: 2}
PHASE_NAMES = ("detect", "rendezvous", "worker_start", "restore", "first_step")


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One failure, as the run logged it (seconds)."""

    kind: str
    at_s: float  # from the launch
    phases: dict[str, float]  # PHASE_NAMES; first_step less a step (its extra)
    join_pause_s: float | None  # node loss: the replacement's join, the pause less a step
    steps_lost: int | None


Mark = tuple[str, float, int]  # a worker's timing marker: name, time, world size
_MARK = re.compile(r"^(\S+) (\d+(?:\.\d*)?) \d+ (\d+)$", re.MULTILINE)


def parse_marks(text: str) -> list[Mark]:
    """bench/_session_worker.py's ``name time rank world`` lines (torn lines skipped)."""
    return [(name, float(t), int(world)) for name, t, world in _MARK.findall(text)]


def join_pause(rows: Sequence[Row], after: float, step_s: float) -> float | None:
    """The pause of the group's steps when it grows back to two after ``after``: the first
    step at world size 2 minus the step before it, less a step."""
    grown = [r[3] for r in rows if r[2] == 2 and r[3] > after]
    if not grown:
        return None
    first = min(grown)
    before = [r[3] for r in rows if r[3] < first]
    return None if not before else max(0.0, first - max(before) - step_s)


def measure_failure(
    *,
    kind: str,
    at: float,
    launched: float,
    step_s: float,
    rows: Sequence[Row],
    marks: Sequence[Mark],
    survivor: Sequence[dict[str, Any]],
    events: Sequence[dict[str, Any]],
    until: float = float("inf"),
) -> Measured | None:
    """``survivor``: node a's events (it keeps running); ``events``: both nodes'; ``until``:
    the next failure. Only the markers of the group this recovery forms count: at its world
    size (a node loss's replacement joins at another) and before ``until``."""
    world = WORLD_AFTER[kind]
    stamps_of_group = [(n, t) for n, t, w in marks if w == world and t < until]
    stamps = [(e["event"], e["_t"]) for e in survivor]
    detected = first_after(stamps, lambda e: e in OUR_DETECT, at)
    formed = first_after(stamps, lambda e: e == "rendezvous.completed", detected)
    out = result(fault=at, detected=detected, formed=formed, marks=stamps_of_group,
                 audit=list(rows), restore=restore_after(list(events), at),
                 ws_after=WORLD_AFTER[kind])  # fmt: skip
    if out.total is None or any(out.phases.get(p) is None for p in PHASE_NAMES):
        return None
    phases = {p: float(out.phases[p]) for p in PHASE_NAMES}
    phases["first_step"] = max(0.0, phases["first_step"] - step_s)
    pause = join_pause(rows, at, step_s) if kind == NODE_LOSS else None
    return Measured(kind=kind, at_s=at - launched, phases=phases, join_pause_s=pause,
                    steps_lost=out.steps_lost)  # fmt: skip


def launch_time(rows: Sequence[Row], steps: int, wall: float) -> float:
    """When the run was launched: its last step's completion less its wall time."""
    return min(r[3] for r in rows if r[0] >= steps) - wall


def start_time(rows: Sequence[Row], launched: float, step_s: float) -> float:
    """The launch -> the first step begins (its compute is a step like any other)."""
    return min(r[3] for r in rows) - launched - step_s


def kind_phases(measured: Sequence[Measured], kind: str) -> dict[str, float]:
    """The median of each phase (and of the join pause) over the failures of ``kind``."""
    mine = [m for m in measured if m.kind == kind]
    if not mine:
        return {}
    out = {p: statistics.median(m.phases[p] for m in mine) for p in PHASE_NAMES}
    pauses = [m.join_pause_s for m in mine if m.join_pause_s is not None]
    out["join_pause"] = statistics.median(pauses) if pauses else 0.0
    lost = [m.steps_lost for m in mine if m.steps_lost is not None]
    out["steps_lost"] = statistics.median(lost) if lost else 0.0
    return out


def downtime(phases: dict[str, float]) -> float:
    """The fault -> the new group's first step begins, as the model composes it."""
    return sum(phases[p] for p in PHASE_NAMES) + phases.get("join_pause", 0.0)


def kind_cost(measured: Sequence[Measured], kind: str) -> KindCost:
    phases = kind_phases(measured, kind)
    if not phases:
        raise ValueError(f"no {kind} of the run could be measured: nothing to model it by")
    return KindCost(downtime_s=downtime(phases), redo_steps=phases["steps_lost"])


def predict(
    *,
    steps: int,
    step_s: float,
    start_s: float,
    failures: Sequence[tuple[str, float]],
    measured: Sequence[Measured],
) -> Replay:
    """The run's goodput as the model predicts it: its own failure times (``failures``: kind,
    seconds from the launch), each kind costing the median phases and steps lost measured in
    the run (resuming from the step it interrupted, the just-in-time copy of a replicated
    state, as the bench's job has, less the steps lost)."""
    costs = {k: kind_cost(measured, k) for k in {kind for kind, _ in failures}}
    trace = [Failure(at_s=at, kind=kind) for kind, at in failures]
    return replay(steps=steps, step_s=step_s, start_s=start_s, failures=trace, costs=costs)
