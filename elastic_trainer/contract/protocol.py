"""The contract between the supervisor and its worker processes.

Workers learn everything from environment variables (torchrun's, plus the ones below), and
talk back through files in a node-local control directory that the supervisor creates for
each attempt. Files, not sockets: they cost a ``stat`` per step, survive a worker's death,
and need no extra ports.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import Any

from elastic_trainer.contract.settings import (
    TOGGLE,
    Setting,
    non_negative_int,
    one_of,
    option,
    positive_int,
    seconds,
    setting_of,
    switch,
    text,
)
from elastic_trainer.errors import ConfigError, EnvironmentProblem

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


# --- parsers: text (a flag's value, an environment variable) -> a value ---------------------
# Each raises ValueError naming what it expects; the same one checks the flag, the
# supervisor's configuration and the worker's environment (contract.settings).
def snapshot_interval(raw: str) -> int | str:
    """``--snapshot-every``: steps (>= 1), or ``auto`` (``worker.interval``)."""
    if raw.strip().lower() == "auto":
        return "auto"
    return positive_int(raw)


def memory_interval(raw: str) -> int | str:
    """``--memory-snapshot-every``: steps (>= 0; 0: no periodic copies), or ``auto``."""
    if raw.strip().lower() == "auto":
        return "auto"
    return non_negative_int(raw)


_log_format = one_of(*LOG_FORMATS)


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """What the supervisor tells each worker besides torchrun's variables: the one contract
    across that process boundary, written with ``to_env`` and read back with ``from_env``.
    Each setting is declared once, here (a ``contract.settings.Setting``): its type and
    default, its environment variable, its parser (the one validation), and the flag an
    operator sets it with (``supervisor/cli/args.py`` builds those flags from these
    declarations, and ``RunConfig`` embeds the operator's values as ``RunConfig.worker``).

    ``None`` means the operator did not set it: the worker then takes the training script's
    own keyword (``TrainingSession(snapshot_every=...)``), else the setting's ``fallback``.
    When both the operator and the script set a value, the operator's wins (it is the later, outer
    decision: a deployment tunes cadence and retention without editing code) and the session
    says so in a ``session.setting_overridden`` event.
    """

    job_id: str | None = option(None, env_name="ELASTIC_TRAIN_JOB_ID", parse=text)
    # the node's name in events; None: the hostname
    node: str | None = option(None, env_name="ELASTIC_TRAIN_NODE", parse=text)
    # node-local folder of this attempt's control files (below)
    control_dir: str | None = option(None, env_name="ELASTIC_TRAIN_CONTROL_DIR", parse=text)
    snapshot_dir: str | None = option(
        None,
        "--snapshot-dir",
        env_name="ELASTIC_TRAIN_SNAPSHOT_DIR",
        parse=text,
        metavar="URL",
        help="local path or fsspec URL for snapshots",
        shown="none",
        fix="use a local path or an fsspec URL such as s3://bucket/run",
    )
    snapshot_every: int | str | None = option(
        None,
        "--snapshot-every",
        env_name="ELASTIC_TRAIN_SNAPSHOT_EVERY",
        parse=snapshot_interval,
        fallback=DEFAULT_SNAPSHOT_EVERY,
        metavar="N",
        help="steps between snapshots, or auto: from their measured cost and the failure rate",
        fix="use an integer number of steps >= 1, or auto",
    )
    # the in-memory tier: steps between periodic copies (None: the script's keyword, else
    # none for replicated state, copied just in time; auto for sharded state; 0 = off)
    memory_snapshot_every: int | str | None = option(
        None,
        "--memory-snapshot-every",
        env_name="ELASTIC_TRAIN_MEMORY_SNAPSHOT_EVERY",
        parse=memory_interval,
        metavar="N",
        help="steps between periodic in-memory copies",
        shown="none for replicated state, copied just in time on failure; "
        f"{DEFAULT_SHARDED_MEMORY_SNAPSHOT_EVERY} for sharded state",
        fix="use an integer number of steps >= 1, or 0 for no in-memory copies, or auto",
    )
    snapshot_keep: int | None = option(
        None,
        "--snapshot-keep",
        env_name="ELASTIC_TRAIN_SNAPSHOT_KEEP",
        parse=positive_int,
        fallback=DEFAULT_SNAPSHOT_KEEP,
        metavar="K",
        help="newest snapshots kept",
        fix="use an integer >= 1",
    )
    # what the job creates in a local snapshot (run) folder, its event log included:
    # 0700/0600 (off), or 0750/0640 (on: the owner's group may read, never write)
    snapshot_group_access: bool = option(
        False,
        "--snapshot-group-access",
        env_name="ELASTIC_TRAIN_SNAPSHOT_GROUP_ACCESS",
        parse=switch,
        kind=TOGGLE,
        help="let the owner's group read what the job creates in a local snapshot folder "
        "and its event log (0750/0640 instead of 0700/0600)",
        fix="use true or false",
    )
    # None: the snapshot store's own default
    storage_timeout_s: float | None = option(
        None,
        "--storage-timeout",
        env_name="ELASTIC_TRAIN_STORAGE_TIMEOUT",
        parse=seconds(zero=False),
        metavar="S",
        help="seconds one snapshot storage operation may take, retries included",
        shown="the store's",
        fix="use a number of seconds > 0",
    )
    # this agent's in-memory tier folder (the supervisor's, removed when it exits)
    memory_dir: str | None = option(None, env_name="ELASTIC_TRAIN_MEMORY_DIR", parse=text)
    log_format: str = option(
        "auto",
        "--log-format",
        env_name="ELASTIC_TRAIN_LOG_FORMAT",
        parse=_log_format,
        metavar="json|console|auto",
        help="auto = console on a TTY, else JSON lines",
        fix="use json, console or auto",
    )
    log_file: str | None = option(
        None,
        "--log-file",
        env_name="ELASTIC_TRAIN_LOG_FILE",
        parse=text,
        metavar="PATH",
        help="also append JSON lines to this file",
        shown="none",
        fix="use a file path",
    )
    collective_timeout_s: float = option(
        DEFAULT_COLLECTIVE_TIMEOUT_S,
        "--collective-timeout",
        env_name="ELASTIC_TRAIN_COLLECTIVE_TIMEOUT",
        parse=seconds(zero=False),
        metavar="S",
        help="process-group timeout passed to workers, seconds",
        fix="use a number of seconds > 0",
    )
    grace_period_s: float = option(
        DEFAULT_GRACE_PERIOD_S,
        "--grace-period",
        env_name="ELASTIC_TRAIN_GRACE_PERIOD",
        parse=seconds(zero=True),
        metavar="S",
        help="seconds from SIGTERM/SIGUSR1 to killing the workers",
        fix="use a number of seconds >= 0",
    )
    # the job's mean time between failures as the supervisor observed it (--snapshot-every
    # auto); None: none observed yet
    mtbf_s: float | None = option(None, env_name="ELASTIC_TRAIN_MTBF_S", parse=seconds(zero=False))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            problem = None if value is None else f.metadata["setting"].check(value)
            if problem is not None:
                how = f.metadata["setting"]
                name = how.flag or how.env
                raise ConfigError(f"{name}={value!r} is invalid ({problem}): {how.fix}")

    def snapshot_storage_options(self) -> dict[str, Any] | None:
        """The snapshot store's ``storage_options`` these settings ask for (None: its own
        defaults). ``group_access`` is a local folder's: the store drops it elsewhere."""
        return {"group_access": True} if self.snapshot_group_access else None

    @classmethod
    def operator_settings(cls) -> list[str]:
        """The settings an operator sets with a flag (the rest the supervisor sets)."""
        return [f.name for f in fields(cls) if f.metadata["setting"].flag is not None]

    def to_env(self) -> dict[str, str]:
        """The variables of the settings that are set (None: absent)."""
        return {
            f.metadata["setting"].env: str(getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) is not None
        }

    def apply_to(self, environ: MutableMapping[str, str]) -> None:
        """Write these settings into ``environ`` (what the workers will inherit), removing
        any variable of an unset one: a stale value must never reach a worker as if the
        operator had set it."""
        for f in fields(self):
            environ.pop(f.metadata["setting"].env, None)
        environ.update(self.to_env())

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        """Parse and validate; EnvironmentProblem names the variable and the value."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            how: Setting = f.metadata["setting"]
            raw = env.get(how.env, "")
            if raw == "":
                continue
            try:
                values[f.name] = how.parse(raw)
            except ValueError as exc:
                raise EnvironmentProblem(
                    f"{how.env}={raw!r} is not valid ({exc}); it is set by elastic-train: "
                    "launch the script with it, or unset the variable"
                ) from None
        return cls(**values)


# --- environment variables set by the supervisor for every worker -------------------------
# The settings' own (declared above, named here for the code that reads one directly):
ENV_JOB_ID = setting_of(WorkerSettings, "job_id").env
ENV_NODE = setting_of(WorkerSettings, "node").env
ENV_CONTROL_DIR = setting_of(WorkerSettings, "control_dir").env
ENV_SNAPSHOT_DIR = setting_of(WorkerSettings, "snapshot_dir").env
ENV_SNAPSHOT_EVERY = setting_of(WorkerSettings, "snapshot_every").env
ENV_SNAPSHOT_KEEP = setting_of(WorkerSettings, "snapshot_keep").env
ENV_SNAPSHOT_GROUP_ACCESS = setting_of(WorkerSettings, "snapshot_group_access").env
ENV_STORAGE_TIMEOUT = setting_of(WorkerSettings, "storage_timeout_s").env
ENV_MEMORY_SNAPSHOT_EVERY = setting_of(WorkerSettings, "memory_snapshot_every").env
ENV_MEMORY_DIR = setting_of(WorkerSettings, "memory_dir").env
ENV_LOG_FORMAT = setting_of(WorkerSettings, "log_format").env
ENV_LOG_FILE = setting_of(WorkerSettings, "log_file").env
ENV_COLLECTIVE_TIMEOUT = setting_of(WorkerSettings, "collective_timeout_s").env
ENV_GRACE_PERIOD = setting_of(WorkerSettings, "grace_period_s").env
ENV_MTBF = setting_of(WorkerSettings, "mtbf_s").env
# Not worker settings: the rendezvous store's lineage (one per store, shared by its nodes): a
# snapshot folder's owner record carries it, so a re-form of the job is told from another
# job's run
ENV_RDZV_LINEAGE = "ELASTIC_TRAIN_RDZV_LINEAGE"
# ... and its endpoint HOST:PORT now (after a failover, the new one): the owner record names
# it, so a later run can ask whether the recorded run's store still answers
ENV_RDZV_ENDPOINT = "ELASTIC_TRAIN_RDZV_ENDPOINT"


def lineage_key(job_id: str) -> str:
    """The rendezvous store key of the store's lineage token (signed, ``contract.auth``)."""
    return f"elastic-train/{job_id}/lineage"


# the supervisor's pid: a worker whose parent is not that process at start exits (orphan),
# and the node sentinel kills whatever still carries it once the supervisor is gone
ENV_SUPERVISOR_PID = "ELASTIC_TRAIN_SUPERVISOR_PID"


def worker_variables() -> tuple[str, ...]:
    """Every ``ELASTIC_TRAIN_*`` variable the supervisor sets for its workers: the settings'
    own, then the store's lineage and endpoint and the supervisor's pid (docs/command-line.md
    lists them; a test compares)."""
    own = tuple(f.metadata["setting"].env for f in fields(WorkerSettings))
    return (*own, ENV_RDZV_LINEAGE, ENV_RDZV_ENDPOINT, ENV_SUPERVISOR_PID)


# --- files inside the control directory ---------------------------------------------------
# Created by the supervisor when the node must stop (SIGTERM / SIGUSR1 = preemption).
# Workers check for it after every completed step and agree on it with an all-reduce.
STOP_FILE = "stop"
# Created by the supervisor just before it stops the workers itself (a restart or re-formed
# group, not a preemption). A worker that then gets SIGTERM still stops at the step boundary
# with a snapshot, but labels the stop "restarting" rather than "preempted"; a TrainingSession
# whose memory tier copied that step saves nothing to storage (the new group resumes from it).
RESTART_FILE = "restarting"


# Created by the supervisor in a new attempt's control folder before it starts that attempt's
# workers while the previous attempt's still train (a node joins: the new round formed while
# they trained). A ``TrainingSession`` worker that finds it says so (``handoff_ready_file``)
# once its process group is up, then waits until the supervisor removes it: by then the
# previous workers have stopped at a step's end with their state copied, which this worker
# restores. The group pauses for that stop and the restore only, not for the new processes'
# start (``worker.handoff``).
HANDOFF_FILE = "handoff"


def handoff_ready_file(local_rank: int) -> str:
    """A new worker's answer to ``HANDOFF_FILE``: its process group is up, it waits."""
    return f"handoff-ready-{local_rank}"


def handed_off_file(local_rank: int) -> str:
    """Created by a ``TrainingSession`` worker that stopped for a restart just before it
    leaves its process group and exits: its state is copied, its snapshot writes committed,
    its files closed. A successor waiting for ``HANDOFF_FILE`` may go on from here; the old
    group's teardown and the interpreter's exit (tens of ms) are not waited for."""
    return f"handed-off-{local_rank}"


def handoff_aware_file(local_rank: int) -> str:
    """Created by a ``TrainingSession`` worker when it starts: it (and so the same script's
    next worker) waits for ``HANDOFF_FILE``. Workers that do not say so (any other script,
    even one that publishes progress) are replaced one after the other, never alongside."""
    return f"handoff-aware-{local_rank}"


def copy_now_fifo(local_rank: int) -> str:
    """A FIFO a ``TrainingSession`` worker makes and waits on (a thread blocked in ``open``):
    the supervisor opens it for writing before it stops the workers to re-form the group,
    and every worker with a consistent state copies it into its node's memory once
    (``worker.memory.on_failure``; a rank blocked in a collective with a frozen peer never
    gets back to its loop), then answers in ``copied_file``; the supervisor waits for the
    answers, bounded."""
    return f"copy-now-{local_rank}.fifo"


def request_copy(fifo: str) -> bool:
    """The supervisor's side of ``copy_now_fifo``: one byte wakes the worker's watcher.
    False when no worker holds the FIFO (none made it, or its worker is gone)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no reader; ENOENT: none
    except OSError:
        return False
    try:
        os.write(fd, b"x")
    except OSError:  # EAGAIN: the FIFO is full of requests already
        return False
    finally:
        os.close(fd)
    return True


def copied_file(local_rank: int) -> str:
    """A worker's answer to ``copy_now_fifo``: "copied", or "none" (no consistent state)."""
    return f"copied-{local_rank}"


def copier_file(local_rank: int) -> str:
    """Created by a worker that will answer ``copy_now_fifo``: the supervisor waits only for
    those (a plain script never answers)."""
    return f"copier-{local_rank}"


def progress_file(local_rank: int) -> str:
    """Name of the file where a worker publishes its progress (``progress_record``, rewritten
    in place after every step).

    Fields: ``step`` (completed optimizer steps), ``epoch``, ``restored_step`` (the snapshot
    step this attempt resumed from, or null), ``time`` (unix seconds).
    """
    return f"progress-{local_rank}.json"


PROGRESS_RECORD_BYTES = 256


def progress_record(body: Mapping[str, Any]) -> bytes:
    """One progress report as the fixed-size record a worker writes over the last one (one
    ``pwrite`` at offset 0): the JSON's CRC-32 in hex, a space, the JSON, spaces. In place,
    because a report is written after every step and a new file renamed over the old one costs
    a create, a write and a rename each time. A reader that catches a write half done sees a
    checksum that does not match (``progress_json``)."""
    text = json.dumps(body, separators=(",", ":"))
    record = f"{zlib.crc32(text.encode()):08x} {text}".encode()
    if len(record) > PROGRESS_RECORD_BYTES:
        raise ValueError(f"a progress record of {len(record)} bytes")
    return record.ljust(PROGRESS_RECORD_BYTES)


def progress_json(text: str) -> str | None:
    """The JSON of a ``progress_record``; None when its checksum does not match (read while
    being written). Plain JSON, without a checksum, is returned as it is."""
    text = text.strip()
    head, _, body = text.partition(" ")
    if len(head) != 8 or text.startswith("{"):
        return text
    try:
        expected = int(head, 16)
    except ValueError:
        return None
    return body if zlib.crc32(body.encode()) == expected else None


def events_file(local_rank: int) -> str:
    """Name of the file a worker appends some of its events to, one JSON object a line:
    those in ``FORWARDED_EVENTS``, which the supervisor's metrics follow (it reads the file's
    new complete lines every tick; a torn last line is read once it is complete)."""
    return f"events-{local_rank}.jsonl"


# The worker events the supervisor's metrics are made from (supervisor/core/metrics.py).
FORWARDED_EVENTS = (
    "snapshot.saved",
    "snapshot.restored",
    "train.progress",
    "straggler.detected",
    "straggler.recovered",
)


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
