"""Progress bookkeeping across attempts: recovery figures and goodput. Times come in (unix
seconds); where a caller gives none, the wall clock is read.

Per attempt it keeps when its workers started and stopped, and the first and last progress
report seen. A failure opens a pending recovery (cause, time, last step, world size); the
first report of a later attempt closes it into the fields of ``recovery.completed``.

Goodput is measured from progress reports (steps kept). A plain script writes none: then it
is estimated as the share of wall time its workers were running (each attempt from its
start to its failure, or to the next start or now), which leaves out rendezvous and restart
downtime but counts work a restart redid as kept, since nothing says what was redone; it is
an upper bound, and ``goodput_estimated`` says so.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from elastic_trainer.supervisor.core.policy import goodput
from elastic_trainer.supervisor.core.watchdog import Progress


@dataclass
class Attempt:
    started_at: float | None = None  # unix seconds: workers started
    ended_at: float | None = None  # unix seconds: a worker failed (the attempt's end)
    restored_step: int | None = None
    first_step: int | None = None
    first_time: float | None = None
    last_step: int | None = None
    last_time: float | None = None

    def observe(self, reports: Mapping[int, Progress]) -> None:
        for p in reports.values():
            if p.restored_step is not None:
                self.restored_step = p.restored_step
            if self.first_time is None or p.time < self.first_time:
                self.first_time, self.first_step = p.time, p.step
            if self.last_step is None or p.step >= self.last_step:
                self.last_step, self.last_time = p.step, max(p.time, self.last_time or 0.0)

    @property
    def start_step(self) -> int:
        return self.restored_step or 0

    @property
    def steps_made(self) -> int:
        return max(0, (self.last_step or 0) - self.start_step) if self.last_step is not None else 0

    def busy_s(self) -> float:
        """Seconds spent making steps: span of reports, plus one mean step for the first."""
        if self.first_time is None or self.last_time is None or self.first_step is None:
            return 0.0
        span = self.last_time - self.first_time
        steps_in_span = (self.last_step or 0) - self.first_step
        per_step = span / steps_in_span if steps_in_span > 0 else 0.0
        return span + per_step


@dataclass(frozen=True, kw_only=True)
class PendingRecovery:
    cause: str
    failed_at: float  # unix seconds
    last_step: int | None
    world_size_before: int


@dataclass
class Ledger:
    attempts: list[Attempt] = field(default_factory=list)
    pending: PendingRecovery | None = None
    failures: int = 0  # cascades of failures (a node lost, a rank crashed), not joins

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def start_attempt(self, now: float | None = None) -> None:
        self.attempts.append(Attempt(started_at=time.time() if now is None else now))

    def last_step(self) -> int | None:
        steps = [a.last_step for a in self.attempts if a.last_step is not None]
        return steps[-1] if steps else None

    def failed(self, *, cause: str, now: float, world_size: int) -> None:
        if self.current is not None and self.current.ended_at is None:
            self.current.ended_at = now
        if self.pending is None:  # the first failure of a cascade is the one that counts
            self.failures += 1
            self.pending = PendingRecovery(
                cause=cause, failed_at=now, last_step=self.last_step(), world_size_before=world_size
            )

    def mtbf_s(self, wall_s: float) -> float | None:
        """The job's mean time between failures so far (None before the first)."""
        return wall_s / self.failures if self.failures and wall_s > 0 else None

    def relabel(self, cause: str) -> None:
        """The pending recovery turned out to have another cause (e.g. a node was lost)."""
        if self.pending is not None:
            self.pending = replace(self.pending, cause=cause)

    def observe(self, reports: Mapping[int, Progress], *, world_size: int) -> dict[str, Any] | None:
        """Record reports; return ``recovery.completed`` fields when a recovery just ended."""
        attempt = self.current
        if attempt is None or not reports:
            return None
        attempt.observe(reports)
        pending = self.pending
        if pending is None or attempt.first_time is None:
            return None
        self.pending = None
        snapshot_step = attempt.restored_step
        lost = None
        if pending.last_step is not None:
            lost = max(0, pending.last_step - (snapshot_step or 0))
        return {
            "cause": pending.cause,
            "downtime_s": round(max(0.0, attempt.first_time - pending.failed_at), 3),
            "steps_lost": lost,
            "world_size_before": pending.world_size_before,
            "world_size_after": world_size,
            "snapshot_step": snapshot_step,
        }

    @property
    def goodput_estimated(self) -> bool:
        """True when goodput can only be estimated: workers ran but reported no steps."""
        return bool(self.attempts) and not any(a.steps_made for a in self.attempts)

    def goodput(self, wall_s: float, now: float | None = None) -> float | None:
        """Measured from progress reports, else estimated from worker run times (see module
        docstring); None before any workers started."""
        if self.goodput_estimated:
            return self._running_share(wall_s, time.time() if now is None else now)
        return self._measured_goodput(wall_s)

    def _running_share(self, wall_s: float, now: float) -> float | None:
        if wall_s <= 0:
            return None
        running = 0.0
        for attempt, after in zip(self.attempts, [*self.attempts[1:], None], strict=True):
            end = attempt.ended_at or (after.started_at if after is not None else None) or now
            running += max(0.0, end - (attempt.started_at or end))
        return max(0.0, min(1.0, running / wall_s))

    def _measured_goodput(self, wall_s: float) -> float | None:
        rows = []
        for i, attempt in enumerate(self.attempts):
            later = self.attempts[i + 1 :]
            resumed = next((a for a in later if a.first_time is not None), None)
            made = attempt.steps_made
            if resumed is None:
                kept = made
            else:
                kept = max(0, min(attempt.last_step or 0, resumed.start_step) - attempt.start_step)
            rows.append((attempt.busy_s(), made, min(kept, made)))
        return goodput(rows, wall_s=wall_s)
