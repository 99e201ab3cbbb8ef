"""The worker's side of the control directory: the progress file and the stop decision."""

from __future__ import annotations

import json
import os
import time

from elastic_trainer import protocol

STOP_PREEMPTED = "preempted"
STOP_PEER_PREEMPTED = "peer_preempted"
STOP_MAX_STEPS = "max_steps"


class ProgressFile:
    """Rewrites ``progress-<local_rank>.json`` atomically (write + rename): a reader never
    sees half a file, and the cost per step is one small write and one rename."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._tmp = f"{path}.tmp-{os.getpid()}" if path else None

    def write(self, *, step: int, epoch: int, restored_step: int | None) -> None:
        if self.path is None or self._tmp is None:
            return
        body = {"step": step, "epoch": epoch, "restored_step": restored_step, "time": time.time()}
        with open(self._tmp, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(body))
        os.replace(self._tmp, self.path)


def read_progress(path: str) -> dict[str, object] | None:
    """The last progress a worker published, or None if it has not published yet."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None


def stop_exit_code(reason: str | None) -> int | None:
    """The worker's exit code after a coordinated stop (None: not a preemption stop)."""
    if reason == STOP_PREEMPTED:
        return protocol.EXIT_PREEMPTED
    if reason == STOP_PEER_PREEMPTED:
        return protocol.EXIT_PEER_PREEMPTED
    return None
