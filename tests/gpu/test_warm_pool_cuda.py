"""The warm pool with a script that uses CUDA: the pool never initialises CUDA (a forked
child could not use it), and each forked worker gets cuda:<LOCAL_RANK>."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.workers.harness import env_with, free_port, start_agent
from tests.gpu.conftest import gpu_count

pytestmark = [pytest.mark.timeout(240)]

PROBE = str(Path(__file__).parent / "workers" / "cuda_probe.py")


def test_workers_forked_from_the_warm_pool_get_their_own_gpu(
    tmp_path: Path, worker_env: dict[str, str], agents
) -> None:
    nproc = min(gpu_count(), 2)  # NCCL: one rank per GPU
    argv = ["--nproc-per-node", str(nproc), "--warm-workers", "--max-restarts", "1",
            PROBE, str(tmp_path)]  # fmt: skip
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(200) == 0, agent.stderr_file.read_text()[-3000:]
    assert agent.events("warm_pool.unavailable") == []
    assert agent.events("warm_pool.ready"), "the pool never became ready"
    started = agent.events("workers.started")
    assert [(e["restart_count"], e["warm"]) for e in started] == [(0, True), (1, True)]
    for restart in (0, 1):
        for local_rank in range(nproc):
            probe = json.loads((tmp_path / f"probe-{restart}-{local_rank}.json").read_text())
            assert probe["env_local_rank"] == local_rank
            assert probe["device"] == f"cuda:{local_rank}" and probe["current"] == local_rank
            assert probe["cuda_before"] is False  # not initialised in the pool
            assert (probe["backend"], probe["sum"]) == ("nccl", float(nproc))
