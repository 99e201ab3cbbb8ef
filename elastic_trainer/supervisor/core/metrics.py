"""The supervisor's metrics as data: which metrics exist, and what each event changes.

Pure, like ``policy.py``: an event (a catalogued dict, ``elastic_trainer.contract.events``) or a
progress observation goes in, a list of ``Change`` values comes out; ``metrics_server.py``
applies them to a ``prometheus_client`` registry and serves it. The same events are the
logs ops already parse, so a metric never says something the log does not.

``METRICS`` is an API like the event catalogue: names and labels never change meaning, the
Metrics table of docs/events-and-metrics.md renders it, and
``tests/unit/supervisor/core/test_metrics.py`` keeps the two in step.
``Health`` is what ``/health`` answers: a phase moved on by the same events.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from elastic_trainer.contract.events import (
    FAILURE_CAUSES,
    MEMBERSHIP_REASONS,
    RESTART_REASONS,
    JobStatus,
    parse_time,
)
from elastic_trainer.supervisor.core.watchdog import Progress


class Kind(str, enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    # closed vocabularies (contract/events.py): every value starts at 0, so `increase()` sees
    # the first
    values: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    buckets: tuple[float, ...] = ()
    # a gauge computed at scrape time: seconds since the unix time held by this metric
    age_of: str | None = None


def _spec(name: str, kind: Kind, text: str, **more: Any) -> tuple[str, MetricSpec]:
    return name, MetricSpec(name=name, kind=kind, help=text, **more)


# name -> spec; every metric of the supervisor's /metrics
METRICS: Mapping[str, MetricSpec] = dict(
    [
        _spec("elastic_train_world_size", Kind.GAUGE, "Workers in the current round (all nodes)."),
        _spec(
            "elastic_train_restarts_total",
            Kind.COUNTER,
            "Group restarts by this node's supervisor, by cause (group.restarting reason).",
            labels=("cause",),
            values={"cause": RESTART_REASONS},
        ),
        _spec(
            "elastic_train_membership_changes_total",
            Kind.COUNTER,
            "World-size changes seen by this node, by reason.",
            labels=("reason",),
            values={"reason": MEMBERSHIP_REASONS},
        ),
        _spec(
            "elastic_train_worker_failures_total",
            Kind.COUNTER,
            "Worker processes of this node that failed, by cause (worker.failed).",
            labels=("cause",),
            values={"cause": FAILURE_CAUSES},
        ),
        _spec(
            "elastic_train_steps_total",
            Kind.COUNTER,
            "Optimizer steps completed by this node's workers (steps redone after a "
            "restart count again: rate() is the throughput).",
        ),
        _spec("elastic_train_step", Kind.GAUGE, "The run's current step (falls back on restore)."),
        _spec(
            "elastic_train_last_progress_timestamp_seconds",
            Kind.GAUGE,
            "Unix time of the last step this node's workers completed.",
        ),
        _spec(
            "elastic_train_last_snapshot_step",
            Kind.GAUGE,
            "Step of the newest committed snapshot this node knows of.",
        ),
        _spec(
            "elastic_train_last_snapshot_timestamp_seconds",
            Kind.GAUGE,
            "Unix time the newest snapshot saved by this node's workers was committed.",
        ),
        _spec(
            "elastic_train_last_snapshot_age_seconds",
            Kind.GAUGE,
            "Seconds since that snapshot was committed (absent before the first one).",
            age_of="elastic_train_last_snapshot_timestamp_seconds",
        ),
        _spec(
            "elastic_train_snapshot_stall_seconds",
            Kind.HISTOGRAM,
            "Training time each snapshot stalled the step loop (snapshot.saved stall_ms).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ),
        _spec(
            "elastic_train_snapshot_write_seconds",
            Kind.HISTOGRAM,
            "Seconds each snapshot took to persist and commit (snapshot.saved write_ms).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        ),
        _spec(
            "elastic_train_recovery_seconds",
            Kind.HISTOGRAM,
            "Downtime from a failure to the first progress after it (recovery.completed).",
            buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
        ),
        _spec(
            "elastic_train_store_moves_total",
            Kind.COUNTER,
            "Times this node saw the rendezvous store move to another host (store.moved).",
        ),
        _spec(
            "elastic_train_store_tampered_total",
            Kind.COUNTER,
            "Rendezvous store values refused: not signed with the job's secret (store.tampered).",
        ),
        _spec(
            "elastic_train_goodput_ratio",
            Kind.GAUGE,
            "Share of wall time spent on steps that were kept (0..1; NaN: unknown).",
        ),
        _spec(
            "elastic_train_worker_rss_bytes",
            Kind.GAUGE,
            "Resident memory of each worker's process tree (worker.resources).",
            labels=("local_rank",),
        ),
        _spec(
            "elastic_train_rank_slowdown",
            Kind.GAUGE,
            "A straggling rank of this node: compute per step over the others' median "
            "(straggler.detected; back below 1.05 at straggler.recovered).",
            labels=("node", "rank"),
        ),
    ]
)


class Op(str, enum.Enum):
    SET = "set"
    INC = "inc"
    OBSERVE = "observe"


@dataclass(frozen=True)
class Change:
    metric: str
    op: Op
    value: float
    labels: tuple[tuple[str, str], ...] = ()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _set(metric: str, value: Any, **labels: Any) -> list[Change]:
    number = _number(value)
    if number is None:
        return []
    return [Change(metric, Op.SET, number, tuple((k, str(v)) for k, v in labels.items()))]


def _inc(metric: str, **labels: Any) -> list[Change]:
    return [Change(metric, Op.INC, 1.0, tuple((k, str(v)) for k, v in labels.items()))]


def _add(metric: str, value: Any) -> list[Change]:
    number = _number(value)
    return [] if number is None or number <= 0 else [Change(metric, Op.INC, number, ())]


def _observe_ms(metric: str, value: Any) -> list[Change]:
    number = _number(value)
    return [] if number is None else [Change(metric, Op.OBSERVE, number / 1000.0)]


def _snapshot_saved(event: Mapping[str, Any]) -> list[Change]:
    return [
        *_set("elastic_train_last_snapshot_step", event.get("step")),
        *_set("elastic_train_last_snapshot_timestamp_seconds", parse_time(event.get("timestamp"))),
        *_observe_ms("elastic_train_snapshot_stall_seconds", event.get("stall_ms")),
        *_observe_ms("elastic_train_snapshot_write_seconds", event.get("write_ms")),
    ]


def _recovery(event: Mapping[str, Any]) -> list[Change]:
    downtime = _number(event.get("downtime_s"))
    if downtime is None:
        return []
    return [Change("elastic_train_recovery_seconds", Op.OBSERVE, downtime)]


def _final_goodput(event: Mapping[str, Any]) -> Any:
    """``job.finished``'s goodput; NaN where it is unknown, only bounded (``goodput_max``): a
    script without progress reports restarted, and what it redid cannot be known."""
    if event.get("goodput") is None and _number(event.get("goodput_max")) is not None:
        return math.nan
    return event.get("goodput")


def _labelled(metric: str, label: str, key: str, vocabulary: tuple[str, ...]) -> Any:
    # a value outside the closed vocabulary is a programming error elsewhere: not a new series
    def changes(event: Mapping[str, Any]) -> list[Change]:
        value = str(event.get(key))
        return _inc(metric, **{label: value}) if value in vocabulary else []

    return changes


_MEMBERSHIP = _labelled(
    "elastic_train_membership_changes_total", "reason", "reason", MEMBERSHIP_REASONS
)


def _slowdown(event: Mapping[str, Any]) -> list[Change]:
    return _set(
        "elastic_train_rank_slowdown",
        event.get("slowdown"),
        node=event.get("node"),
        rank=event.get("rank"),
    )


# event name -> its metric changes
def _restored(event: Mapping[str, Any]) -> list[Change]:
    """Only a storage snapshot is a "last snapshot": a restore from an in-memory copy
    (source memory/mirror) leaves the storage figure as it was."""
    if event.get("source", "storage") != "storage":
        return []
    return _set("elastic_train_last_snapshot_step", event.get("step"))


_BY_EVENT: Mapping[str, Any] = {
    "rendezvous.completed": lambda e: _set("elastic_train_world_size", e.get("world_size")),
    "workers.started": lambda e: _set("elastic_train_world_size", e.get("world_size")),
    "membership.changed": lambda e: [
        *_set("elastic_train_world_size", e.get("new_world_size")),
        *_MEMBERSHIP(e),
    ],
    "group.restarting": _labelled(
        "elastic_train_restarts_total", "cause", "reason", RESTART_REASONS
    ),
    "worker.failed": _labelled(
        "elastic_train_worker_failures_total", "cause", "cause", FAILURE_CAUSES
    ),
    "worker.resources": lambda e: _set(
        "elastic_train_worker_rss_bytes", e.get("rss_bytes"), local_rank=e.get("local_rank")
    ),
    "recovery.completed": _recovery,
    "straggler.detected": _slowdown,
    "straggler.recovered": _slowdown,
    "snapshot.saved": _snapshot_saved,
    "snapshot.restored": _restored,
    "job.finished": lambda e: _set("elastic_train_goodput_ratio", _final_goodput(e)),
    "store.moved": lambda e: _inc("elastic_train_store_moves_total"),
    "store.tampered": lambda e: _add("elastic_train_store_tampered_total", e.get("count")),
}


def changes_for(event: Mapping[str, Any]) -> list[Change]:
    """The metric changes one event makes (none for events no metric follows)."""
    changes = _BY_EVENT.get(str(event.get("event")))
    return changes(event) if changes is not None else []


def goodput_changes(goodput: float | None) -> list[Change]:
    return _set("elastic_train_goodput_ratio", goodput)


@dataclass(frozen=True)
class StepCount:
    """Steps of the current attempt already counted (None: nothing seen yet)."""

    seen: int | None = None


def progress_changes(
    count: StepCount, reports: Mapping[int, Progress]
) -> tuple[StepCount, list[Change]]:
    """New steps in this tick's progress reports. An attempt counts from the snapshot it
    restored (or 0), so steps made before the first tick that saw them still count."""
    if not reports:
        return count, []
    step = max(p.step for p in reports.values())
    restored = [p.restored_step for p in reports.values() if p.restored_step is not None]
    base = count.seen if count.seen is not None else max(restored, default=0)
    out = _set("elastic_train_step", step)
    if step > base:
        out.append(Change("elastic_train_steps_total", Op.INC, float(step - base)))
        newest = max(p.time for p in reports.values())
        out += _set("elastic_train_last_progress_timestamp_seconds", newest)
    return StepCount(seen=max(step, base)), out


# ---- /health ------------------------------------------------------------------------------
class Phase(str, enum.Enum):
    STARTING = "starting"  # rendezvous, workers starting or restoring
    RUNNING = "running"  # steps are being made
    RECOVERING = "recovering"  # a worker failed; the group restarts
    HUNG = "hung"  # the watchdog fired; stays until steps are made again
    STOPPING = "stopping"  # preemption: the node is leaving
    FAILED = "failed"
    FINISHED = "finished"


HEALTHY = frozenset({Phase.STARTING, Phase.RUNNING, Phase.RECOVERING})
_FINAL = frozenset({Phase.STOPPING, Phase.FAILED, Phase.FINISHED})


@dataclass(frozen=True)
class Health:
    phase: Phase = Phase.STARTING
    reason: str = "supervisor started"

    @property
    def ok(self) -> bool:
        return self.phase in HEALTHY

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.ok else "unhealthy",
            "phase": self.phase.value,
            "reason": self.reason,
        }


def _finished(event: Mapping[str, Any]) -> Health:
    status = str(event.get("status"))
    if status in (JobStatus.SUCCEEDED.value, JobStatus.CLOSED.value):
        return Health(Phase.FINISHED, f"job finished: {status}")
    if status == JobStatus.PREEMPTED.value:
        return Health(Phase.STOPPING, "preempted")
    return Health(Phase.FAILED, f"job finished: {status} (exit {event.get('exit_code')})")


def _event_health(health: Health, event: Mapping[str, Any]) -> Health | None:
    name = event.get("event")
    if name == "job.finished":
        return _finished(event)
    if name == "preemption.received":
        return Health(Phase.STOPPING, f"preemption ({event.get('signal')})")
    if name == "worker.hung":
        return Health(
            Phase.HUNG,
            f"no progress for {event.get('stalled_s')}s (rank {event.get('rank')}, "
            f"step {event.get('last_step')})",
        )
    if health.phase == Phase.HUNG:  # only new steps show the hang is over
        return None
    if name == "worker.failed":
        return Health(
            Phase.RECOVERING, f"worker rank {event.get('rank')} failed ({event.get('cause')})"
        )
    if name == "workers.started":
        return Health(Phase.STARTING, f"workers started (restart {event.get('restart_count')})")
    return None


def next_health(health: Health, event: Mapping[str, Any]) -> Health:
    """The health after one event; a stopping, failed or finished node stays so."""
    if health.phase in _FINAL:
        return health
    return _event_health(health, event) or health


def progressed(health: Health, step: int) -> Health:
    """Steps were made: healthy again, unless the node is on its way out."""
    if health.phase in _FINAL:
        return health
    return replace(health, phase=Phase.RUNNING, reason=f"training (step {step})")
