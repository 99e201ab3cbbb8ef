"""Pure restart decisions: what a group outcome means and what to do next.

No I/O and no clocks: callers pass times in. ``supervisor/agent`` executes the decisions.

Failure classes:
- membership: a node left or joined, or a worker exited ``EXIT_PEER_PREEMPTED`` because a
  peer node is being preempted. Re-form the group; never counts against --max-restarts.
- failure: a worker exited non-zero, died by a signal, or hung. Counts against the budget;
  failing again within ``crash_loop_window_s`` of the group's start is a crash loop and
  backs off exponentially.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from elastic_trainer.contract import protocol
from elastic_trainer.contract.config import RestartTuning
from elastic_trainer.contract.events import FailureCause

_SIGKILL = int(signal.SIGKILL)


# The failure vocabulary of worker.failed.cause: one enum for policy, agent and reporting.
Cause = FailureCause


class Action(str, enum.Enum):
    RESTART = "restart"
    GIVE_UP = "give_up"


@dataclass(frozen=True, kw_only=True)
class WorkerExit:
    """How one worker process ended, as the agent saw it."""

    local_rank: int
    rank: int
    exit_code: int  # negative = killed by signal -exit_code (subprocess convention)

    @property
    def signal(self) -> int | None:
        return -self.exit_code if self.exit_code < 0 else None


def classify_exit(exit_code: int, *, oom_kills: int = 0) -> Cause:
    """One worker's exit code -> failure cause.

    ``oom_kills``: how much the cgroup's OOM-kill counter rose during the attempt; a SIGKILL
    is only called ``oom`` with that evidence (a plain ``kill -9`` looks the same otherwise).
    """
    if exit_code == protocol.EXIT_PEER_PREEMPTED:
        return Cause.PREEMPTED
    if exit_code == protocol.EXIT_CONFIG:
        return Cause.CONFIG
    if exit_code < 0 or exit_code > 128:
        sig = -exit_code if exit_code < 0 else exit_code - 128
        return Cause.OOM if sig == _SIGKILL and oom_kills > 0 else Cause.SIGNAL
    return Cause.ERROR


def signal_name(exit_code: int) -> str | None:
    if exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"SIG{-exit_code}"


def is_membership_change(exits: Mapping[int, WorkerExit]) -> bool:
    """Every failed worker left because a peer node is stopping: not a failure."""
    return bool(exits) and all(e.exit_code == protocol.EXIT_PEER_PREEMPTED for e in exits.values())


@dataclass(frozen=True, kw_only=True)
class PolicyState:
    restarts: int = 0  # restarts that counted against the budget
    membership_restarts: int = 0
    crash_streak: int = 0  # consecutive failures within the crash-loop window


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    reason: str  # failure | hang | membership
    counts: bool  # charged to --max-restarts
    backoff_s: float
    restarts_left: int
    state: PolicyState


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    max_restarts: int
    tuning: RestartTuning = field(default_factory=RestartTuning)

    def on_membership(self, state: PolicyState) -> Decision:
        new = replace(state, membership_restarts=state.membership_restarts + 1, crash_streak=0)
        return Decision(
            action=Action.RESTART,
            reason="membership",
            counts=False,
            backoff_s=0.0,
            restarts_left=self.max_restarts - state.restarts,
            state=new,
        )

    def on_failure(self, state: PolicyState, *, ran_for_s: float, hang: bool = False) -> Decision:
        """A counted failure of a group that ran ``ran_for_s`` seconds."""
        reason = "hang" if hang else "failure"
        if state.restarts >= self.max_restarts:
            return Decision(
                action=Action.GIVE_UP,
                reason=reason,
                counts=True,
                backoff_s=0.0,
                restarts_left=0,
                state=state,
            )
        streak = state.crash_streak + 1 if ran_for_s < self.tuning.crash_loop_window_s else 0
        new = replace(state, restarts=state.restarts + 1, crash_streak=streak)
        return Decision(
            action=Action.RESTART,
            reason=reason,
            counts=True,
            backoff_s=self.backoff(streak),
            restarts_left=self.max_restarts - new.restarts,
            state=new,
        )

    def backoff(self, streak: int) -> float:
        """0 for the first quick failure (a one-off crash restarts at once), then doubling."""
        if streak <= 1:
            return 0.0
        return min(self.tuning.backoff_base_s * 2 ** (streak - 2), self.tuning.backoff_max_s)


def goodput(attempts: list[tuple[float, int, int]], *, wall_s: float) -> float | None:
    """Fraction of wall time spent on steps that were kept.

    ``attempts`` lists, per attempt, (seconds spent making steps, steps made, steps of those
    kept). Step time is spread evenly over an attempt's steps. None when no worker reported
    progress (a plain torchrun script).
    """
    if wall_s <= 0 or not any(made for _, made, _ in attempts):
        return None
    kept_s = sum(busy * kept / made for busy, made, kept in attempts if made > 0)
    return max(0.0, min(1.0, kept_s / wall_s))
