"""Warm workers: a restart forks its workers from the node's warm pool, and the job still
trains every sample exactly once; ``--no-warm-workers`` keeps the respawn path working."""

from __future__ import annotations

from datetime import datetime

import psutil
import pytest

from tests.e2e.workers.harness import (
    PROTO,
    env_with,
    free_port,
    kill_once_argv,
    read_audit,
    start_agent,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "respawn"])
def test_a_restart_after_a_worker_kill_uses_the_pool_and_loses_no_sample(
    tmp_path, worker_env, agents, warm
):
    audit = tmp_path / "audit"
    argv = kill_once_argv(tmp_path, "--warm-workers" if warm else "--no-warm-workers")
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(150) == 0
    started = agent.events("workers.started")
    assert [e["restart_count"] for e in started] == [0, 1]
    assert [e["warm"] for e in started] == [warm, warm]
    ready = agent.events("warm_pool.ready")
    assert len(ready) == (1 if warm else 0)
    if warm:  # the pool is gone with the job
        assert not psutil.pid_exists(ready[0]["pid"]) or (
            psutil.Process(ready[0]["pid"]).status() == psutil.STATUS_ZOMBIE
        )
    assert agent.events("warm_pool.unavailable") == []
    finished = agent.events("job.finished")[-1]
    assert (finished["status"], finished["restarts"]) == ("succeeded", 1)
    # exactly once: the restarted workers did every (step, rank) after the snapshot they
    # resumed from once, and nothing else
    resumed = agent.events("recovery.completed")[0]["snapshot_step"]
    restarted_at = datetime.fromisoformat(started[1]["timestamp"].replace("Z", "+00:00"))
    second = [
        (int(step), int(rank))
        for step, rank, _world, at in (line.split() for line in audit.read_text().splitlines())
        if float(at) > restarted_at.timestamp()
    ]
    assert sorted(second) == [(s, r) for s in range(resumed + 1, 21) for r in (0, 1)]
    assert {(s, r) for s, r, _ in read_audit(audit)} == {
        (s, r) for s in range(1, 21) for r in (0, 1)
    }


def test_a_node_joining_a_running_job_joins_once_its_pool_is_warm(tmp_path, worker_env, agents):
    """The running group pauses from the moment it sees a node waiting: a joining node whose
    pool is still importing torch would make it wait for that too
    (decisions.join_after_warm_pool)."""
    audit, port, env = tmp_path / "audit", free_port(), env_with(worker_env)
    argv = [
        "--min-nodes",
        "1",
        "--max-nodes",
        "2",
        "--snapshot-dir",
        str(tmp_path / "snap"),
        PROTO,
        "--steps",
        "200",
        "--step-time",
        "0.1",
        "--audit",
        str(audit),
    ]
    a = start_agent(tmp_path, "a", argv, env, port=port)
    agents.append(a)
    wait_for(lambda: audit.exists() and len(read_audit(audit)) > 0, 120, "a to train alone")
    b = start_agent(tmp_path, "b", argv, env, port=port)
    agents.append(b)
    grown = a.wait_event("membership.changed", 120, lambda e: e["reason"] == "node_joined")
    ready = b.wait_event("warm_pool.ready", 10)
    assert ready["timestamp"] < grown["timestamp"]  # b's pool was warm before it joined
    started = b.wait_event("workers.started", 30)
    assert started["warm"] is True
    assert a.wait(150) == 0 and b.wait(60) == 0
