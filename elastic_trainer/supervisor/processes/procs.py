"""psutil process trees: every worker and everything it started, killed together.

torch starts each worker in its own session, so killing our process group misses them; and a
worker's own children (data loaders, compilers) are re-parented when the worker dies. We
therefore remember every descendant we have ever seen (pid + create time, so a recycled pid
is never killed by mistake), and make the supervisor a child subreaper (Linux) so that
orphans are re-parented to us and can be killed and reaped: no orphan, no zombie.

That covers the exits the supervisor lives through. For the others (SIGKILL, OOM kill, a
crash), ``guard_node`` arms two more guards before any worker starts: each worker asks the
kernel for a parent-death SIGKILL (``bootstrap.die_with_supervisor``), and a sentinel
process kills whatever else of the tree outlives the supervisor (``sentinel.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from elastic_trainer import proc_tree
from elastic_trainer.contract import protocol

# the node sentinel's program: run with ``python -m`` (it imports nothing of ours but psutil)
SENTINEL_MODULE = "elastic_trainer.entrypoints.sentinel"
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37

# This process's node sentinel (``guard_node``): a child of ours, but never a stray to reap.
_sentinel: subprocess.Popen | None = None


def guard_node() -> subprocess.Popen | None:
    """Make every process this supervisor starts die with it, on every exit path.

    Call before starting workers: subreaper, the supervisor pid for the workers'
    parent-death check, and the node sentinel (None where it could not start: the other
    guards still hold), one per process: it lives until this process exits, and
    ``reap_strays`` spares it (``ProcessTracker._keep``).
    """
    global _sentinel
    become_subreaper()
    os.environ[protocol.ENV_SUPERVISOR_PID] = str(os.getpid())
    if _sentinel is None or _sentinel.poll() is not None:
        try:
            _sentinel = _start_sentinel()
        except OSError:
            _sentinel = None
    return _sentinel


def _start_sentinel() -> subprocess.Popen:
    """The sentinel for this process (``entrypoints/sentinel.py``); it lives until this
    process exits."""
    return subprocess.Popen(
        [sys.executable, "-m", SENTINEL_MODULE, str(os.getpid())],
        stdin=subprocess.PIPE,  # our end is close-on-exec: only our death closes it
        start_new_session=True,
    )


def end_node_sentinel() -> None:
    """End the sentinel of a start that ends before any worker (bad input, a stop): nothing
    of ours is left for its sweep, and a caller of ``run.main`` that goes on (a test, a
    wrapper) would otherwise keep one sentinel per call, each scanning the machine's processes."""
    guard = node_sentinel()
    if guard is not None:
        guard.kill()
        guard.wait()


def poke_node_sentinel() -> None:
    """Tell the sentinel to scan the tree now (workers just started): one byte on its pipe,
    never blocking (a full pipe already holds a poke it has not read)."""
    guard = node_sentinel()
    if guard is None or guard.stdin is None:
        return
    with contextlib.suppress(OSError, ValueError):
        fd = guard.stdin.fileno()
        os.set_blocking(fd, False)
        os.write(fd, b"s")


def node_sentinel() -> subprocess.Popen | None:
    """The sentinel ``guard_node`` started in this process (None: none, or it ended)."""
    return _sentinel if _sentinel is not None and _sentinel.poll() is None else None


def become_subreaper(enable: bool = True) -> bool:
    """Orphaned descendants get re-parented to this process instead of init (Linux only);
    ``enable=False`` gives that up again."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(enable), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    """Whether orphans of our descendants come to us (the warm pool's workers must)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        ok = libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    return ok and flag.value != 0


def oom_kill_count() -> int | None:
    """The kernel's OOM-kill counter for our memory cgroup (v2 or v1); None if unreadable.

    A worker that died by SIGKILL while this counter rose was killed by the OOM killer.
    """
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append(f"/sys/fs/cgroup{path}/memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(f"/sys/fs/cgroup/memory{path}/memory.oom_control")
    for candidate in candidates:
        try:
            with open(candidate, encoding="utf-8") as f:
                for row in f:
                    key, _, value = row.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


@dataclass(frozen=True, kw_only=True)
class Resources:
    rss_bytes: int
    cpu_percent: float
    num_procs: int


class ProcessTracker:
    """Worker process trees of the current attempt, keyed by local rank."""

    def __init__(self) -> None:
        self._roots: dict[int, psutil.Process] = {}
        self._popens: dict[int, subprocess.Popen] = {}
        self._known: dict[int, dict[tuple[int, float], psutil.Process]] = {}
        self.killed_pids: set[int] = set()  # signalled by us: their exit is not a root cause
        self._spared: set[int] = set()  # children that outlive attempts (the warm pool)
        self._pidfds: dict[int, int] = {}  # pid -> pidfd of a running worker (``exit_fds``)

    def spare(self, pid: int) -> None:
        """Never reap this child of ours as a stray (it is no worker and no orphan)."""
        self._spared.add(pid)

    def track(self, popens: dict[int, subprocess.Popen]) -> None:
        """Start tracking the workers of a new attempt (their Popen objects own the reaping)."""
        self._roots.clear()
        self._known.clear()
        self._popens = dict(popens)
        for local_rank, popen in popens.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(popen.pid)
                self._roots[local_rank] = proc
                self._known[local_rank] = {(popen.pid, proc.create_time()): proc}
        self.refresh()
        poke_node_sentinel()

    def exit_fds(self) -> list[int]:
        """A pidfd of each worker process still running, readable once it exits: the
        supervisor's loop waits on them (``StopRequest.wait_for_change``). Each is opened
        once and closed once its process is known to have exited; none where the kernel
        has no pidfds (the loop's interval bounds the wait then)."""
        running = {popen.pid for popen in self._popens.values() if popen.poll() is None}
        for pid in set(self._pidfds) - running:
            os.close(self._pidfds.pop(pid))
        for pid in running - set(self._pidfds):
            with contextlib.suppress(AttributeError, OSError):
                self._pidfds[pid] = os.pidfd_open(pid)
        return list(self._pidfds.values())

    def _close_exit_fds(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()

    def handover(self) -> ProcessTracker:
        """A tracker of the current attempt's workers alone; this one then tracks nothing
        until ``track``: the next attempt's workers start while these stop (a join)."""
        self._close_exit_fds()  # the loop waits on the new ones' (none are open meanwhile)
        old = ProcessTracker()
        old._roots, old._popens, old._known = self._roots, self._popens, self._known
        old.killed_pids, old._spared = self.killed_pids, self._spared
        self._roots, self._popens, self._known = {}, {}, {}
        return old

    def take_back(self, old: ProcessTracker) -> None:
        """Track ``old``'s workers again (a ``handover`` undone: the new attempt's are gone)."""
        self._roots, self._popens, self._known = old._roots, old._popens, old._known
        old._roots, old._popens, old._known = {}, {}, {}

    def pids(self) -> dict[int, int]:
        """local rank -> pid of each worker's own process."""
        return {local_rank: popen.pid for local_rank, popen in self._popens.items()}

    def signal_roots(self, sig: signal.Signals) -> None:
        """``sig`` to each worker's own process only: a ``TrainingSession`` stops at its
        step's end, its DataLoader workers must live until then."""
        for popen in self._popens.values():
            if popen.poll() is None:
                self.killed_pids.add(popen.pid)
                with contextlib.suppress(OSError):
                    os.kill(popen.pid, sig)
                    os.kill(popen.pid, signal.SIGCONT)

    def poll_codes(self) -> dict[int, int | None]:
        """local rank -> exit code of each worker's own process (None: running)."""
        return {local_rank: popen.poll() for local_rank, popen in self._popens.items()}

    @property
    def root_pids(self) -> set[int]:
        return {p.pid for p in self._popens.values()}

    def _keep(self) -> set[int]:
        # the node sentinel too: reaped as a stray at the first restart, it left every later
        # SIGKILL of the supervisor with the workers' own children alive
        guard = node_sentinel()
        return self.root_pids | self._spared | ({guard.pid} if guard is not None else set())

    def refresh(self) -> None:
        """Remember descendants that appeared since the last call."""
        for local_rank, root in self._roots.items():
            try:
                children = proc_tree.children(root.pid, recursive=True)
            except psutil.Error:
                continue
            known = self._known[local_rank]
            for child in children:
                with contextlib.suppress(psutil.Error):
                    known.setdefault((child.pid, child.create_time()), child)

    def alive(self) -> list[psutil.Process]:
        return [p for procs in self._known.values() for p in procs.values() if _running(p)]

    def resources(self) -> dict[int, Resources]:
        out: dict[int, Resources] = {}
        for local_rank, procs in self._known.items():
            rss, cpu, count = 0, 0.0, 0
            for proc in procs.values():
                try:
                    rss += proc.memory_info().rss
                    cpu += proc.cpu_percent(interval=None)
                    count += 1
                except psutil.Error:
                    continue
            out[local_rank] = Resources(rss_bytes=rss, cpu_percent=cpu, num_procs=count)
        return out

    def terminate(self, local_ranks: Iterable[int]) -> list[int]:
        """SIGTERM the process trees of these workers now (as torchrun signals a worker's
        process group), with no SIGKILL after it: ``kill`` ends whatever is left. The pids
        signalled."""
        self.refresh()
        procs = [p for r in local_ranks for p in self._known.get(r, {}).values() if _running(p)]
        self.killed_pids.update(p.pid for p in procs)
        _signal_all(procs, signal.SIGTERM)
        return [p.pid for p in procs]

    def kill(self, *, grace_s: float, reap: bool = True) -> None:
        """SIGTERM every tracked process (then SIGKILL after ``grace_s``); reap orphans
        (``reap``: not while another attempt's workers start, which are no orphans).

        Workers themselves are reaped only through their Popen objects: reaping them with
        waitpid behind torch's back would make Popen report exit code 0 (ECHILD).
        """
        self.refresh()
        procs = self.alive()
        self.killed_pids.update(p.pid for p in procs)
        if grace_s > 0 and procs:
            _signal_all(procs, signal.SIGTERM)
            procs = self._wait(procs, time.monotonic() + grace_s, reap=reap)
        _signal_all(procs, signal.SIGKILL)
        self._wait(procs, time.monotonic() + 5, reap=reap)
        if reap:
            reap_strays(keep=self._keep())

    def _wait(
        self, procs: list[psutil.Process], deadline: float, *, reap: bool = True
    ) -> list[psutil.Process]:
        """Wait until ``procs`` are gone or the deadline passes; return those still alive."""
        popen_of = {p.pid: p for p in self._popens.values()}
        while True:
            for popen in popen_of.values():
                popen.poll()
            procs = [p for p in procs if _running(p)]
            if not procs or time.monotonic() >= deadline:
                return procs
            if reap:
                reap_strays(keep=self._keep())
            time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_all(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
            if sig == signal.SIGTERM:
                proc.send_signal(signal.SIGCONT)  # a stopped process only sees SIGTERM when resumed


def reap_strays(*, keep: set[int]) -> list[int]:
    """Kill and reap our children that are not ``keep`` (orphans re-parented to us)."""
    reaped: list[int] = []
    for child in proc_tree.children(os.getpid(), recursive=False):
        if child.pid in keep:
            continue
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                child.kill()
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(child.pid, 0)
            reaped.append(child.pid)
    return reaped
