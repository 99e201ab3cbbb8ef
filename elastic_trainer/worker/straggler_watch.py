"""The session's straggler watch: this rank's compute time into every step's all-reduce, the
group's verdict (``worker.stragglers``) out as events.

The figures ride in the all-reduce ``step_done`` makes anyway (one slot per rank, each rank
fills its own, the sum gives every rank the whole vector): no collective of its own. Every
rank reaches the same verdict; the slow rank itself says so (``straggler.detected``), so the
event carries its own ``node`` and reaches its own node's supervisor (``FORWARDED_EVENTS``):
that supervisor's metrics name it, and it is the one that can take the node out.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_trainer.contract.events import emit
from elastic_trainer.worker import distributed as D
from elastic_trainer.worker.step_timing import StepTiming, Stopwatch
from elastic_trainer.worker.stragglers import (
    DETECTED,
    StragglerPolicy,
    Verdict,
    Watch,
    observe,
)


class StragglerWatch:
    def __init__(
        self, device: torch.device | None, attempt: int, policy: StragglerPolicy | None = None
    ) -> None:
        self.timing = StepTiming(Stopwatch(device))
        self.policy = policy or StragglerPolicy()
        self.state = Watch()
        self.attempt = attempt
        self.steps = 0  # steps whose figures every rank had

    def watch(self, model: Any) -> bool:
        """Time ``model``'s waits in collectives (DDP or FSDP2); False when none fits."""
        return self.timing.watch(model)

    def figures(self) -> list[int]:
        """This rank's compute of the step (µs) in its own slot of a world-size vector."""
        world = D.world_size()
        if world < 2:
            return []
        slots = [0] * world
        slots[D.rank()] = self.timing.compute_us()
        return slots

    def observe(
        self, step: int, slots: list[int], *, steps_left: int | None = None
    ) -> list[Verdict]:
        """The group's figures of ``step`` (summed slots): the verdict, and this rank's own
        changes emitted. A zero slot: some rank has no figure yet (its first step).
        ``steps_left``: the run's steps after this one, if known (what an eviction would
        be paid back over: ``supervisor/core/eviction.py``)."""
        self.timing.released()
        if not slots or min(slots) <= 0:
            return []
        self.steps += 1
        compute_s = [s / 1e6 for s in slots]
        self.state, verdicts = observe(self.state, step, compute_s, self.policy)
        for verdict in verdicts:
            if verdict.straggler.rank == D.rank():
                self._emit(verdict, compute_s, steps_left)
        return verdicts

    def _slowest(self, rank: int) -> bool:
        """``rank`` is the slowest of the ranks now flagged (a tie: the lower rank), the same
        answer on every node: at most one node leaves at a time."""
        flagged = self.state.flagged
        return rank == min(flagged, key=lambda r: (-flagged[r].slowdown, r), default=rank)

    def _emit(self, verdict: Verdict, compute_s: list[float], steps_left: int | None) -> None:
        s = verdict.straggler
        others = sorted(c for r, c in enumerate(compute_s) if r != s.rank)
        common = {"rank": s.rank, "step": verdict.step, "since_step": s.since_step}
        if verdict.kind == DETECTED:
            emit(
                "straggler.detected",
                level="warning",
                **common,
                slowdown=s.slowdown,
                compute_ms=round(compute_s[s.rank] * 1e3, 2),
                median_ms=round(others[len(others) // 2] * 1e3, 2),
                world_size=len(compute_s),
                steps_left=steps_left,
                slowest=self._slowest(s.rank),
            )
        else:
            emit(
                "straggler.recovered",
                **common,
                slowdown=s.slowdown,
                waited_s=round(s.waited_s, 3),
                steps=verdict.step - s.since_step,
            )

    def summarize(self) -> None:
        """Rank 0, as the session closes: the time the group waited for its slowest rank."""
        if D.rank() != 0 or self.steps == 0:
            return
        emit(
            "straggler.summary",
            steps=self.steps,
            waited_s=round(self.state.waited_s, 3),
            stragglers=sorted(self.state.flagged),
            attempt=self.attempt,
        )
