"""A job killed hard (every process SIGKILLed: a reclaimed machine, an OOM kill, ``kill -9``)
and started again at once with the same command resumes from its newest snapshot: its own
dead run's fresh owner record is known dead at once (``worker/run_liveness.py``), not after
two minutes of heartbeat ageing. A live job's folder is still refused to a second rendezvous.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.workers.harness import FAST_RDZV, HERE, env_with, free_port, start_agent, wait_for
from tests.storage.conftest import DUMMY_AWS, make_bucket, moto_endpoint  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKER = str(HERE / "sup_session_worker.py")
JOB = "hard-kill"


def _argv(snap: str, audit: Path, nodes: int) -> list[str]:
    return [
        "--nnodes", f"1:{nodes}", "--nproc-per-node", "1", "--snapshot-dir", snap,
        "--snapshot-every", "5", WORKER, "--audit-dir", str(audit), "--samples", "96",
        "--global-batch", "8", "--epochs", "100", "--step-time", "0.1",
    ]  # fmt: skip


def _start(tmp: Path, snap: str, nodes: int, port: int, env: dict, tag: str, agents: list):
    started = []
    for i in range(nodes):
        agent = start_agent(tmp, f"{tag}{i}", _argv(snap, tmp / "audit", nodes), env,
                            port=port, job_id=JOB, rdzv_conf=FAST_RDZV)  # fmt: skip
        agents.append(agent)
        started.append(agent)
    return started


def _kill_all_then_restart(tmp, snap, nodes, env, agents, *, same_endpoint: bool):
    port = free_port()
    first = _start(tmp, snap, nodes, port, env, "a", agents)
    first[0].wait_event("snapshot.saved", 180, lambda e: e.get("step", 0) >= 10)
    for agent in first:
        agent.kill_tree()  # the whole job, at once: nobody says goodbye
    again = _start(tmp, snap, nodes, port if same_endpoint else free_port(), env, "b", agents)
    restored = again[0].wait_event("snapshot.restored", 120)
    assert restored["step"] >= 10
    adopted = [e for a in again for e in a.events("snapshot.adopted")]
    assert adopted and {e["reason"] for e in adopted} <= {"gone", "same_rendezvous"}, adopted
    assert "gone" in {e["reason"] for e in adopted}
    for agent in again:
        assert not agent.events("job.finished"), agent.events("job.finished")


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_same_command_right_after_a_whole_job_sigkill_resumes(
    tmp_path, worker_env, agents, nodes
) -> None:
    env = env_with(worker_env)
    _kill_all_then_restart(tmp_path, str(tmp_path / "snap"), nodes, env, agents,
                           same_endpoint=True)  # fmt: skip


def test_a_requeue_onto_another_endpoint_resumes_at_once(tmp_path, worker_env, agents) -> None:
    env = env_with(worker_env)
    _kill_all_then_restart(tmp_path, str(tmp_path / "snap"), 1, env, agents,
                           same_endpoint=False)  # fmt: skip


@pytest.mark.s3
def test_on_s3_too(tmp_path, worker_env, agents, moto_endpoint) -> None:  # noqa: F811
    env = env_with(worker_env, AWS_ENDPOINT_URL=moto_endpoint, **DUMMY_AWS)
    snap = f"s3://{make_bucket(moto_endpoint)}/run"
    _kill_all_then_restart(tmp_path, snap, 1, env, agents, same_endpoint=True)


def test_a_second_rendezvous_next_to_a_live_job_is_refused(tmp_path, worker_env, agents) -> None:
    env = env_with(worker_env)
    snap = str(tmp_path / "snap")
    (live,) = _start(tmp_path, snap, 1, free_port(), env, "live", agents)
    live.wait_event("snapshot.saved", 180, lambda e: e.get("step", 0) >= 5)
    (other,) = _start(tmp_path, snap, 1, free_port(), env, "other", agents)
    assert other.wait(120) == 2
    (finished,) = other.events("job.finished")
    assert finished["status"] == "config_error"
    lines = [e.get("error", "") for e in other.events() if e["level"] == "error"]
    assert any("is being written by run" in line for line in lines), lines
    assert live.proc.poll() is None
    saved = len(live.events("snapshot.saved"))
    wait_for(lambda: len(live.events("snapshot.saved")) > saved, 60, "the live job saving on")
    assert os.path.exists(os.path.join(snap, "owner.json"))
