"""What happened in a run, computed from its events alone. Pure: events in, numbers out.

Several supervisors may append to one log (two "nodes" on one machine sharing a file). Each
of them sees every group restart and recovery, so those incident figures are taken from one
node's view: the node that saw the most restarts (the longest-lived). Worker failures and
preemptions belong to one node each and are summed over all nodes.

A preemption is not a failure: a worker that stopped because its node or a peer was
preempted (``worker.failed`` with cause ``preempted``) is counted under preemptions, never
under failures. Supervisor starts that never joined the job are left out and named
(``tools/report/runs.py``). For a script that reports no progress, time and steps lost are
unknown, not zero, and goodput is only bounded (``tools/report/lost.py``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_trainer.contract.events import FailureCause, RestartReason
from elastic_trainer.tools.report.lost import (
    Goodput,
    describe_goodput,
    describe_time_lost,
    goodput,
    lost_work,
)
from elastic_trainer.tools.report.runs import (
    describe_later,
    describe_stray,
    later_instances,
    split_stray,
    supervisor_runs,
)
from elastic_trainer.tools.report.stragglers import (
    describe_stragglers,
    straggler_episodes,
    straggler_wait_s,
)

Event = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    events: int
    nodes: list[str]
    status: str | None
    wall_s: float | None
    final_step: int | None
    world_sizes: list[int]  # the world size of each successive rendezvous, repeats collapsed
    restarts: int
    restarts_by_cause: dict[str, int]
    failures_by_cause: dict[str, int]
    preemptions: int
    membership_changes: int
    time_lost_s: float | None  # None: unknown (a script that reports no progress restarted)
    steps_redone: int | None  # None: unknown
    goodput: float | None  # None: unknown (see goodput_max) or nothing to say
    goodput_source: str | None  # "job.finished" | "estimated" | None
    goodput_estimated: bool  # an estimate (worker run times or time lost), not kept steps
    snapshots: int
    mean_snapshot_stall_ms: float | None
    final_val_accuracy: float | None
    final_val_loss: float | None
    best_val_accuracy: float | None
    best_step: int | None
    exported_models: list[str] = field(default_factory=list)
    # each move of the rendezvous store (store.moved, once however many nodes said it)
    store_moves: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # every supervisor start
    stray_runs: list[dict[str, Any]] = field(default_factory=list)  # left out: never joined
    time_lost_max_s: float | None = None  # where time lost is unknown: at most this
    goodput_max: float | None = None  # where goodput is unknown: its upper bound, if known
    # each restart whose cost is unknown (recovery.unmeasured): cause, ran_s, restart_s, bound
    unmeasured_restarts: list[dict[str, Any]] = field(default_factory=list)
    # runs that started the job again after it had finished (runs.later_instances)
    later_runs: list[dict[str, Any]] = field(default_factory=list)
    # each straggler.detected (node, rank, slowdown, since_step, recovered), and the seconds
    # the group waited for its slowest rank (None: no TrainingSession measured it)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    straggler_wait_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def named(events: list[Event], *names: str) -> list[Event]:
    return [e for e in events if e.get("event") in names]


def node_of(event: Event) -> str:
    return str(event.get("node") or "")


def incident_node(events: list[Event]) -> str | None:
    """The node whose view counts for group-wide incidents (see module docstring)."""
    incidents = named(events, "group.restarting", "recovery.completed", "recovery.unmeasured")
    per_node = Counter(node_of(e) for e in incidents)
    if not per_node:
        supervisors = named(events, "supervisor.started", "job.finished")
        return node_of(supervisors[0]) if supervisors else None
    best = max(per_node.values())
    return next(n for n in (node_of(e) for e in events) if per_node.get(n) == best)


def restart_causes(events: list[Event], node: str | None = None) -> list[str]:
    """One cause per ``group.restarting`` of ``node``: the worker failure (on any node) that
    triggered it, else the membership change it led to (node_joined, node_lost...)."""
    causes: list[str] = []
    last_failure: str | None = None
    pending_membership: int | None = None
    for event in events:
        name = event.get("event")
        if name != "worker.failed" and node is not None and node_of(event) != node:
            continue
        if name == "worker.failed":
            last_failure = str(event.get("cause") or FailureCause.ERROR.value)
        elif name == "group.restarting":
            reason = str(event.get("reason") or RestartReason.FAILURE.value)
            membership = reason == RestartReason.MEMBERSHIP.value
            causes.append(last_failure if last_failure and not membership else reason)
            pending_membership = len(causes) - 1 if membership else None
            last_failure = None
        elif name == "membership.changed" and pending_membership is not None:
            causes[pending_membership] = str(event.get("reason") or RestartReason.MEMBERSHIP.value)
            pending_membership = None
    return causes


def world_sizes(node_events: list[Event]) -> list[int]:
    sizes: list[int] = []
    for event in named(node_events, "rendezvous.completed", "membership.changed"):
        size = event.get("world_size", event.get("new_world_size"))
        if isinstance(size, int) and (not sizes or sizes[-1] != size):
            sizes.append(size)
    return sizes


def failures(events: list[Event]) -> list[Event]:
    """``worker.failed`` events that are failures: not stops for a preemption."""
    return [
        e for e in named(events, "worker.failed") if e.get("cause") != FailureCause.PREEMPTED.value
    ]


def preemptions(events: list[Event]) -> int:
    """Nodes preempted: ``preemption.received``, else (that node's log missing) the
    preemptions its peers' workers stopped for, one per restart count."""
    received = named(events, "preemption.received")
    if received:
        return len(received)
    stopped = [e for e in named(events, "worker.failed") if e.get("cause") == "preempted"]
    return len({(node_of(e), e.get("restart_count")) for e in stopped})


def _evaluations(events: list[Event]) -> dict[str, Any]:
    evaluated = named(events, "train.evaluated")
    if not evaluated:
        return {
            "final_val_accuracy": None,
            "final_val_loss": None,
            "best_val_accuracy": None,
            "best_step": None,
        }
    best = max(evaluated, key=lambda e: (float(e["val_accuracy"]), -int(e["step"])))
    return {
        "final_val_accuracy": float(evaluated[-1]["val_accuracy"]),
        "final_val_loss": float(evaluated[-1]["val_loss"]),
        "best_val_accuracy": float(best["val_accuracy"]),
        "best_step": int(best["step"]),
    }


def store_moves(events: list[Event]) -> list[dict[str, Any]]:
    """Every survivor reports a move; the new host's own event (``hosted_here``) says it
    best, and one move is one (old host, new host) pair."""
    moves: dict[tuple[str, str], dict[str, Any]] = {}
    for event in named(events, "store.moved"):
        key = (str(event.get("old_host")), str(event.get("new_host")))
        if key not in moves or event.get("hosted_here"):
            moves[key] = {
                f: event.get(f) for f in ("old_host", "new_host", "endpoint", "why", "duration_s")
            }
    return list(moves.values())


def _final_step(events: list[Event]) -> int | None:
    steps = [
        int(e["step"])
        for e in named(events, "train.progress", "train.evaluated", "snapshot.saved")
        if e.get("step") is not None
    ]
    return max(steps) if steps else None


def summarize(events: list[Event]) -> RunSummary:
    """Summarise events (in time order, each with ``t`` seconds since the run began)."""
    runs = supervisor_runs(events)
    events, stray = split_stray(events)
    node = incident_node(events)
    mine = [e for e in events if node is None or node_of(e) == node]
    recoveries = named(mine, "recovery.completed")
    finished = (named(mine, "job.finished") or [None])[-1]
    wall = (
        float(finished["wall_s"])
        if finished and finished.get("wall_s") is not None
        else (events[-1]["t"] if events else None)
    )
    causes = restart_causes(events, node)
    unmeasured = named(mine, "recovery.unmeasured")
    lost = lost_work(recoveries, unmeasured, restarts=len(causes), finished=finished)
    good = goodput(finished, wall, lost)
    stalls = [
        float(e["stall_ms"])
        for e in named(events, "snapshot.saved")
        if e.get("stall_ms") is not None
    ]
    return RunSummary(
        events=len(events),
        nodes=sorted({node_of(e) for e in events if node_of(e)}),
        status=finished.get("status") if finished else None,
        wall_s=wall,
        final_step=_final_step(events),
        world_sizes=world_sizes(mine),
        restarts=len(causes),
        restarts_by_cause=dict(sorted(Counter(causes).items())),
        failures_by_cause=dict(
            sorted(Counter(str(e.get("cause")) for e in failures(events)).items())
        ),
        preemptions=preemptions(events),
        membership_changes=len(named(mine, "membership.changed")),
        time_lost_s=lost.time_lost_s,
        steps_redone=lost.steps_redone,
        time_lost_max_s=lost.time_lost_max_s,
        unmeasured_restarts=lost.unmeasured,
        goodput=good.value,
        goodput_source=good.source,
        goodput_estimated=good.estimated,
        goodput_max=good.at_most,
        snapshots=len(named(events, "snapshot.saved")),
        mean_snapshot_stall_ms=round(sum(stalls) / len(stalls), 2) if stalls else None,
        exported_models=[str(e["path"]) for e in named(events, "train.model_exported")],
        store_moves=store_moves(events),
        runs=[r.to_dict() for r in runs],
        stray_runs=[r.to_dict() for r in stray],
        later_runs=[r.to_dict() for r in later_instances(runs)],
        stragglers=straggler_episodes(events),
        straggler_wait_s=straggler_wait_s(events),
        **_evaluations(events),
    )


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _time_lost(s: RunSummary) -> str:
    return describe_time_lost(
        s.time_lost_s, s.steps_redone, s.time_lost_max_s, s.unmeasured_restarts
    )


def _goodput_of(s: RunSummary) -> Goodput:
    return Goodput(value=s.goodput, source=s.goodput_source, estimated=s.goodput_estimated,
                   at_most=s.goodput_max)  # fmt: skip


def _goodput_note(s: RunSummary) -> str:
    if not s.goodput_source:
        return ""
    if s.goodput_estimated and s.goodput_source != "estimated":
        return f" ({s.goodput_source}, estimated)"
    return f" ({s.goodput_source})"


def format_summary(summary: RunSummary, *, source: str) -> str:
    """The short text summary printed by ``elastic-train report``."""
    s = summary
    wall = "n/a" if s.wall_s is None else f"{s.wall_s:.1f} s"
    sizes = " -> ".join(map(str, s.world_sizes)) or "n/a"
    lines = [
        f"run:         {source} ({s.events} events, {len(s.nodes) or 1} node(s))",
        f"status:      {s.status or 'unfinished'} after {wall}, final step {s.final_step}",
        f"world size:  {sizes}",
        f"restarts:    {s.restarts}" + (f" ({_counts(s.restarts_by_cause)})" if s.restarts else ""),
        f"failures:    {sum(s.failures_by_cause.values())}"
        + (f" ({_counts(s.failures_by_cause)})" if s.failures_by_cause else "")
        + f"; preemptions {s.preemptions}; membership changes {s.membership_changes}",
        "time lost:   " + _time_lost(s),
        "goodput:     " + describe_goodput(_goodput_of(s)) + _goodput_note(s),
        f"snapshots:   {s.snapshots} saved"
        + (
            f", mean stall {s.mean_snapshot_stall_ms:.1f} ms"
            if s.snapshots and s.mean_snapshot_stall_ms is not None
            else ""
        ),
    ]
    if s.store_moves:
        moves = "; ".join(f"{m['old_host']} -> {m['new_host']} ({m['why']})" for m in s.store_moves)
        lines.append(f"store moved: {len(s.store_moves)}x: {moves}")
    if s.stray_runs:
        lines.append(f"left out:    {describe_stray(s.stray_runs)}")
    if s.later_runs:
        lines.append(f"ran again:   {describe_later(s.later_runs)}")
    if s.stragglers or s.straggler_wait_s is not None:
        lines.append("stragglers:  " + describe_stragglers(s.stragglers, s.straggler_wait_s))
    if s.final_val_accuracy is not None:
        lines.append(
            f"validation:  accuracy {_pct(s.final_val_accuracy)}, loss {s.final_val_loss:.4f}"
            f" (best {_pct(s.best_val_accuracy)} at step {s.best_step})"
        )
    return "\n".join(lines)
