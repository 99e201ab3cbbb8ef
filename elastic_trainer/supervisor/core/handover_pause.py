"""How long a join paused the running group, on the workers' own step clock.

``group.handed_over`` says what the hand-over took on the supervisor's clock (``start_s``,
``stop_s``); what the group paid is longer: the old workers' last step to the new workers'
first takes the stop, the release, the new sessions' restore and the first step's extra. So
the event waits until the new workers report a step, and its ``pause_s`` is that time less
the steps made in it, from the progress records the workers write at each step's end
(``worker.progress``): the old workers' last, and the first the supervisor sees of the new
ones (it may see a later step than the first: the steps made since the restore are counted
at the old group's step time). Pure: the agent reads the records and emits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastic_trainer.supervisor.core.ledger import Attempt
from elastic_trainer.supervisor.core.watchdog import Progress


def step_time(attempt: Attempt | None) -> float | None:
    """The mean step of ``attempt`` from its first counted step to its last (None: fewer
    than two counted steps seen)."""
    if attempt is None or attempt.counted_time is None or attempt.last_time is None:
        return None
    steps = (attempt.last_step or 0) - (attempt.counted_step or 0)
    return (attempt.last_time - attempt.counted_time) / steps if steps > 0 else None


def last_step_time(reports: Mapping[int, Progress]) -> float | None:
    """When the old workers' last step ended: the latest of their last records."""
    return max((p.time for p in reports.values()), default=None)


def pause_s(
    *, last_time: float, step_s: float, restored_step: int, seen_step: int, seen_time: float
) -> float:
    """The time from the old group's last step (``last_time``) to the new group's step
    ``seen_step`` (done at ``seen_time``), less the steps made since the restore."""
    return max(0.0, seen_time - last_time - (seen_step - restored_step) * step_s)


@dataclass(frozen=True, kw_only=True)
class HandedOver:
    """A hand-over whose event waits for the new workers' first step."""

    ready: bool
    start_s: float
    stop_s: float
    last_time: float | None  # the old workers' last step (None: they reported none)
    step_s: float | None  # the old group's step time (None: not measured)

    def fields(self, new: Attempt | None, *, ended: bool = False) -> dict[str, Any] | None:
        """``group.handed_over``'s fields once ``new`` (the new workers' attempt) has made a
        step; None until then, unless the attempt ``ended`` without one (``pause_s`` null)."""
        counted = new is not None and new.counted_time is not None
        if not counted and not ended:
            return None
        pause = None
        if counted and self.last_time is not None and self.step_s is not None and new:
            pause = pause_s(last_time=self.last_time, step_s=self.step_s,
                            restored_step=new.start_step, seen_step=new.counted_step or 0,
                            seen_time=new.counted_time or 0.0)  # fmt: skip
            pause = round(pause, 3)
        return {"ready": self.ready, "start_s": self.start_s, "stop_s": self.stop_s,
                "pause_s": pause}  # fmt: skip
