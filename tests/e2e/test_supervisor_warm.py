"""Warm workers: a restart forks its workers from the node's warm pool, and the job still
trains every sample exactly once; ``--no-warm-workers`` keeps the respawn path working."""

from __future__ import annotations

from datetime import datetime

import psutil
import pytest

from tests.e2e.workers.harness import (
    env_with,
    free_port,
    kill_once_argv,
    read_audit,
    start_agent,
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
