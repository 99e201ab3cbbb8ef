"""The worker's side of the control directory: the progress file and the stop decision."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic_trainer.contract import protocol

STOP_PREEMPTED = "preempted"
STOP_PEER_PREEMPTED = "peer_preempted"
STOP_MAX_STEPS = "max_steps"
STOP_RESTARTING = "restarting"  # the supervisor itself is stopping the workers to restart
# a peer node's supervisor is restarting the group (ours is about to, or will see us leave)
STOP_PEER_RESTARTING = "peer_restarting"
RESTART_STOPS = (STOP_RESTARTING, STOP_PEER_RESTARTING)  # the state stays on every node


class ProgressFile:
    """Writes ``progress-<local_rank>.json`` in place after every step: one fixed-size record
    (``protocol.progress_record``) over the last one, in the supervisor's private control
    folder (not followed if a link; created 0600). A reader that catches it half written
    sees a checksum that does not match and reads it again at its next tick."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def write(self, *, step: int, epoch: int, restored_step: int | None) -> None:
        if self.path is None:
            return
        body = {"step": step, "epoch": epoch, "restored_step": restored_step, "time": time.time()}
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, protocol.progress_record(body), 0)
        finally:
            os.close(fd)


class EventForwarder(logging.Handler):
    """Appends this worker's ``protocol.FORWARDED_EVENTS`` to ``events-<local_rank>.jsonl``
    in the control directory, where the supervisor's metrics read them.

    A logging handler on the root logger: it sees every structlog event of the process, from
    any thread (the snapshot writer's too), with the fields the log line gets. One
    ``O_APPEND`` write per line, opened per event: they are rare (rate-limited progress,
    snapshots), and a worker killed mid-write leaves at most one torn last line, which the
    reader skips until a newline ends it.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        event = record.msg
        if not (isinstance(event, dict) and event.get("event") in protocol.FORWARDED_EVENTS):
            return
        try:
            line = json.dumps(event, default=str) + "\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError:  # the attempt's folder is gone: no supervisor is reading it any more
            pass

    @classmethod
    def install(cls, control_dir: str | None, local_rank: int) -> EventForwarder | None:
        """Forward from now on (replacing an earlier forwarder of this process)."""
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, cls):
                root.removeHandler(handler)
        if not control_dir:
            return None
        forwarder = cls(os.path.join(control_dir, protocol.events_file(local_rank)))
        root.addHandler(forwarder)
        return forwarder

    def uninstall(self) -> None:
        logging.getLogger().removeHandler(self)


# Names a script's figures cannot take: train.progress's own fields and the log's
RESERVED_FIGURES = frozenset(
    {"step", "epoch", "samples_per_s", "eta_s", "event", "level", "timestamp", "rank"}
)


def figures_of(figures: Mapping[str, Any]) -> dict[str, float]:
    """A script's figures as plain floats (0-d tensors and numpy scalars too); ValueError
    names the first that is not a number or takes a reserved name."""
    out: dict[str, float] = {}
    for name, value in figures.items():
        if name in RESERVED_FIGURES:
            raise ValueError(f"log_metrics({name}=...): {name!r} is set by the session; rename it")
        item = getattr(value, "item", None)
        number = item() if callable(item) else value
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(
                f"log_metrics({name}={value!r}): not a number; pass a float (e.g. loss.item())"
            )
        out[name] = float(number)
    return out


class MetricsReporter:
    """Rate-limits a script's figures into ``train.progress`` fields: at most one report per
    ``every_s`` (the first call reports at once), with the steps per second since the last
    report and, when the run has a step budget, the time left. Pure: the clock comes in."""

    def __init__(self, *, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last: tuple[float, int] | None = None  # (time, step) of the last report

    def report(
        self,
        figures: Mapping[str, float],
        *,
        step: int,
        epoch: int,
        max_steps: int | None = None,
        samples_per_step: int | None = None,
    ) -> dict[str, Any] | None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.every_s:
            return None
        rate = self._steps_per_s(now, step)
        self._last = (now, step)
        eta = None
        if rate and max_steps is not None:
            eta = round(max(0, max_steps - step) / rate, 1)
        samples = round(rate * samples_per_step, 2) if rate and samples_per_step else None
        return {
            "loss": None,
            "lr": None,
            **figures,
            "step": step,
            "epoch": epoch,
            "samples_per_s": samples,
            "eta_s": eta,
        }

    def _steps_per_s(self, now: float, step: int) -> float | None:
        if self._last is None or now <= self._last[0] or step <= self._last[1]:
            return None
        rate = (step - self._last[1]) / (now - self._last[0])
        return rate if math.isfinite(rate) else None


# A rank's stop in the step's all-reduce (a sum): a restart counts 1, a preemption this much,
# more than any world size, so the sum says both whether anyone stops and whether anyone's
# node is going away.
STOP_VOTE_PREEMPTED = 1 << 24


def stop_vote(reason: str | None) -> int:
    """What this rank adds to the step's stop sum: 0 (no stop of its own), 1 (its supervisor
    restarts the group), ``STOP_VOTE_PREEMPTED`` (its node is being preempted)."""
    if reason is None:
        return 0
    return 1 if reason == STOP_RESTARTING else STOP_VOTE_PREEMPTED


def peer_stop_reason(votes: int) -> str:
    """Why a rank without a stop of its own stops, from the group's sum of ``stop_vote``: every
    stopping rank's supervisor is restarting the group (the state stays on every node: the new
    group resumes from memory), or some node is going away (its state with it: storage)."""
    return STOP_PEER_PREEMPTED if votes >= STOP_VOTE_PREEMPTED else STOP_PEER_RESTARTING


def stop_exit_code(reason: str | None) -> int | None:
    """The worker's exit code after a coordinated stop (None: not a preemption stop)."""
    if reason in (STOP_PREEMPTED, STOP_RESTARTING):
        return protocol.EXIT_PREEMPTED
    if reason in (STOP_PEER_PREEMPTED, STOP_PEER_RESTARTING):
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
