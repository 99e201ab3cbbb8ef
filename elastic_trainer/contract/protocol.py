"""The contract between the supervisor and its worker processes.

Workers learn everything from environment variables (torchrun's, plus the ones below), and
talk back through files in a node-local control directory that the supervisor creates for
each attempt. Files, not sockets: they cost a ``stat`` per step, survive a worker's death,
and need no extra ports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import Any

from elastic_trainer.errors import EnvironmentProblem

# --- defaults: the one place each is written ----------------------------------------------
DEFAULT_SNAPSHOT_EVERY = 100  # steps between periodic snapshots
DEFAULT_SNAPSHOT_KEEP = 3  # newest committed snapshots kept
# steps between periodic in-memory copies of the state (worker.memory.tier); unset: none
# for replicated state (its copy is made just in time, on failure: worker.memory.on_failure),
# this for sharded state (its shards exist nowhere else)
DEFAULT_SHARDED_MEMORY_SNAPSHOT_EVERY = "auto"  # within a budget of the step time
# not torch's 30 min: a hung or cut-off peer must be noticed; the hang watchdog is faster
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
DEFAULT_GRACE_PERIOD_S = 25.0  # SIGTERM -> final snapshot -> exit, under common kill delays
LOG_FORMATS = ("json", "console", "auto")

# --- environment variables set by the supervisor for every worker -------------------------
ENV_JOB_ID = "ELASTIC_TRAIN_JOB_ID"
ENV_NODE = "ELASTIC_TRAIN_NODE"  # the node's name in events (hostname by default)
ENV_SNAPSHOT_DIR = "ELASTIC_TRAIN_SNAPSHOT_DIR"  # fsspec URL; empty = no snapshots
ENV_SNAPSHOT_EVERY = "ELASTIC_TRAIN_SNAPSHOT_EVERY"  # steps between periodic snapshots
ENV_SNAPSHOT_KEEP = "ELASTIC_TRAIN_SNAPSHOT_KEEP"  # newest K committed snapshots kept
ENV_STORAGE_TIMEOUT = "ELASTIC_TRAIN_STORAGE_TIMEOUT"  # seconds, one storage operation
ENV_MEMORY_SNAPSHOT_EVERY = "ELASTIC_TRAIN_MEMORY_SNAPSHOT_EVERY"  # steps; 0 = off
# node-local memory folder (tmpfs) of this agent's in-memory copies; unset = no memory tier
ENV_MEMORY_DIR = "ELASTIC_TRAIN_MEMORY_DIR"
ENV_CONTROL_DIR = "ELASTIC_TRAIN_CONTROL_DIR"  # node-local dir, see the files below
ENV_LOG_FORMAT = "ELASTIC_TRAIN_LOG_FORMAT"  # json | console
ENV_LOG_FILE = "ELASTIC_TRAIN_LOG_FILE"  # optional path workers append JSON lines to
ENV_COLLECTIVE_TIMEOUT = "ELASTIC_TRAIN_COLLECTIVE_TIMEOUT"  # seconds, process-group timeout
ENV_GRACE_PERIOD = "ELASTIC_TRAIN_GRACE_PERIOD"  # seconds from a stop request to the kill
# the job's mean time between failures as the supervisor observed it (--snapshot-every auto)
ENV_MTBF = "ELASTIC_TRAIN_MTBF_S"
# the rendezvous store's lineage (one per store, shared by its nodes): a snapshot folder's
# owner record carries it, so a re-form of the job is told from another job's run
ENV_RDZV_LINEAGE = "ELASTIC_TRAIN_RDZV_LINEAGE"
# the supervisor's pid: a worker whose parent is not that process at start exits (orphan),
# and the node sentinel kills whatever still carries it once the supervisor is gone
ENV_SUPERVISOR_PID = "ELASTIC_TRAIN_SUPERVISOR_PID"


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("expected an integer >= 1")
    return value


def snapshot_interval(raw: str) -> int | str:
    """``--snapshot-every``: steps (>= 1), or ``auto`` (``worker.interval``)."""
    if raw.strip().lower() == "auto":
        return "auto"
    return _positive_int(raw)


def memory_interval(raw: str) -> int | str:
    """``--memory-snapshot-every``: steps (>= 0; 0: no periodic copies), or ``auto``."""
    if raw.strip().lower() == "auto":
        return "auto"
    return _non_negative_int(raw)


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("expected an integer >= 0")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not (math.isfinite(value) and value > 0):
        raise ValueError("expected a number of seconds > 0")
    return value


def _log_format(raw: str) -> str:
    if raw not in LOG_FORMATS:
        raise ValueError(f"expected one of {LOG_FORMATS}")
    return raw


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """What the supervisor tells each worker besides torchrun's variables: the one contract
    across that process boundary, written with ``to_env`` and read back with ``from_env``.

    ``None`` means the operator did not set it: the worker then takes the training script's
    own keyword (``TrainingSession(snapshot_every=...)``), else the default above. When both
    the operator and the script set a value, the operator's wins (it is the later, outer
    decision: a deployment tunes cadence and retention without editing code) and the session
    says so in a ``session.setting_overridden`` event.
    """

    job_id: str | None = None
    node: str | None = None  # None: the hostname
    control_dir: str | None = None
    snapshot_dir: str | None = None  # fsspec URL; None = no snapshots
    snapshot_every: int | str | None = None  # steps, or "auto" (worker.interval)
    snapshot_keep: int | None = None
    storage_timeout_s: float | None = None  # None: the snapshot store's own default
    # the in-memory tier: this agent's folder (the supervisor's, removed when it exits) and
    # the steps between copies (None: the script's keyword, else the default; 0 = off)
    memory_dir: str | None = None
    memory_snapshot_every: int | str | None = None
    log_format: str = "auto"
    log_file: str | None = None
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    mtbf_s: float | None = None  # None: none observed yet

    def to_env(self) -> dict[str, str]:
        """The variables of the settings that are set (None: absent)."""
        return {
            _ENV[f.name]: str(getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) is not None
        }

    def apply_to(self, environ: MutableMapping[str, str]) -> None:
        """Write these settings into ``environ`` (what the workers will inherit), removing
        any variable of an unset one: a stale value must never reach a worker as if the
        operator had set it."""
        for name in _ENV.values():
            environ.pop(name, None)
        environ.update(self.to_env())

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        """Parse and validate; EnvironmentProblem names the variable and the value."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(_ENV[f.name], "")
            if raw == "":
                continue
            try:
                values[f.name] = _PARSE.get(f.name, str)(raw)
            except ValueError as exc:
                raise EnvironmentProblem(
                    f"{_ENV[f.name]}={raw!r} is not valid ({exc}); it is set by elastic-train: "
                    "launch the script with it, or unset the variable"
                ) from None
        return cls(**values)


_ENV: dict[str, str] = {
    "job_id": ENV_JOB_ID,
    "node": ENV_NODE,
    "control_dir": ENV_CONTROL_DIR,
    "snapshot_dir": ENV_SNAPSHOT_DIR,
    "snapshot_every": ENV_SNAPSHOT_EVERY,
    "snapshot_keep": ENV_SNAPSHOT_KEEP,
    "storage_timeout_s": ENV_STORAGE_TIMEOUT,
    "memory_dir": ENV_MEMORY_DIR,
    "memory_snapshot_every": ENV_MEMORY_SNAPSHOT_EVERY,
    "log_format": ENV_LOG_FORMAT,
    "log_file": ENV_LOG_FILE,
    "collective_timeout_s": ENV_COLLECTIVE_TIMEOUT,
    "grace_period_s": ENV_GRACE_PERIOD,
    "mtbf_s": ENV_MTBF,
}
_PARSE: dict[str, Callable[[str], Any]] = {
    "snapshot_every": snapshot_interval,
    "snapshot_keep": _positive_int,
    "storage_timeout_s": _positive_float,
    "memory_snapshot_every": memory_interval,
    "log_format": _log_format,
    "collective_timeout_s": _positive_float,
    "grace_period_s": _positive_float,
    "mtbf_s": _positive_float,
}

# --- files inside the control directory ---------------------------------------------------
# Created by the supervisor when the node must stop (SIGTERM / SIGUSR1 = preemption).
# Workers check for it after every completed step and agree on it with an all-reduce.
STOP_FILE = "stop"
# Created by the supervisor just before it stops the workers itself (a restart or re-formed
# group, not a preemption). A worker that then gets SIGTERM still stops at the step boundary
# with a snapshot, but labels the stop "restarting" rather than "preempted"; a TrainingSession
# whose memory tier copied that step saves nothing to storage (the new group resumes from it).
RESTART_FILE = "restarting"


def copy_now_fifo(local_rank: int) -> str:
    """A FIFO a ``TrainingSession`` worker makes and waits on (a thread blocked in ``open``):
    the supervisor opens it for writing before it stops the workers to re-form the group,
    and every worker with a consistent state copies it into its node's memory once
    (``worker.memory.on_failure``; a rank blocked in a collective with a frozen peer never
    gets back to its loop), then answers in ``copied_file``; the supervisor waits for the
    answers, bounded."""
    return f"copy-now-{local_rank}.fifo"


def copied_file(local_rank: int) -> str:
    """A worker's answer to ``copy_now_fifo``: "copied", or "none" (no consistent state)."""
    return f"copied-{local_rank}"


def copier_file(local_rank: int) -> str:
    """Created by a worker that will answer ``copy_now_fifo``: the supervisor waits only for
    those (a plain script never answers)."""
    return f"copier-{local_rank}"


def progress_file(local_rank: int) -> str:
    """Name of the file where a worker publishes its progress (one JSON object, rewritten).

    Fields: ``step`` (completed optimizer steps), ``epoch``, ``restored_step`` (the snapshot
    step this attempt resumed from, or null), ``time`` (unix seconds).
    """
    return f"progress-{local_rank}.json"


def events_file(local_rank: int) -> str:
    """Name of the file a worker appends some of its events to, one JSON object a line:
    those in ``FORWARDED_EVENTS``, which the supervisor's metrics follow (it reads the file's
    new complete lines every tick; a torn last line is read once it is complete)."""
    return f"events-{local_rank}.jsonl"


# The worker events the supervisor's metrics are made from (supervisor/core/metrics.py).
FORWARDED_EVENTS = ("snapshot.saved", "snapshot.restored", "train.progress")


# --- worker exit codes with a meaning for the supervisor ----------------------------------
# The worker saved the final snapshot because *its own* node is being preempted.
EXIT_PREEMPTED = 0
# The worker stopped because *another* node is being preempted; the final snapshot is
# committed and the group must re-form without that node. Not counted as a failure.
EXIT_PEER_PREEMPTED = 75  # EX_TEMPFAIL
# The worker refused its configuration (bad flags or settings; argparse's code too): a restart
# would fail the same way, so the supervisor ends the job at once with this code.
EXIT_CONFIG = 2

# --- supervisor exit codes (documented in docs/command-line.md) -------------------------
SUPERVISOR_EXIT_OK = 0
SUPERVISOR_EXIT_FAILED = 1
SUPERVISOR_EXIT_CONFIG = 2
# The node was preempted (SIGTERM/SIGUSR1) and its final snapshot was handled: the job is
# resumable. 143 = 128 + SIGTERM, what schedulers expect from a terminated task.
SUPERVISOR_EXIT_PREEMPTED = 143
