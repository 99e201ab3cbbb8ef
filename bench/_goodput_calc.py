"""Pure parts of bench/goodput.py: the failure schedule, and goodput and losses from the logs.

No files, no clocks, no processes: bench/_goodput_run.py runs the jobs and hands their audit
rows (``step rank world_size time``) and ``restored`` marker times here, and
tests/bench/test_goodput.py checks the arithmetic on made-up rows.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

Row = tuple[int, int, int, float]  # an audit line: step, rank, world size, time

FAILURES = ("node_loss", "worker_crash")  # the schedule alternates these, node loss first
# what users' shells may carry that tunes torch's threads: a benchmark of what users pay runs
# without them (the launchers set what they set themselves)
TUNING_VARIABLES = frozenset(
    {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
     "VECLIB_MAXIMUM_THREADS", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES",
     "GOMP_CPU_AFFINITY", "KMP_BLOCKTIME"}
)  # fmt: skip


def plain_env(environ: Mapping[str, str], **extra: str) -> dict[str, str]:
    """``environ`` without thread-tuning variables, plus ``extra``."""
    env = {k: v for k, v in environ.items() if k not in TUNING_VARIABLES}
    env.update(extra)
    return env


def steps_for(duration: float, step_time: float) -> int:
    """The job's fixed number of steps: about ``duration`` seconds of steps of ``step_time``."""
    if duration <= 0 or step_time <= 0:
        raise ValueError(
            f"duration {duration} and step time {step_time} must be > 0: pass positive seconds"
        )
    return max(1, round(duration / step_time))


def failure_kind(index: int) -> str:
    """The ``index``-th failure (0-based): node loss, worker crash, node loss, ..."""
    return FAILURES[index % len(FAILURES)]


def due_at(start: float, every: float, index: int) -> float:
    """When the ``index``-th failure (0-based) is due: every ``every`` seconds from ``start``.

    A failure due while the job is still recovering from the previous one waits until it trains
    at full size again (bench/_goodput_run.py), so a slow recovery does not get a free pass."""
    return start + every * (index + 1)


def failure_free_step_time(rows: list[Row]) -> float:
    """Mean seconds per step of a failure-free run: the first to the last step's completion."""
    first: dict[int, float] = {}
    for step, _, _, t in rows:
        first[step] = min(t, first.get(step, math.inf))
    if len(first) < 2:
        raise ValueError("a failure-free run logged fewer than 2 steps: it did not train")
    lo, hi = min(first), max(first)
    return (first[hi] - first[lo]) / (hi - lo)


def incarnations(rows: list[Row], restored: list[float]) -> list[list[Row]]:
    """The audit rows of each worker group, in order of the groups' starts.

    ``restored``: the workers' ``restored`` marker times (one per rank per start). Every rank of
    a group restores before its first step, and the old group has stopped before the new one
    starts, so no marker falls between two rows of one group: the markers before a row say
    which group wrote it. Groups that wrote no row are left out."""
    bounds = sorted(restored)
    groups: dict[int, list[Row]] = {}
    for row in sorted(rows, key=lambda r: r[3]):
        groups.setdefault(bisect.bisect_left(bounds, row[3]), []).append(row)
    return [groups[k] for k in sorted(groups)]


def restart_losses(groups: list[list[Row]]) -> list[int]:
    """Steps each restart redid: the last step the old group completed minus the step the new
    group resumed from (one before its first step), 0 when it resumed where the old one ended."""
    out = []
    for old, new in itertools.pairwise(groups):
        last_done = max(r[0] for r in old)
        resumed = min(r[0] for r in new) - 1
        out.append(max(0, last_done - resumed))
    return out


@dataclass(frozen=True, kw_only=True)
class Run:
    """One job run, as the runner saw it."""

    steps: int  # the job's fixed number of steps
    wall: float  # launch of the first node -> the last step's completion, seconds
    rows: list[Row] = field(default_factory=list)
    restored: list[float] = field(default_factory=list)  # ``restored`` marker times
    failures: list[tuple[str, float]] = field(default_factory=list)  # (kind, injected at)
    relaunches: list[float] = field(default_factory=list)  # the job died: launched again at


@dataclass(frozen=True, kw_only=True)
class ArmResult:
    arm: str
    steps: int
    failures: int
    wall: float
    wall_failure_free: float
    step_time: float  # failure-free seconds per step
    goodput: float
    goodput_failure_free: float
    restarts: int
    relaunches: int  # the job died and was launched again (both nodes)
    steps_lost: int
    steps_lost_per_failure: float | None
    time_lost_per_failure: float | None

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def goodput(steps: int, step_time: float, wall: float) -> float:
    """(steps that count × failure-free step time) / wall time."""
    if wall <= 0:
        raise ValueError(f"wall time {wall} must be > 0")
    return steps * step_time / wall


def summarize(arm: str, free: Run, failed: Run) -> ArmResult:
    """One arm's row: its failure run against its own failure-free run."""
    step_time = failure_free_step_time(free.rows)
    losses = restart_losses(incarnations(failed.rows, failed.restored))
    n = len(failed.failures)
    return ArmResult(
        arm=arm,
        steps=failed.steps,
        failures=n,
        wall=failed.wall,
        wall_failure_free=free.wall,
        step_time=step_time,
        goodput=goodput(failed.steps, step_time, failed.wall),
        goodput_failure_free=goodput(free.steps, step_time, free.wall),
        restarts=len(losses),
        relaunches=len(failed.relaunches),
        steps_lost=sum(losses),
        steps_lost_per_failure=sum(losses) / n if n else None,
        time_lost_per_failure=(failed.wall - free.wall) / n if n else None,
    )


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: list[ArmResult], unrecovered: list[tuple[str, str]] = ()) -> str:
    """The markdown table bench/goodput.py prints; ``unrecovered``: (arm, why) of arms whose
    launcher never brought the job back (no goodput to give)."""
    lines = [
        "| arm | failures | restarts | relaunches | wall s | failure-free wall s | goodput | "
        "failure-free goodput | × failure-free | steps lost / failure | time lost / failure s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = r.goodput / r.goodput_failure_free
        cells = [r.arm, str(r.failures), str(r.restarts), str(r.relaunches), _fmt(r.wall, 1),
                 _fmt(r.wall_failure_free, 1), _fmt(r.goodput, 3),
                 _fmt(r.goodput_failure_free, 3), _fmt(ratio, 3),
                 _fmt(r.steps_lost_per_failure, 1), _fmt(r.time_lost_per_failure, 1)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for arm, why in unrecovered:
        lines.append(f"| {arm}: did not recover ({why}) |" + " – |" * 10)
    return "\n".join(lines)
