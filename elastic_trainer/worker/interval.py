"""``auto`` intervals. ``--snapshot-every auto``: the storage snapshot interval from what a
snapshot costs and how often the job fails (Young–Daly: T ≈ √(2 · C · M)).
``--memory-snapshot-every auto`` (the default for sharded state, whose shards exist nowhere
else): the periodic in-memory copy as often as a budget of ``MEMORY_BUDGET`` of the step
time allows, from the copy's measured stall.

Pure: every rank feeds it the same group-averaged figures (``TrainingSession.step_done``
all-reduces them with its stop flag), so every rank picks the same steps, as the collective
save needs. C is the measured stall of a storage snapshot (the time the training loop waits
for it; the copy to storage runs beside training), M the job's mean time between failures:
the supervisor's observation (wall time / failures) once there is one, else ``PRIOR_MTBF_S``.
The interval stays within ``MIN_EVERY``..``MAX_EVERY`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from elastic_trainer.contract.protocol import DEFAULT_SNAPSHOT_EVERY

AUTO = "auto"
# A job's mean time between failures before any is observed: a few preemptions a day across
# a small spot fleet. Observed failures replace it.
PRIOR_MTBF_S = 4 * 3600.0
MIN_EVERY = 10  # steps: below this the snapshot's own cost dominates whatever it saves
MAX_EVERY = 10_000  # steps: a bound on what a failure can cost when measurements mislead
FIRST_EVERY = DEFAULT_SNAPSHOT_EVERY  # until a snapshot has been measured: the fixed default
# a new interval is announced (and taken) only when it moves by more than this fraction
CHANGE = 0.2
# the step time is smoothed (one step's time varies by several times: the save's own stall,
# a slow batch): each measurement moves the estimate by this fraction of the difference
STEP_SMOOTHING = 0.1


MEMORY_BUDGET = 0.02  # of the step time, for the sharded tier's periodic copies
MAX_MEMORY_EVERY = 1_000


def budget_steps(*, cost_s: float, step_s: float, budget: float = MEMORY_BUDGET) -> int:
    """The fewest steps between copies that keep their cost within ``budget`` of the steps."""
    if step_s <= 0:
        return 1
    return max(1, min(MAX_MEMORY_EVERY, math.ceil(cost_s / (budget * step_s))))


def young_daly_steps(*, cost_s: float, mtbf_s: float, step_s: float) -> int:
    """The interval in steps: √(2 · cost · MTBF) seconds over the step time, bounded."""
    if step_s <= 0 or cost_s <= 0:
        return MAX_EVERY if step_s > 0 else FIRST_EVERY
    steps = math.sqrt(2 * cost_s * mtbf_s) / step_s
    return max(MIN_EVERY, min(MAX_EVERY, round(steps)))


@dataclass(frozen=True, kw_only=True)
class Interval:
    """When the next storage snapshot is due: a fixed ``every``, or (``auto``) one chosen
    from the measured figures."""

    every: int
    auto: bool = False
    mtbf_s: float = PRIOR_MTBF_S
    cost_s: float | None = None
    step_s: float | None = None
    budget: float | None = None  # set: choose by budget_steps (the memory tier), not Young–Daly

    @classmethod
    def of(cls, setting: int | str, mtbf_s: float | None = None) -> Interval:
        if setting == AUTO:
            return cls(every=FIRST_EVERY, auto=True, mtbf_s=mtbf_s or PRIOR_MTBF_S)
        return cls(every=int(setting))

    @classmethod
    def memory(cls) -> Interval:
        """The sharded tier's ``auto``: a copy every step until one has been measured."""
        return cls(every=1, auto=True, budget=MEMORY_BUDGET)

    def due(self, step: int, last_saved: int) -> bool:
        """A fixed interval: every multiple of it; auto: ``every`` steps after the last."""
        if not self.auto:
            return step % self.every == 0
        return step - last_saved >= self.every

    def observed(self, *, cost_s: float | None, step_s: float | None) -> Interval:
        """With the group's newest figures (None: none measured yet); the same ``every``
        unless the chosen one moves by more than ``CHANGE``."""
        if not self.auto:
            return self
        cost_s = cost_s if cost_s is not None else self.cost_s
        if step_s is not None and self.step_s is not None:
            step_s = self.step_s + STEP_SMOOTHING * (step_s - self.step_s)
        step_s = step_s if step_s is not None else self.step_s
        if cost_s is None or step_s is None:
            return replace(self, cost_s=cost_s, step_s=step_s)
        if self.budget is not None:
            chosen = budget_steps(cost_s=cost_s, step_s=step_s, budget=self.budget)
        else:
            chosen = young_daly_steps(cost_s=cost_s, mtbf_s=self.mtbf_s, step_s=step_s)
        moved = abs(chosen - self.every) > CHANGE * self.every
        return replace(self, cost_s=cost_s, step_s=step_s, every=chosen if moved else self.every)
