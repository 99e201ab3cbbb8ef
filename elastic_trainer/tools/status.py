"""``elastic-train status RUN``: what an on-call engineer asks first, from a run's event log.

``elastic-train status --rdzv-endpoint HOST:PORT --job-id ID`` asks the live rendezvous store
instead, read-only and bounded (it never joins, writes nothing): the round, whether it is
complete or closed, the nodes in it with their ranks and heartbeat ages, nodes waiting.

Is it running, on which nodes, at what world size and step; when was the last snapshot; how
often did it restart and why; what failed last, and, apart from failures, what was preempted
last. Supervisor starts that never joined the job (a stray second command writing into the
same log) are left out and named (``tools/report/runs.py``). RUN is the supervisor's
``--log-file`` or a run folder of ``events*.jsonl`` (as for ``elastic-train report``).
``--json`` prints the same as one JSON object. ``status_of`` is pure (events and the time
in, a ``RunStatus`` out).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_trainer.cliparse import OneLineParser
from elastic_trainer.errors import ConfigError
from elastic_trainer.tools.report.cli import one_line_errors, print_text
from elastic_trainer.tools.report.events import load_event_log
from elastic_trainer.tools.report.runs import describe_stray, split_stray
from elastic_trainer.tools.report.summary import (
    Event,
    failures,
    incident_node,
    named,
    node_of,
    preemptions,
    restart_causes,
    world_sizes,
)

PROG = "elastic-train status"
_STEP_EVENTS = ("train.progress", "snapshot.saved", "session.stopping", "worker.hung")


@dataclass(frozen=True, kw_only=True)
class NodeStatus:
    node: str
    state: str  # a job.finished status, or "running"
    last_event: str
    last_event_age_s: float


@dataclass(frozen=True, kw_only=True)
class RunStatus:
    state: str  # the job.finished status of the incident node, else "running"
    nodes: list[NodeStatus]
    world_size: int | None
    step: int | None
    last_snapshot_step: int | None
    last_snapshot_age_s: float | None
    restarts: int
    restarts_by_cause: dict[str, int]
    failures_by_cause: dict[str, int]
    last_failure: str | None
    preemptions: int
    last_preemption: str | None
    last_event_age_s: float | None
    stray_runs: list[dict[str, Any]] = field(default_factory=list)  # left out: never joined

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _age(event: Event | None, now: float) -> float | None:
    return None if event is None else round(max(0.0, now - float(event["time"])), 1)


def _nodes(events: list[Event], now: float) -> list[NodeStatus]:
    out = []
    for node in sorted({node_of(e) for e in events if node_of(e)}):
        mine = [e for e in events if node_of(e) == node]
        finished = named(mine, "job.finished")
        out.append(
            NodeStatus(
                node=node,
                state=str(finished[-1].get("status")) if finished else "running",
                last_event=str(mine[-1]["event"]),
                last_event_age_s=_age(mine[-1], now) or 0.0,
            )
        )
    return out


def _last_with_step(events: list[Event], *names: str) -> Event | None:
    found = [e for e in named(events, *names) if isinstance(e.get("step", e.get("last_step")), int)]
    return found[-1] if found else None


def _failure_line(event: Event | None, now: float) -> str | None:
    if event is None:
        return None
    why = event.get("error_summary") or "no error summary"
    where = f"rank {event.get('rank')} on {node_of(event)}"
    return f"{where}: {event.get('cause')} ({why}), {_age(event, now)}s ago"


def _preemption_line(events: list[Event], now: float) -> str | None:
    received = named(events, "preemption.received")
    if received:
        last = received[-1]
        return f"node {node_of(last)} ({last.get('signal')}), {_age(last, now)}s ago"
    stopped = [e for e in named(events, "worker.failed") if e.get("cause") == "preempted"]
    if not stopped:
        return None
    return f"a peer of {node_of(stopped[-1])}, {_age(stopped[-1], now)}s ago"


def status_of(events: list[Event], *, now: float) -> RunStatus:
    """The run's state from its events (time-ordered, each with ``time`` in unix seconds)."""
    events, stray = split_stray(events)
    node = incident_node(events)
    mine = [e for e in events if node is None or node_of(e) == node]
    finished = named(mine, "job.finished")
    stepped = _last_with_step(events, *_STEP_EVENTS)
    snapshot = _last_with_step(events, "snapshot.saved")
    sizes = world_sizes(mine)
    causes = Counter(restart_causes(events, node))
    failed = failures(events)
    return RunStatus(
        state=str(finished[-1].get("status")) if finished else "running",
        nodes=_nodes(events, now),
        world_size=sizes[-1] if sizes else None,
        step=None if stepped is None else int(stepped.get("step", stepped.get("last_step"))),
        last_snapshot_step=None if snapshot is None else int(snapshot["step"]),
        last_snapshot_age_s=_age(snapshot, now),
        restarts=sum(causes.values()),
        restarts_by_cause=dict(sorted(causes.items())),
        failures_by_cause=dict(sorted(Counter(str(e.get("cause")) for e in failed).items())),
        last_failure=_failure_line(failed[-1] if failed else None, now),
        preemptions=preemptions(events),
        last_preemption=_preemption_line(events, now),
        last_event_age_s=_age(events[-1] if events else None, now),
        stray_runs=[r.to_dict() for r in stray],
    )


def _or(value: Any, missing: str = "n/a") -> str:
    return missing if value is None else str(value)


def format_status(status: RunStatus, *, source: str) -> str:
    s = status
    causes = ", ".join(f"{k} {v}" for k, v in s.restarts_by_cause.items())
    snapshot = (
        "none"
        if s.last_snapshot_step is None
        else f"step {s.last_snapshot_step}, {s.last_snapshot_age_s}s ago"
    )
    lines = [
        f"run:           {source} (last event {_or(s.last_event_age_s)}s ago)",
        f"state:         {s.state}",
        f"world size:    {_or(s.world_size)}",
        f"step:          {_or(s.step)}",
        f"last snapshot: {snapshot}",
        f"restarts:      {s.restarts}" + (f" ({causes})" if causes else ""),
        f"last failure:  {_or(s.last_failure, 'none')}",
        f"preemptions:   {s.preemptions}"
        + (f" (last: {s.last_preemption})" if s.last_preemption else ""),
        f"nodes:         {len(s.nodes)}",
    ]
    lines += [
        f"  {n.node}: {n.state}, last {n.last_event} {n.last_event_age_s}s ago" for n in s.nodes
    ]
    if s.stray_runs:
        lines.append(f"left out:      {describe_stray(s.stray_runs)}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "run", metavar="RUN", nargs="?", help="event log file, or a run folder of events*.jsonl"
    )
    p.add_argument("--rdzv-endpoint", help="ask the live store at HOST:PORT instead of a log")
    p.add_argument("--job-id", default="elastic-train", help="the job's id (with --rdzv-endpoint)")
    p.add_argument(
        "--rdzv-secret-file", help="the job's secret (with --rdzv-endpoint; as the job's)"
    )
    p.add_argument(
        "--snapshot-dir", help="the job's snapshot folder, where its secret is (as the job's)"
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the store")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")
    return p


def run(argv: Sequence[str], *, now: float | None = None) -> int:
    args = build_parser().parse_args(list(argv))
    if (args.run is None) == (args.rdzv_endpoint is None):
        raise ConfigError("give a RUN (event log or run folder) or --rdzv-endpoint HOST:PORT")
    if args.rdzv_endpoint is not None:
        from elastic_trainer.supervisor.rendezvous.secret import job_key
        from elastic_trainer.tools.live_status import print_live_status

        key = job_key(
            secret_file=args.rdzv_secret_file,
            snapshot_dir=args.snapshot_dir,
            job_id=args.job_id,
            create=False,
        )
        return print_live_status(
            args.rdzv_endpoint, args.job_id, args.timeout, key=key, as_json=args.json
        )
    log = load_event_log(args.run)
    status = status_of(log.events, now=time.time() if now is None else now)
    if args.json:
        print(json.dumps({**status.to_dict(), "log": log.path}, indent=2))
    else:
        print_text(format_status(status, source=log.path))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return one_line_errors(run, argv)
