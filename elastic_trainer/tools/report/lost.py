"""What restarts cost a run, from its events alone: known, or unknown with a bound. Pure.

A script that reports progress (``TrainingSession``) has each recovery measured:
``recovery.completed`` says the downtime until the first step after a failure and the steps
redone. A plain script reports nothing, so what a restart cost it is unknown, not zero: each
of its restarts is a ``recovery.unmeasured``, bounded by ``time_lost_max_s`` (its attempt's
run time, all of which may be redone, plus the restart). A log written before that event
existed shows a plain script by ``job.finished.goodput_estimated`` and restarts without any
recovery event: unknown, with no bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_trainer.contract.events import RestartReason

Event = dict[str, Any]
_UNMEASURED_FIELDS = ("cause", "ran_s", "restart_s", "time_lost_max_s")


@dataclass(frozen=True, kw_only=True)
class LostWork:
    time_lost_s: float | None  # None: unknown
    time_lost_max_s: float | None  # where unknown: at most this (None: no bound known)
    time_lost_min_s: float  # what is known to be lost: measured downtimes and restart gaps
    steps_redone: int | None  # None: unknown
    unmeasured: list[dict[str, Any]]  # per unmeasured restart: cause, ran_s, restart_s, bound


def _sum(events: list[Event], key: str) -> float:
    return sum(float(e.get(key) or 0) for e in events)


def lost_work(
    recoveries: list[Event], unmeasured: list[Event], *, restarts: int, finished: Event | None
) -> LostWork:
    """Sums of ``recovery.completed`` and ``recovery.unmeasured`` (one node's view)."""
    measured_s = round(_sum(recoveries, "downtime_s"), 3)
    rows = [{k: e.get(k) for k in _UNMEASURED_FIELDS} for e in unmeasured]
    legacy = bool(restarts and not recoveries and finished and finished.get("goodput_estimated"))
    if not rows and not legacy:
        steps = int(_sum(recoveries, "steps_lost"))
        return LostWork(time_lost_s=measured_s, time_lost_max_s=None,
                        time_lost_min_s=measured_s, steps_redone=steps, unmeasured=[])  # fmt: skip
    bound = round(measured_s + _sum(rows, "time_lost_max_s"), 3) if rows else None
    known = round(measured_s + _sum(rows, "restart_s"), 3)
    return LostWork(time_lost_s=None, time_lost_max_s=bound, time_lost_min_s=known,
                    steps_redone=None, unmeasured=rows)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Goodput:
    value: float | None  # None: unknown (see at_most) or nothing to say
    source: str | None  # "job.finished" | "estimated" | None
    estimated: bool  # from worker run times or time lost, not from kept steps
    at_most: float | None = None  # where unknown: its upper bound, if one is known


def goodput(finished: Event | None, wall_s: float | None, lost: LostWork) -> Goodput:
    """``job.finished``'s goodput, unless it is unknown; else estimated as 1 - time lost /
    wall time. Unknown, with an upper bound, where a plain script restarted. No lower bound
    is given: every figure here counts the workers' start-up as work."""
    reported = None if finished is None else finished.get("goodput")
    estimated = bool(finished and finished.get("goodput_estimated"))
    if reported is not None and not (estimated and lost.time_lost_s is None):
        return Goodput(value=float(reported), source="job.finished", estimated=estimated)
    bound = None if finished is None else finished.get("goodput_max")
    if bound is not None or (reported is not None and lost.time_lost_s is None):
        # job.finished's bound; in a log from before it, its goodput: the workers' running
        # share, which counts redone work as kept
        at_most = float(bound if bound is not None else reported)
        return Goodput(value=None, source="job.finished", estimated=True, at_most=at_most)
    if not wall_s or wall_s <= 0:
        return Goodput(value=None, source=None, estimated=lost.time_lost_s is None)
    if lost.time_lost_s is None:  # only the restart gaps are surely lost
        at_most = max(0.0, 1.0 - lost.time_lost_min_s / wall_s)
        return Goodput(value=None, source="estimated", estimated=True, at_most=at_most)
    return Goodput(value=max(0.0, 1.0 - lost.time_lost_s / wall_s), source="estimated",
                   estimated=True)  # fmt: skip


def describe_goodput(g: Goodput) -> str:
    """The ``goodput:`` line's figure (its source is added by the caller)."""
    if g.value is not None:
        return f"{100 * g.value:.1f}%"
    if g.at_most is not None:
        return f"unknown, at most {100 * g.at_most:.1f}%"
    return "unknown" if g.estimated else "n/a"


def describe_time_lost(
    time_lost_s: float | None,
    steps_redone: int | None,
    time_lost_max_s: float | None,
    unmeasured: list[dict[str, Any]],
) -> str:
    """The ``time lost:`` line's text (``LostWork``'s figures, as the summary keeps them)."""
    if time_lost_s is not None:
        return f"{time_lost_s:.1f} s; steps redone {steps_redone}"
    why = "; steps redone unknown (the script reports no progress)"
    if time_lost_max_s is None:
        return "unknown" + why
    reason = _bound_reason(time_lost_max_s, unmeasured)
    return f"unknown (at most {time_lost_max_s:.1f} s: {reason})" + why


def _bound_reason(bound: float, rows: list[dict[str, Any]]) -> str:
    ran, restart = _sum(rows, "ran_s"), _sum(rows, "restart_s")
    restarting = f"restarting took {restart:.1f} s"
    if len(rows) == 1:
        failed = rows[0]["cause"] != RestartReason.MEMBERSHIP.value
        text = f"the attempt ran {ran:.1f} s before {'the failure' if failed else 'its restart'}"
    else:
        text = f"attempts ran {ran:.1f} s before {len(rows)} restarts"
    text += ", " + restarting
    measured = bound - _sum(rows, "time_lost_max_s")  # recovery.completed downtimes
    return text + (f", measured recoveries {measured:.1f} s" if measured >= 0.05 else "")
