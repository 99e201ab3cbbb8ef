"""torchrun command lines, unchanged but for the program name, on loopback."""

from __future__ import annotations

import json

import pytest

from tests.e2e.workers.harness import PLAIN_DDP, PROTO, env_with, free_port, start_agent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_torchrun_static_command_line_survives_a_worker_failure(tmp_path, worker_env, agents):
    """torchrun --nnodes 2 --node-rank 0|1 --master-addr --master-port SCRIPT: two nodes run
    an unmodified DDP script whose rank 1 fails once; both restart and finish."""
    port = free_port()
    out = tmp_path / "env.json"
    for rank in (0, 1):
        argv = [
            "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--nproc-per-node", "1", "--max-restarts", "2",
            PLAIN_DDP, str(out),
        ]  # fmt: skip
        agents.append(
            start_agent(tmp_path, f"n{rank}", argv, env_with(worker_env), port=0, endpoint=False)
        )
    assert [a.wait(200) for a in agents] == [0, 0], agents[1].stderr_file.read_text()[-2000:]
    seen = json.loads(out.read_text())
    assert seen["WORLD_SIZE"] == "2" and seen["MASTER_PORT"]
    assert sum(len(a.events("worker.failed")) for a in agents) >= 1
    sizes = {e["world_size"] for a in agents for e in a.events("rendezvous.completed")}
    assert sizes == {2}  # static: the world never changes size


def test_log_dir_and_tee_give_torchruns_per_rank_files(tmp_path, worker_env, agents):
    logs = tmp_path / "logs"
    argv = ["--nproc-per-node", "2", "--log-dir", str(logs), "--tee", "3", PROTO, "--steps", "2"]
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(150) == 0, agent.stderr_file.read_text()[-2000:]
    files = sorted(p.relative_to(logs).parts[-2:] for p in logs.rglob("*.log"))
    assert ("0", "stderr.log") in files and ("1", "stdout.log") in files
