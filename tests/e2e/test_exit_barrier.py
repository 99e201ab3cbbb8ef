"""A node whose workers succeeded while a peer's still run waits for that peer at the end, as
torch's exit barrier does; but a peer preempted meanwhile never finishes, and is not waited
for: torch's barrier waited its whole timeout (60 s) for it and then logged a traceback at
error level, for a node whose job had succeeded."""

from __future__ import annotations

import signal

import pytest

from tests.e2e.workers.harness import HERE, env_with, free_port, listening, start_agent, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCRIPT = str(HERE / "finish_or_run.py")


def test_a_finished_node_does_not_wait_for_a_peer_that_was_preempted(
    tmp_path, worker_env, agents
) -> None:
    port = free_port()
    argv = ["--nnodes", "2", "--nproc-per-node", "1", SCRIPT]
    a = start_agent(tmp_path, "a", argv, env_with(worker_env, FINISH_AT_ONCE="1"), port=port)
    agents.append(a)
    wait_for(lambda: listening(port), 60, "a to host the store")
    b = start_agent(tmp_path, "b", argv, env_with(worker_env), port=port)
    agents.append(b)
    waiting = a.wait_event("exit_barrier.waiting", 120)  # a's worker succeeded; b's runs
    assert waiting["nodes"] == ["b"] and waiting["timeout_s"] == 60.0
    b.proc.send_signal(signal.SIGTERM)  # the spot notice
    assert b.wait(60) == 143
    assert a.wait(20) == 0  # torch's barrier: 30-60 s, then a traceback
    (finished,) = a.events("job.finished")
    assert finished["status"] == "succeeded"
    assert not a.events("exit_barrier.timed_out")
    assert [e for e in a.events() if e["level"] in ("error", "critical")] == []
