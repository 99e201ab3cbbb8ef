"""The event catalogue: stable names and their fixed fields. Treat it as an API.

Ops teams parse these events. A name here never changes meaning; new fields may be added,
none removed. ``docs/events-and-metrics.md`` renders this table;
``tests/unit/contract/test_events.py`` keeps the two in step. Every event also carries
``timestamp``, ``level``, ``event``, ``job_id``, ``node`` and ``pid`` (added by
``elastic_trainer.logging``); worker events add ``rank``, ``local_rank`` and
``restart_count``. The supervisor's events (and the worker output it
relays as ``output.stderr``) add ``supervisor_run``, a token drawn at each supervisor start,
so that the reporting tools keep apart two commands writing into one log; events the
workers log themselves do not carry it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import structlog

from snapshots.events import EVENTS as SNAPSHOT_EVENTS

# name -> the fields that event always carries (beyond the common ones)
CATALOGUE: Mapping[str, tuple[str, ...]] = {
    # supervisor
    "supervisor.started": (
        "min_nodes",
        "max_nodes",
        "nproc_per_node",
        "rdzv_endpoint",
        "entrypoint",
    ),
    "preflight.warning": ("warning",),
    "rendezvous.waiting": ("min_nodes", "max_nodes", "wait_s", "hint"),
    "rendezvous.completed": ("round", "world_size", "num_nodes", "duration_ms", "store_host"),
    "workers.started": ("world_size", "local_world_size", "group_rank", "restart_count"),
    "warm_pool.ready": ("pid", "import_s", "modules"),
    "warm_pool.unavailable": ("reason", "consequence"),
    "worker.failed": ("rank", "exit_code", "signal", "cause", "error_summary"),
    "worker.hung": ("rank", "last_step", "stalled_s"),
    "worker.resources": ("rank", "rss_bytes", "cpu_percent", "num_procs"),
    "membership.changed": ("old_world_size", "new_world_size", "reason"),
    "peer.lost": ("nodes", "how"),
    # a worker that ended because a member left on purpose (preempted): debug, not a failure
    "worker.exited": ("rank", "local_rank", "exit_code", "why", "peers", "error_summary"),
    "peer.silent": ("nodes", "silent_s"),
    "presence.unavailable": ("error", "consequence"),
    # an accept found no file descriptor left (once per streak; the limit is the soft one)
    "resources.fd_exhausted": ("where", "limit", "consequence"),
    "resources.fd_limit_low": ("limit", "needed", "max_nodes", "consequence"),
    # a node whose workers succeeded waits for the others to finish (never for a gone one)
    "exit_barrier.waiting": ("nodes", "timeout_s"),
    "exit_barrier.timed_out": ("nodes", "waited_s", "consequence"),
    "rendezvous.expire_failed": ("nodes", "error", "consequence"),
    "rendezvous.leave_failed": ("error", "consequence"),
    "group.restarting": ("reason", "restart_count", "restarts_left", "backoff_s"),
    # emitted once the new workers report a step: pause_s is what the join cost the group
    "group.handed_over": ("ready", "start_s", "stop_s", "pause_s"),
    "group.handover_abandoned": ("reason", "start_s", "consequence"),
    "preemption.received": ("signal", "grace_s", "signalled_ranks"),
    "recovery.completed": (
        "cause",
        "downtime_s",
        "steps_lost",
        "world_size_before",
        "world_size_after",
        "snapshot_step",
    ),
    # workers that never reported progress (a plain script) restarted: the cost is unknown
    "recovery.unmeasured": (
        "cause",
        "steps_lost",
        "time_lost_s",
        "time_lost_max_s",
        "ran_s",
        "restart_s",
        "world_size_before",
        "world_size_after",
    ),
    "store.unreachable": ("endpoint", "error", "consequence"),
    # the store host's agent is gone: a survivor hosts the rendezvous store from now on
    "store.moved": ("old_host", "new_host", "endpoint", "why", "duration_s"),
    # a starting node joins the store where the snapshot folder says it moved
    "store.found": ("endpoint", "configured_endpoint"),
    # the snapshot folder's store record is not followed (not signed, or no store answers)
    "store.record_ignored": ("reason", "endpoint", "why", "consequence"),
    "store.record_failed": ("error", "consequence"),
    # the standalone rendezvous store (elastic-train store)
    "store.started": ("host", "port", "endpoint"),
    "store.stopped": ("signal",),
    "store.lingering": ("linger_s",),
    "store.exposed": ("host", "port", "hint"),
    # a store value not signed with the job's secret: ignored (rate-limited, count since last)
    "store.tampered": ("key", "reason", "count", "consequence"),
    "output.stderr": ("text",),
    "job.finished": ("status", "exit_code", "restarts", "wall_s", "goodput", "goodput_estimated"),
    # snapshots: the snapshots package's own catalogue (it stands alone), merged here
    **SNAPSHOT_EVENTS,
    # training (worker side)
    "session.started": ("world_size", "backend", "snapshot_dir"),
    "session.stopping": ("step", "reason", "signal"),
    "session.setting_overridden": ("setting", "script_value", "operator_value"),
    "snapshot.memory_failed": ("step", "dir", "error"),
    # --snapshot-every auto chose another interval (worker.interval: Young-Daly)
    "snapshot.interval": ("step", "tier", "every", "cost_s", "step_s", "mtbf_s"),
    # a folder or file of the in-memory tier that is not ours alone: never used
    "snapshot.memory_refused": ("path", "reason"),
    # the driver refused to page-lock a slot for the GPU (worker.memory.pinning): copies slower
    "snapshot.memory_unpinned": ("bytes", "error"),
    # a supervisor freed the in-memory tier folders of supervisors of ours here that died
    "snapshot.memory_freed": ("folders", "bytes"),
    "train.progress": ("step", "epoch", "loss", "lr", "samples_per_s", "eta_s"),
    "train.evaluated": ("step", "epoch", "val_loss", "val_accuracy"),
    "train.model_exported": ("step", "path", "val_accuracy"),
    # a rank whose compute per step is >= 10 % above the others' median for a sustained window
    # (worker.stragglers); emitted by that rank: ``node`` is the slow node's --node name
    "straggler.detected": (
        "rank",
        "step",
        "since_step",
        "slowdown",
        "compute_ms",
        "median_ms",
        "world_size",
        "steps_left",  # the run's steps after ``step``; None: unknown
        "slowest",  # no flagged rank is slower: the one node that may leave now
    ),
    # --evict-stragglers: this node leaves the group (gracefully, as a preempted node does)
    # because its rank straggles and leaving gains more than the re-forms cost
    "straggler.evicted": (
        "rank",
        "slowdown",
        "reason",
        "projected_gain_s",
        "reform_s",
        "rejoin_after_s",
        "evictions",
    ),
    # --evict-stragglers: a straggling node stays, and why (the first rule that holds it)
    "straggler.kept": ("rank", "slowdown", "reason", "projected_gain_s", "reform_s"),
    # a node left out as a straggler has cooled down and joins again
    "straggler.rejoining": ("cooled_s", "evictions", "probe_ratio", "cooldowns"),
    # an evicted node's own probe still finds it slow after a cool-down: another one
    "straggler.still_slow": ("probe_ratio", "cooled_s", "cooldowns"),
    "straggler.recovered": ("rank", "step", "since_step", "slowdown", "waited_s", "steps"),
    # rank 0 as the session closes: the time the group waited for its slowest rank
    "straggler.summary": ("steps", "waited_s", "stragglers", "attempt"),
    # a stdlib record of a foreign logger (torch, a library, the script): its text is in
    # ``message``; written by ``elastic_trainer.logging``, never by ``emit``
    "log.record": ("logger", "level", "message"),
}
FOREIGN_RECORD = "log.record"
_LOGGING_ONLY = frozenset({FOREIGN_RECORD})


# Closed vocabularies of some fields: dashboards may switch on these values, and policy,
# agent and reporting all use these enums (a str Enum compares equal to its value).
class FailureCause(str, enum.Enum):  # worker.failed.cause
    ERROR = "error"
    SIGNAL = "signal"
    OOM = "oom"
    HANG = "hang"
    PREEMPTED = "preempted"
    CONFIG = "config"  # the worker exited 2: bad flags or settings, a restart cannot help


class RestartReason(str, enum.Enum):  # group.restarting.reason
    FAILURE = "failure"
    HANG = "hang"
    MEMBERSHIP = "membership"


class MembershipReason(str, enum.Enum):  # membership.changed.reason
    NODE_LOST = "node_lost"
    NODE_JOINED = "node_joined"
    PEER_PREEMPTED = "peer_preempted"
    STRAGGLER_EVICTED = "straggler_evicted"  # a slow node left (--evict-stragglers)


class JobStatus(str, enum.Enum):  # job.finished.status
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"
    CLOSED = "closed"  # the job had already finished when this node arrived
    STORE_LOST = "store_lost"
    RENDEZVOUS_TIMEOUT = "rendezvous_timeout"
    CONFIG_ERROR = "config_error"  # a worker refused its configuration (exit 2)


FAILURE_CAUSES = tuple(c.value for c in FailureCause)
RESTART_REASONS = tuple(r.value for r in RestartReason)
MEMBERSHIP_REASONS = tuple(r.value for r in MembershipReason)
RECOVERY_CAUSES = (  # recovery.completed.cause
    *FAILURE_CAUSES,
    MembershipReason.NODE_LOST.value,
    MembershipReason.STRAGGLER_EVICTED.value,
)
# recovery.unmeasured.cause: also a restart without a failure of this node (a join, a peer's)
UNMEASURED_CAUSES = (*RECOVERY_CAUSES, RestartReason.MEMBERSHIP.value)
JOB_STATUSES = tuple(s.value for s in JobStatus)


def emit(event: str, *, level: str = "info", logger: Any = None, **fields: Any) -> None:
    """Log one catalogued event with at least its catalogued fields.

    An unknown name or a missing field is a programming error (KeyError), caught in tests;
    enum values are logged as their plain strings.
    """
    if event not in CATALOGUE:
        raise KeyError(f"event {event!r} is not in elastic_trainer.contract.events.CATALOGUE")
    if event in _LOGGING_ONLY:
        raise KeyError(f"event {event!r} is written by elastic_trainer.logging, not emitted")
    missing = [name for name in CATALOGUE[event] if name not in fields]
    if missing:
        raise KeyError(f"event {event!r} is missing its fields {missing}")
    fields = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in fields.items()}
    log = logger if logger is not None else structlog.get_logger("elastic_trainer")
    getattr(log, level)(event, **fields)


def parse_time(value: Any) -> float | None:
    """Unix seconds from an ISO-8601 timestamp (what structlog writes) or a number."""
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
