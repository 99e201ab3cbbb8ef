"""No orphans: whatever ends the supervisor, its workers and their children end with it.

Every process of a test carries ``ORPHAN_DIR=<its tmp dir>`` in its environment (workers and
their children inherit it), so the test finds them all with psutil, even once re-parented to
init, and even those spawned an instant before the kill. Workers run ``orphan_worker.py``:
each starts a child of its own and runs until killed.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from tests.e2e.workers.harness import (
    ORPHAN,
    Agent,
    env_with,
    free_port,
    processes_with_env,
    start_agent,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Generous, far above what the clean-up takes; a hang, not slowness, is the bug.
GONE_WITHIN_S = 15.0


def _start(
    tmp_path: Path, worker_env, *, nproc: int, new_session: bool = False, args=(), flags=()
) -> Agent:
    env = env_with(worker_env, ORPHAN_DIR=str(tmp_path))
    argv = ["--nproc-per-node", str(nproc), *flags, ORPHAN, *args]
    return start_agent(tmp_path, "n0", argv, env, port=free_port(), new_session=new_session)


def _workers(tmp_path: Path, count: int) -> list[dict[str, int]]:
    """Wait until ``count`` workers started their own child; their pids."""

    def ready():
        files = sorted(tmp_path.glob("*.json"))
        return [json.loads(f.read_text()) for f in files] if len(files) >= count else None

    return wait_for(ready, 60, f"{count} workers and their children")


def _assert_all_gone(tmp_path: Path) -> None:
    wait_for(
        lambda: not processes_with_env("ORPHAN_DIR", str(tmp_path)),
        GONE_WITHIN_S,
        "every process of the node to be gone",
    )


def _assert_were_alive(pids: list[dict[str, int]]) -> None:
    for row in pids:  # the check below must not pass because they never ran
        assert psutil.pid_exists(row["worker"]) and psutil.pid_exists(row["grandchild"])


def test_sigkill_of_the_supervisor_alone_ends_workers_and_their_children(
    tmp_path, worker_env, agents
):
    agent = _start(tmp_path, worker_env, nproc=2)
    agents.append(agent)
    pids = _workers(tmp_path, 2)
    _assert_were_alive(pids)
    # the workers were forked by the warm pool (on by default), which is alive and ours
    (started,) = wait_for(lambda: agent.events("workers.started"), 30, "workers.started")
    assert started["warm"]
    (ready,) = agent.events("warm_pool.ready")
    pool = psutil.Process(ready["pid"])
    assert _alive(pool) and pool.ppid() == agent.proc.pid
    assert {_ppid(psutil.Process(row["worker"])) for row in pids} == {agent.proc.pid}
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(timeout=10)
    _assert_all_gone(tmp_path)
    wait_for(lambda: not _alive(pool), GONE_WITHIN_S, "the warm pool to be gone")


def test_after_a_restart_a_sigkill_of_the_supervisor_still_ends_the_workers_children(
    tmp_path, worker_env, agents
):
    """Regression: the first restart reaped the node sentinel as a stray child, so a later
    SIGKILL of the supervisor left the new workers' own children running."""
    agent = _start(tmp_path, worker_env, nproc=1, flags=("--max-restarts", "1"))
    agents.append(agent)
    (first,) = _workers(tmp_path, 1)
    os.kill(first["worker"], signal.SIGKILL)  # a worker crash: the group restarts
    again = [row for row in _workers(tmp_path, 2) if row["worker"] != first["worker"]]
    _assert_were_alive(again)
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(timeout=10)
    _assert_all_gone(tmp_path)


def test_sigkill_of_the_supervisors_process_group_ends_the_whole_node(tmp_path, worker_env, agents):
    # a scheduler's `kill -9 -PGID`: torch starts each worker in a session of its own, so
    # the signal reaches the supervisor only
    agent = _start(tmp_path, worker_env, nproc=2, new_session=True)
    agents.append(agent)
    _assert_were_alive(_workers(tmp_path, 2))
    os.killpg(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait(timeout=10)
    _assert_all_gone(tmp_path)


def test_sigkill_while_workers_are_being_started_leaves_none_behind(tmp_path, worker_env, agents):
    agent = _start(tmp_path, worker_env, nproc=4)
    agents.append(agent)
    supervisor = psutil.Process(agent.proc.pid)
    helpers: set[int] = set()

    def first_worker():
        # By pid, not by command line (a worker shows its title, proc_title.py): no worker
        # starts before the pool is ready or given up, so the supervisor's children seen
        # before that is said (listed first, then the events read) are the sentinel and
        # the pool; any other child is a worker (a warm one is re-parented to the supervisor)
        children = {c.pid for c in _children(supervisor) if _ppid(c) == agent.proc.pid}
        if not agent.events("warm_pool.ready") and not agent.events("warm_pool.unavailable"):
            helpers.update(children)
            return False
        return bool(children - helpers)

    wait_for(first_worker, 60, "the first worker process", step=0.005)
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(timeout=10)
    _assert_all_gone(tmp_path)


def test_clean_exit_and_sigterm_leave_no_sentinel_and_no_zombie(tmp_path, worker_env, agents):
    done = tmp_path / "done"
    done.mkdir()
    agent = _start(done, worker_env, nproc=2, args=("--exit-after", "0.5"))
    agents.append(agent)
    assert agent.wait(60) == 0
    _assert_all_gone(done)

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    # A long grace period: these plain workers (no TrainingSession, no stop file read) get
    # SIGTERM at once, as torchrun's do, not at its end (regression: they got it 2 s before
    # it, so a script's own SIGTERM checkpoint had 2 s of the 25).
    agent = _start(stopped, worker_env, nproc=2, args=(), flags=("--grace-period", "300"))
    agents.append(agent)
    _workers(stopped, 2)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(60) == 143
    (received,) = agent.events("preemption.received")
    assert sorted(received["signalled_ranks"]) == [0, 1]
    _assert_all_gone(stopped)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ppid(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []
