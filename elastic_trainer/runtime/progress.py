"""The worker's side of the control directory: the progress file and the stop decision."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

from elastic_trainer import protocol

STOP_PREEMPTED = "preempted"
STOP_PEER_PREEMPTED = "peer_preempted"
STOP_MAX_STEPS = "max_steps"
STOP_RESTARTING = "restarting"  # the supervisor itself is stopping the workers to restart


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


def stop_exit_code(reason: str | None) -> int | None:
    """The worker's exit code after a coordinated stop (None: not a preemption stop)."""
    if reason in (STOP_PREEMPTED, STOP_RESTARTING):
        return protocol.EXIT_PREEMPTED
    if reason == STOP_PEER_PREEMPTED:
        return protocol.EXIT_PEER_PREEMPTED
    return None


# Slurm signals every process of a step (and `--signal` sends SIGUSR1 ahead of the end);
# Kubernetes init processes may forward SIGTERM to the whole process group. Either way the
# worker itself may get the signal before (or instead of) the supervisor's stop file.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Turns SIGTERM/SIGUSR1 to this worker into an own-node stop request.

    Installed only for signals still at their default action and only from the main thread:
    a script that handles the signal itself keeps full control. The handler only records the
    signal; the session reads it at the next step boundary, exactly like the stop file.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        # async-signal context: record only; no logging, no collective
        if self.received is None:
            self.received = signal.Signals(signum).name
            return
        # asked twice (an impatient platform, or the supervisor killing a stuck worker): the
        # default action, now
        self.uninstall()
        os.kill(os.getpid(), signum)

    def uninstall(self) -> None:
        """Give the signals back (only those still ours)."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        self._previous.clear()
