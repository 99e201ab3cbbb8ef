"""The node sentinel's memory: what it saw of the supervisor's tree is killed once it is gone."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from elastic_trainer.entrypoints.sentinel import Memory
from tests.e2e.workers.harness import wait_for

pytestmark = pytest.mark.timeout(60)

# A "supervisor" starting a "worker" in a session of its own (as torch does), which starts a
# child, and one more once a file exists.
SUPERVISOR = textwrap.dedent(
    """
    import subprocess, sys
    WORKER = '''
    import os, subprocess, sys, time
    def sleeper():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    sleeper()
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    sleeper()
    time.sleep(600)
    '''
    w = subprocess.Popen([sys.executable, "-c", WORKER, sys.argv[1]], start_new_session=True)
    print(w.pid, flush=True)
    w.wait()
    """
)


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            pass
    return alive


def test_the_sweep_kills_what_was_seen_and_what_was_born_in_its_sessions(tmp_path):
    go = tmp_path / "go"
    sup = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(go)], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    worker_pid = int(sup.stdout.readline())
    worker = psutil.Process(worker_pid)
    try:
        child_pid = wait_for(lambda: [c.pid for c in worker.children()], 30, "the worker's child")[
            0
        ]
        memory = Memory(supervisor_pid=sup.pid)
        memory.scan()
        assert {pid for pid, _ in memory.procs} >= {worker_pid, child_pid}
        # after the last scan: the worker starts another child, then the supervisor dies
        go.touch()
        late = _late_child(worker, known=child_pid)
        sup.kill()
        sup.wait()
        memory.sweep()
        wait_for(lambda: not _pids_alive([worker_pid, child_pid, late]), 10, "the tree to die")
    finally:
        for proc in [worker, *worker.children(recursive=True)] if worker.is_running() else []:
            proc.kill()
        sup.kill()


def _late_child(worker: psutil.Process, *, known: int) -> int:
    return wait_for(
        lambda: [c.pid for c in worker.children() if c.pid != known], 30, "a late child"
    )[0]


def test_a_spared_child_outlives_the_kill_of_an_attempt_and_strays_do_not():
    from elastic_trainer.supervisor.processes.procs import ProcessTracker

    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    spared, stray = subprocess.Popen(sleep), subprocess.Popen(sleep)
    try:
        tracker = ProcessTracker()
        tracker.spare(spared.pid)
        tracker.kill(grace_s=0)  # ends the attempt: strays among our children are reaped
        assert stray.poll() is not None or not psutil.pid_exists(stray.pid)
        assert spared.poll() is None
    finally:
        for proc in (spared, stray):
            proc.kill()
            proc.wait()


def test_the_subreaper_flag_can_be_read_back_and_given_up():
    from elastic_trainer.supervisor.processes import procs

    if not procs.become_subreaper():
        pytest.skip("Linux only")
    try:
        assert procs.is_subreaper()
    finally:
        procs.become_subreaper(False)
    assert not procs.is_subreaper()


def test_terminate_sigterms_only_the_chosen_workers_and_does_not_kill(tmp_path):
    from elastic_trainer.supervisor.processes.procs import ProcessTracker

    # Each "worker" writes a file when SIGTERM reaches it, and stays: terminate never kills.
    handles = textwrap.dedent(
        """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1], "w").close())
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    marks = [tmp_path / "0", tmp_path / "1"]
    workers = {
        rank: subprocess.Popen([sys.executable, "-c", handles, str(mark)], stdout=subprocess.PIPE)
        for rank, mark in enumerate(marks)
    }
    try:
        for worker in workers.values():
            assert worker.stdout.readline() == b"ready\n"  # its handler is in place
        tracker = ProcessTracker()
        tracker.track(workers)
        assert tracker.terminate([1]) == [workers[1].pid]
        wait_for(marks[1].exists, 30, "rank 1 to get SIGTERM")
        assert not marks[0].exists() and all(w.poll() is None for w in workers.values())
        assert workers[1].pid in tracker.killed_pids  # its exit is ours, not a root cause
    finally:
        for worker in workers.values():
            worker.kill()
            worker.wait()


def test_a_handed_over_attempt_stops_while_the_next_ones_workers_live(tmp_path):
    """A join: the old workers are handed to a tracker of their own, told to stop (their own
    process only: SIGTERM, which each here answers by exiting) and killed, while the new
    attempt's worker, tracked by the original tracker, is neither signalled nor reaped."""
    from elastic_trainer.supervisor.processes.procs import ProcessTracker

    exits_on_term = textwrap.dedent(
        """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    start = [sys.executable, "-c", exits_on_term]
    old = {r: subprocess.Popen(start, stdout=subprocess.PIPE) for r in range(2)}
    new = {0: subprocess.Popen(start, stdout=subprocess.PIPE)}
    try:
        for worker in [*old.values(), *new.values()]:
            assert worker.stdout.readline() == b"ready\n"
        tracker = ProcessTracker()
        tracker.track(old)
        handed = tracker.handover()
        assert tracker.root_pids == set() and handed.root_pids == {p.pid for p in old.values()}
        tracker.track(new)
        assert handed.poll_codes() == {0: None, 1: None}
        handed.signal_roots(signal.SIGTERM)
        wait_for(lambda: None not in handed.poll_codes().values(), 30, "the old ones to exit")
        assert handed.poll_codes() == {0: 7, 1: 7}
        handed.kill(grace_s=0, reap=False)
        assert new[0].poll() is None  # the new attempt's worker lives on
        assert tracker.poll_codes() == {0: None}
    finally:
        for worker in [*old.values(), *new.values()]:
            worker.kill()
            worker.wait()


def test_a_poke_on_the_pipe_scans_at_once_and_eof_sweeps_what_it_saw():
    """The periodic scan is slow (it reads every process of the machine); the supervisor
    pokes the pipe when it starts workers, and the sentinel scans then, not a period later."""
    import os
    import threading

    from elastic_trainer.entrypoints import sentinel

    starts_a_child = (
        "import subprocess, sys, time; sys.stdin.readline(); "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(c.pid, flush=True); time.sleep(600)"
    )
    sup = subprocess.Popen(
        [sys.executable, "-c", starts_a_child], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    read_fd, write_fd = os.pipe()
    memory = Memory(supervisor_pid=sup.pid)
    watcher = threading.Thread(
        target=sentinel.watch,
        args=(sup.pid, read_fd),
        kwargs={"interval_s": 600.0, "memory": memory},
        daemon=True,
    )
    child = None
    try:
        watcher.start()
        wait_for(lambda: memory.scans, 30, "the first scan")  # before the child is born
        sup.stdin.write(b"go\n")
        sup.stdin.flush()
        child = psutil.Process(int(sup.stdout.readline()))
        os.write(write_fd, b"s")
        wait_for(lambda: child.pid in {pid for pid, _ in memory.procs}, 30, "the poked scan")
        assert memory.scans == 2
        os.close(write_fd)
        watcher.join(30)
        assert not watcher.is_alive()  # EOF: swept (a SIGKILL lands a moment later)
        wait_for(lambda: not _pids_alive([child.pid]), 10, "the child to die")
    finally:
        for proc in (child, sup):
            with contextlib.suppress(Exception):
                proc.kill()
        sup.wait()
        os.close(read_fd)


def test_starting_workers_pokes_the_node_sentinel(monkeypatch):
    from elastic_trainer.supervisor.processes import procs

    guard = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read(1))"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        monkeypatch.setattr(procs, "_sentinel", guard)
        procs.ProcessTracker().track({0: worker})
        assert guard.stdout.read() == b"s"
    finally:
        worker.wait()
        guard.kill()
        guard.wait()
