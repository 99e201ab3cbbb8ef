"""Progress bookkeeping across attempts: recovery figures and goodput. Times come in (unix
seconds); where a caller gives none, the wall clock is read.

Per attempt it keeps when its workers started and stopped, and the first and last progress
report seen. A failure opens a pending recovery (cause, time, last step, world size); the
first report of a later attempt closes it into the fields of ``recovery.completed``.

Goodput is measured from progress reports (steps kept). A plain script writes none, and
then what a restart cost is unknown, not zero: its workers may redo everything since their
attempt started (the script's own checkpoints are invisible here). So a restart of a script
that has reported nothing closes as *unmeasured* (``recovery.unmeasured``): steps and time
lost unknown, at most the attempt's run time plus the restart. Goodput is then estimated
from the share of wall time workers were running (each attempt from its start to its
failure, or to the next start or now): that share while nothing restarted; after an
unmeasured restart it is unknown (None), and that share is only its upper bound
(``goodput_max``: redone work counted as kept). No lower bound is given: the share of the last
attempt alone would count its workers' start-up as kept work.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from elastic_trainer.contract.events import RestartReason
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
    world_size: int | None = None  # as the supervisor last saw it during this attempt
    # the first report of a step made in this attempt (the session's first record is its
    # start, at the step it restored)
    counted_step: int | None = None
    counted_time: float | None = None

    def observe(self, reports: Mapping[int, Progress]) -> None:
        for p in reports.values():
            if p.restored_step is not None:
                self.restored_step = p.restored_step
            made = p.step > (p.restored_step or 0)
            if made and (self.counted_time is None or p.time < self.counted_time):
                self.counted_step, self.counted_time = p.step, p.time
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


@dataclass(frozen=True, kw_only=True)
class UnmeasuredRestart:
    """A restart of workers that never reported progress: its cost is known only as a bound."""

    cause: str  # the failure's (``PendingRecovery.cause``), else ``membership``: no failure here
    ran_s: float  # the attempt ran this long before it ended: all of it may be redone
    restart_s: float  # from the attempt's end to the next workers' start
    world_size_before: int

    @property
    def time_lost_max_s(self) -> float:
        """At most this was lost, if the new workers start no slower than the old ones did:
        their start (imports, loading the script's checkpoint) is not seen by the supervisor,
        and ``ran_s`` holds the old workers' own start in its stead."""
        return self.ran_s + self.restart_s


@dataclass(frozen=True, kw_only=True)
class LostWork:
    """What restarts cost the job, for ``job.finished``; None where unknown."""

    steps_lost: int | None
    time_lost_s: float | None
    time_lost_max_s: float | None  # where time_lost_s is unknown: its upper bound


@dataclass
class Ledger:
    attempts: list[Attempt] = field(default_factory=list)
    pending: PendingRecovery | None = None
    failures: int = 0  # cascades of failures (a node lost, a rank crashed), not joins
    measured_s: float = 0.0  # recovery.completed downtimes, summed
    measured_steps: int = 0  # recovery.completed steps lost, summed
    recoveries: int = 0  # recovery.completed events, counted
    unmeasured: list[UnmeasuredRestart] = field(default_factory=list)
    # the latest unmeasured restart, until its event is out (it waits for the new world size)
    _unannounced: UnmeasuredRestart | None = field(default=None, repr=False)

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def reported(self) -> bool:
        """Some worker of this node reported progress in some attempt: a TrainingSession (or
        protocol-following) script, whose recoveries are measured."""
        return any(a.first_time is not None for a in self.attempts)

    def start_attempt(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        restart = self._unmeasured_restart(now)
        if restart is not None:
            self.unmeasured.append(restart)
            self._unannounced = restart
        self.attempts.append(Attempt(started_at=now))

    def _unmeasured_restart(self, now: float) -> UnmeasuredRestart | None:
        """A new attempt after one of a script that never reported: the pending recovery (if
        a failure opened one) closes now, since no first step will ever say it ended."""
        previous = self.current
        if previous is None or previous.started_at is None or self.reported:
            return None
        pending, self.pending = self.pending, None
        ended = previous.ended_at if previous.ended_at is not None else now
        return UnmeasuredRestart(
            cause=pending.cause if pending is not None else RestartReason.MEMBERSHIP.value,
            ran_s=max(0.0, ended - previous.started_at),
            restart_s=max(0.0, now - ended),
            world_size_before=(
                pending.world_size_before if pending is not None else previous.world_size or 0
            ),
        )

    def unmeasured_restart(self, *, world_size: int) -> dict[str, Any] | None:
        """``recovery.unmeasured`` fields, once, for the restart that began this attempt."""
        restart, self._unannounced = self._unannounced, None
        if restart is None:
            return None
        return {
            "cause": restart.cause,
            "steps_lost": None,  # unknown, not zero
            "time_lost_s": None,
            "time_lost_max_s": round(restart.time_lost_max_s, 3),
            "ran_s": round(restart.ran_s, 3),
            "restart_s": round(restart.restart_s, 3),
            "world_size_before": restart.world_size_before,
            "world_size_after": world_size,
        }

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

    def first_start_s(self) -> float | None:
        """The first attempt's start: its workers started to their first step made."""
        first = self.attempts[0] if self.attempts else None
        if first is None or first.started_at is None or first.counted_time is None:
            return None
        return max(0.0, first.counted_time - first.started_at)

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
        if attempt is None:
            return None
        attempt.world_size = world_size
        if not reports:
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
        downtime = round(max(0.0, attempt.first_time - pending.failed_at), 3)
        self.measured_s += downtime
        self.recoveries += 1
        self.measured_steps += lost or 0
        return {
            "cause": pending.cause,
            "downtime_s": downtime,
            "steps_lost": lost,
            "world_size_before": pending.world_size_before,
            "world_size_after": world_size,
            "snapshot_step": snapshot_step,
        }

    @property
    def goodput_estimated(self) -> bool:
        """True when goodput can only be estimated: workers ran but reported no steps."""
        return bool(self.attempts) and not any(a.steps_made for a in self.attempts)

    def lost_work(self) -> LostWork:
        """Steps and seconds lost to restarts: unknown once a restart was unmeasured, with the
        sum of the known downtimes and the unmeasured restarts' bounds as the upper bound."""
        if not self.unmeasured:
            return LostWork(
                steps_lost=self.measured_steps,
                time_lost_s=round(self.measured_s, 3),
                time_lost_max_s=None,
            )
        bound = self.measured_s + sum(r.time_lost_max_s for r in self.unmeasured)
        return LostWork(steps_lost=None, time_lost_s=None, time_lost_max_s=round(bound, 3))

    def finished_fields(self, wall_s: float, now: float | None = None) -> dict[str, Any]:
        """``job.finished``'s figures of lost work: known, or unknown (None) with bounds."""
        lost = self.lost_work()
        high = self.goodput_max(wall_s, now)
        return {
            "steps_lost": lost.steps_lost,
            "time_lost_s": lost.time_lost_s,
            "time_lost_max_s": lost.time_lost_max_s,
            "goodput_max": None if high is None else round(high, 4),
        }

    @property
    def goodput_unknown(self) -> bool:
        """Estimated, and a restart's cost is unknown: only ``goodput_max`` can be said."""
        return self.goodput_estimated and bool(self.unmeasured)

    def goodput(self, wall_s: float, now: float | None = None) -> float | None:
        """Measured from progress reports, else estimated from worker run times (see module
        docstring); None before any workers started, and where it is unknown."""
        if self.goodput_unknown:
            return None
        if self.goodput_estimated:
            return self._running_share(wall_s, time.time() if now is None else now)
        return self._measured_goodput(wall_s)

    def goodput_max(self, wall_s: float, now: float | None = None) -> float | None:
        """Where ``goodput`` is unknown, its upper bound: the share of wall time the workers
        ran (see module docstring); None elsewhere."""
        if not self.goodput_unknown:
            return None
        return self._running_share(wall_s, time.time() if now is None else now)

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
