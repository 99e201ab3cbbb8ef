"""A node-level sentinel: when the supervisor dies, by any means, its descendants die too.

``python -m elastic_trainer.entrypoints.sentinel SUPERVISOR_PID``, started by the
supervisor with a pipe on stdin and in a session of its own (a ``kill -9 -PGID`` of the supervisor's
process group, or a Ctrl-C on its terminal, does not reach it). It imports nothing heavy
(psutil and the standard library), so it is up in a fraction of a second.

While the supervisor lives, the sentinel remembers every descendant it sees (pid + create
time, so that a recycled pid is never killed) and the sessions they run in. When the pipe
reaches EOF -- the supervisor exited, cleanly or by SIGKILL -- it SIGKILLs every remembered
process still alive, every process still in a remembered session, and every process whose
environment names this supervisor (``ELASTIC_TRAIN_SUPERVISOR_PID``, which workers and
their children inherit): a process born between two scans, or before the first, is caught
too. Workers die by themselves (``PR_SET_PDEATHSIG`` in the
bootstrap); the sentinel is what catches *their* children (DataLoader workers, processes
the script spawned), which are re-parented to init when the worker dies.

Why a separate process: the supervisor cannot clean up after its own SIGKILL, and the
kernel's parent-death signal only reaches direct children.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys

import psutil

from elastic_trainer import proc_title, proc_tree
from elastic_trainer.contract.protocol import ENV_SUPERVISOR_PID

# Seconds between two scans of the supervisor's tree. The supervisor writes a byte on the
# pipe when it starts workers (``procs.poke_node_sentinel``), which scans at once; the
# periodic scan is for what the workers start later. A process born and orphaned between
# two scans is still caught through its session or the supervisor's mark in its environment
# (see ``sweep``). A scan reads every process of the machine (psutil's parent map), so
# scanning often was what a sentinel cost: 1.1 % of a core each at 0.25 s, and with 128
# agents on one machine (700 processes) their sentinels took most of its two cores.
SCAN_INTERVAL_S = 2.0


class Memory:
    """Descendants seen so far: (pid, create time) -> process, and their session ids."""

    def __init__(self, *, supervisor_pid: int, marker: str | None = None) -> None:
        self.supervisor_pid = supervisor_pid
        self.marker = marker  # the value of ENV_SUPERVISOR_PID its workers inherit
        self.procs: dict[tuple[int, float], psutil.Process] = {}
        self.sessions: set[int] = set()
        # never ours to kill: the sessions of the supervisor and of this sentinel
        self.spared_sessions = {_sid(supervisor_pid), os.getsid(0)} - {None}
        self.scans = 0

    def scan(self) -> None:
        self.scans += 1
        try:
            children = proc_tree.children(self.supervisor_pid, recursive=True)
        except psutil.Error:
            return
        for child in children:
            if child.pid == os.getpid():
                continue
            with contextlib.suppress(psutil.Error):
                self.procs.setdefault((child.pid, child.create_time()), child)
                sid = _sid(child.pid)
                if sid is not None and sid not in self.spared_sessions:
                    self.sessions.add(sid)

    def sweep(self) -> int:
        """SIGKILL what is left of the remembered tree; the number of processes signalled."""
        targets = {p.pid: p for p in self.procs.values() if _alive(p)}
        for proc in psutil.process_iter():
            if proc.pid != os.getpid() and proc.pid not in targets and self._ours(proc):
                targets[proc.pid] = proc
        for proc in targets.values():
            with contextlib.suppress(psutil.Error):
                proc.kill()  # psutil checks the create time: a recycled pid is left alone
        return len(targets)

    def _ours(self, proc: psutil.Process) -> bool:
        if _sid(proc.pid) in self.sessions:
            return True
        if self.marker is None:
            return False
        try:  # readable for our own user's processes, which is what we start
            return proc.environ().get(ENV_SUPERVISOR_PID) == self.marker
        except psutil.Error:
            return False


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch(
    supervisor_pid: int,
    pipe_fd: int,
    *,
    interval_s: float = SCAN_INTERVAL_S,
    memory: Memory | None = None,
) -> int:
    """Scan every ``interval_s`` and whenever a byte arrives on ``pipe_fd``, until it reaches
    EOF; then sweep twice (a dying worker's last child)."""
    if memory is None:
        memory = Memory(supervisor_pid=supervisor_pid, marker=str(supervisor_pid))
    while True:
        memory.scan()
        readable, _, _ = select.select([pipe_fd], [], [], interval_s)
        if readable and not os.read(pipe_fd, 4096):
            break
    memory.sweep()
    return memory.sweep()


def main(argv: list[str]) -> int:
    # Terminal and scheduler signals are for the supervisor, which stops its workers
    # gracefully; the sentinel acts only once the supervisor is gone.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    proc_title.set_title(proc_title.sentinel(int(argv[0])))
    watch(int(argv[0]), sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
