"""Which supervisor starts in a log belong to the job. Pure: events in, events and runs out.

Every supervisor event carries ``supervisor_run``, a token drawn at each supervisor start.
A second command started by mistake in the same run folder writes into the same
``events-<node>.jsonl``; its events (a preemption when someone stops it, a rendezvous
timeout) did not happen to the job. The rule: a run *joined* the job when one of its events
is one only a member of a rendezvous round logs (``rendezvous.completed``, or what follows
it: its workers started, failed, restarted), so what happened to it happened to the job.
Runs that never joined are *stray*: they are named, and left out of every figure. Events
without a token (those the workers log themselves, logs older than the token) stay in. When
no run joined (every node timed out waiting, say), none is left out: there is no job to tell
them apart from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

Event = dict[str, Any]
RUN_FIELD = "supervisor_run"
_MEMBER_EVENTS = frozenset(
    {
        "rendezvous.completed",
        "workers.started",
        "worker.failed",
        "group.restarting",
        "membership.changed",
        "recovery.completed",
    }
)


@dataclass(frozen=True, kw_only=True)
class SupervisorRun:
    token: str
    node: str
    started: float  # unix seconds of its first event
    status: str | None  # its job.finished status, None while it runs
    joined: bool  # it completed a rendezvous round (see the module docstring)
    events: int
    ended: float | None = None  # unix seconds of its job.finished, None while it runs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def supervisor_runs(events: list[Event]) -> list[SupervisorRun]:
    """One entry per token, in order of first appearance."""
    by_token: dict[str, list[Event]] = {}
    for event in events:
        token = event.get(RUN_FIELD)
        if isinstance(token, str) and token:
            by_token.setdefault(token, []).append(event)
    return [_run(token, mine) for token, mine in by_token.items()]


def _run(token: str, mine: list[Event]) -> SupervisorRun:
    finished = [e for e in mine if e.get("event") == "job.finished"]
    return SupervisorRun(
        token=token,
        node=str(mine[0].get("node") or ""),
        started=_when(mine[0]) or 0.0,
        status=str(finished[-1].get("status")) if finished else None,
        joined=any(e.get("event") in _MEMBER_EVENTS for e in mine),
        events=len(mine),
        ended=_when(finished[-1]) if finished else None,
    )


def _when(event: Event) -> float | None:
    """Unix seconds of an event: its parsed ``time``, else its ``timestamp``."""
    from elastic_trainer.contract.events import parse_time

    return parse_time(event.get("time", event.get("timestamp")))


def split_stray(events: list[Event]) -> tuple[list[Event], list[SupervisorRun]]:
    """The job's events, and the runs left out as stray (see the module docstring)."""
    runs = supervisor_runs(events)
    if not any(r.joined for r in runs):
        return events, []
    stray = [r for r in runs if not r.joined]
    left_out = {r.token for r in stray}
    return [e for e in events if e.get(RUN_FIELD) not in left_out], stray


def describe_stray(runs: list[dict[str, Any]]) -> str:
    """One line naming the stray runs (``SupervisorRun.to_dict()`` each)."""
    each = ", ".join(
        f"{r['token']} on {r['node'] or '?'} ({r['status'] or 'unfinished'})" for r in runs
    )
    return f"{len(runs)} supervisor start(s) that never joined the job: {each}"


def later_instances(runs: list[SupervisorRun]) -> list[SupervisorRun]:
    """Joined runs that started after the job had succeeded once: the job run again in the
    same folder (``--resume-finished``, or another command line), whose events the report
    takes in too -- and says so, never silently."""
    done = [r.ended for r in runs if r.joined and r.status == "succeeded" and r.ended]
    if not done:
        return []
    first_end = min(done)
    return [r for r in runs if r.joined and r.started > first_end]


def describe_later(runs: list[dict[str, Any]]) -> str:
    """One line naming the runs of a job started again after it had finished."""
    each = ", ".join(f"{r['token']} on {r['node'] or '?'}" for r in runs)
    return (
        f"the job finished, then {len(runs)} supervisor start(s) ran it again in this folder "
        f"({each}): the figures above cover both"
    )
