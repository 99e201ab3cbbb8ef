"""The contract between the supervisor and its worker processes.

Workers learn everything from environment variables (torchrun's, plus the ones below), and
talk back through files in a node-local control directory that the supervisor creates for
each attempt. Files, not sockets: they cost a ``stat`` per step, survive a worker's death,
and need no extra ports.
"""

from __future__ import annotations

# --- environment variables set by the supervisor for every worker -------------------------
ENV_JOB_ID = "ELASTIC_TRAIN_JOB_ID"
ENV_NODE = "ELASTIC_TRAIN_NODE"  # the node's name in events (hostname by default)
ENV_SNAPSHOT_DIR = "ELASTIC_TRAIN_SNAPSHOT_DIR"  # fsspec URL; empty = no snapshots
ENV_SNAPSHOT_EVERY = "ELASTIC_TRAIN_SNAPSHOT_EVERY"  # steps between periodic snapshots
ENV_SNAPSHOT_KEEP = "ELASTIC_TRAIN_SNAPSHOT_KEEP"  # newest K committed snapshots kept
ENV_CONTROL_DIR = "ELASTIC_TRAIN_CONTROL_DIR"  # node-local dir, see the files below
ENV_LOG_FORMAT = "ELASTIC_TRAIN_LOG_FORMAT"  # json | console
ENV_LOG_FILE = "ELASTIC_TRAIN_LOG_FILE"  # optional path workers append JSON lines to
ENV_COLLECTIVE_TIMEOUT = "ELASTIC_TRAIN_COLLECTIVE_TIMEOUT"  # seconds, process-group timeout

# --- files inside the control directory ---------------------------------------------------
# Created by the supervisor when the node must stop (SIGTERM / SIGUSR1 = preemption).
# Workers check for it after every completed step and agree on it with an all-reduce.
STOP_FILE = "stop"
# Created by the supervisor just before it stops the workers itself (a restart or re-formed
# group, not a preemption). A worker that then gets SIGTERM still stops at the step boundary
# with a snapshot, but labels the stop "restarting" rather than "preempted".
RESTART_FILE = "restarting"


def progress_file(local_rank: int) -> str:
    """Name of the file where a worker publishes its progress (one JSON object, rewritten).

    Fields: ``step`` (completed optimizer steps), ``epoch``, ``restored_step`` (the snapshot
    step this attempt resumed from, or null), ``time`` (unix seconds).
    """
    return f"progress-{local_rank}.json"


# --- worker exit codes with a meaning for the supervisor ----------------------------------
# The worker saved the final snapshot because *its own* node is being preempted.
EXIT_PREEMPTED = 0
# The worker stopped because *another* node is being preempted; the final snapshot is
# committed and the group must re-form without that node. Not counted as a failure.
EXIT_PEER_PREEMPTED = 75  # EX_TEMPFAIL

# --- supervisor exit codes (documented in the README) -------------------------------------
SUPERVISOR_EXIT_OK = 0
SUPERVISOR_EXIT_FAILED = 1
SUPERVISOR_EXIT_CONFIG = 2
# The node was preempted (SIGTERM/SIGUSR1) and its final snapshot was handled: the job is
# resumable. 143 = 128 + SIGTERM, what schedulers expect from a terminated task.
SUPERVISOR_EXIT_PREEMPTED = 143
