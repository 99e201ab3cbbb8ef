"""The event catalogue: stable names and their fixed fields. Treat it as an API.

Ops teams parse these events. A name here never changes meaning; new fields may be added,
none removed. ``README.md`` renders this table; ``tests/unit/test_events.py`` keeps the two
in step. Every event also carries ``timestamp``, ``level``, ``event``, ``job_id``, ``node``
and ``pid`` (added by ``elastic_trainer.logging``); worker events add ``rank``,
``local_rank`` and ``restart_count``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog

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
    "rendezvous.completed": ("round", "world_size", "num_nodes", "duration_ms"),
    "workers.started": ("world_size", "local_world_size", "group_rank", "restart_count"),
    "worker.failed": ("rank", "exit_code", "signal", "cause", "error_summary"),
    "worker.hung": ("rank", "last_step", "stalled_s"),
    "worker.resources": ("rank", "rss_bytes", "cpu_percent", "num_procs"),
    "membership.changed": ("old_world_size", "new_world_size", "reason"),
    "group.restarting": ("reason", "restart_count", "restarts_left", "backoff_s"),
    "preemption.received": ("signal", "grace_s"),
    "recovery.completed": (
        "cause",
        "downtime_s",
        "steps_lost",
        "world_size_before",
        "world_size_after",
        "snapshot_step",
    ),
    "store.unreachable": ("endpoint", "error", "consequence"),
    # the standalone rendezvous store (elastic-train store)
    "store.started": ("host", "port", "endpoint"),
    "store.stopped": ("signal",),
    "store.lingering": ("linger_s",),
    "store.exposed": ("host", "port", "hint"),
    "job.finished": ("status", "exit_code", "restarts", "wall_s", "goodput"),
    # snapshots (emitted by the snapshots package, usable on its own)
    "snapshot.saved": ("step", "epoch", "url", "bytes", "stall_ms", "write_ms"),
    "snapshot.skipped": ("step", "reason"),
    "snapshot.restored": ("step", "saved_world_size", "world_size"),
    "snapshot.corrupt": ("step", "url", "problem"),
    "snapshot.failed": ("step", "url", "error"),
    "snapshot.pruned": ("steps", "url"),
    "snapshot.storage_retry": ("op", "url", "attempt", "error"),
    # training (worker side)
    "session.started": ("world_size", "backend", "snapshot_dir"),
    "session.stopping": ("step", "reason", "signal"),
    "train.progress": ("step", "epoch", "loss", "lr", "samples_per_s", "eta_s"),
    "train.evaluated": ("step", "epoch", "val_loss", "val_accuracy"),
    "train.model_exported": ("step", "path", "val_accuracy"),
}

# Closed vocabularies of some fields: dashboards may switch on these values.
FAILURE_CAUSES = ("error", "signal", "oom", "hang", "preempted")  # worker.failed.cause
RESTART_REASONS = ("failure", "hang", "membership")  # group.restarting.reason
MEMBERSHIP_REASONS = ("node_lost", "node_joined", "peer_preempted")  # membership.changed.reason
RECOVERY_CAUSES = (*FAILURE_CAUSES, "node_lost")  # recovery.completed.cause
JOB_STATUSES = (  # job.finished.status
    "succeeded",
    "failed",
    "preempted",
    "closed",
    "store_lost",
    "rendezvous_timeout",
)


def emit(event: str, *, level: str = "info", logger: Any = None, **fields: Any) -> None:
    """Log one catalogued event. Unknown names are a programming error, caught in tests."""
    if event not in CATALOGUE:
        raise KeyError(f"event {event!r} is not in elastic_trainer.events.CATALOGUE")
    log = logger if logger is not None else structlog.get_logger("elastic_trainer")
    getattr(log, level)(event, **fields)
