"""torchrun command lines, unchanged but for the program name, on loopback."""

from __future__ import annotations

import json

import pytest
from torch.distributed import TCPStore

from elastic_trainer.supervisor.processes.workerenv import MALLOC_TUNABLES
from tests.e2e.workers.harness import (
    HERE,
    PLAIN_DDP,
    PROTO,
    env_with,
    free_port,
    start_agent,
    wait_for,
)

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


def test_static_mode_group_rank_is_the_node_rank_even_when_node_1_joins_first(
    tmp_path, worker_env, agents
):
    """torchrun's static rendezvous: node --node-rank N is group rank N, its workers' global
    ranks N*nproc + local_rank, through a restart too. Node 1 starts first and its address
    sorts first (torch's c10d handler would number it 0)."""
    port, out = free_port(), tmp_path / "ranks"
    out.mkdir()
    for rank, addr in ((1, "127.0.0.1"), (0, "127.0.0.2")):
        argv = [
            "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--local-addr", addr, "--nproc-per-node", "2",
            "--max-restarts", "2", str(HERE / "static_ranks.py"), str(out),
        ]  # fmt: skip
        env = env_with(worker_env, NODE_TAG=f"n{rank}")
        env.pop("GLIBC_TUNABLES", None)
        if rank == 1:
            env["GLIBC_TUNABLES"] = ""  # an operator's own setting (here: glibc's defaults)
        agents.append(start_agent(tmp_path, f"n{rank}", argv, env, port=0, endpoint=False))
        if rank == 1:
            wait_for(lambda: agents[0].events("supervisor.started"), 60, "node 1 started")
    assert [a.wait(200) for a in agents] == [0, 0], agents[0].stderr_file.read_text()[-2000:]
    assert sum(len(a.events("worker.failed")) for a in agents) >= 1  # the restart happened
    for node in (0, 1):
        for local in (0, 1):
            seen = json.loads((out / f"n{node}-{local}.json").read_text())
            assert seen["GROUP_RANK"] == str(node)
            assert seen["RANK"] == str(seen["pg_rank"]) == str(node * 2 + local)
            assert seen["all_ranks_once"] and seen["WORLD_SIZE"] == "4"
            assert seen["GLIBC_TUNABLES"] == ("" if node == 1 else MALLOC_TUNABLES)


def test_two_nodes_given_one_node_rank_exit_2_naming_it_instead_of_hanging(
    tmp_path, worker_env, agents
):
    """--node-rank 0, 1, 1 of --nnodes 3 (torchrun hangs: two nodes share group rank 1): the
    round closes, every node sees the duplicate and exits 2 with one line naming it. Three
    nodes because node rank 0 hosts the store: two nodes at rank 0 on one host collide on its
    port first, and two at rank 1 have no store at all."""
    port = free_port()
    for name, rank in (("n0", 0), ("n1", 1), ("n1b", 1)):
        argv = [
            "--nnodes", "3", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--nproc-per-node", "1", PROTO, "--steps", "2",
        ]  # fmt: skip
        agents.append(start_agent(tmp_path, name, argv, env_with(worker_env), port=0,
                                  endpoint=False))  # fmt: skip
    codes = [a.wait(150) for a in agents]  # the bug was a hang: a generous bound
    assert codes == [2, 2, 2], agents[0].stderr_file.read_text()[-2000:]
    for agent in agents:
        (finished,) = agent.events("job.finished")
        assert finished["status"] == "config_error"
        assert finished["error"].startswith("--node-rank=1 is given to 2 nodes (")
        assert "give each of the 3 nodes its own --node-rank" in finished["error"]
        assert not agent.events("workers.started")


def test_a_second_node_rank_0_on_the_store_host_is_told_so(tmp_path, worker_env, agents):
    """Node rank 0 hosts the store: a second --node-rank 0 on that host finds its port taken
    (here by a store the test holds) and exits 2 saying what probably happened."""
    port = free_port()
    held = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    argv = [
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
        "--master-port", str(port), "--nproc-per-node", "1", PROTO, "--steps", "2",
    ]  # fmt: skip
    agents.append(start_agent(tmp_path, "n0", argv, env_with(worker_env), port=0,
                              endpoint=False))  # fmt: skip
    assert agents[0].wait(120) == 2
    (finished,) = agents[0].events("job.finished")
    assert "cannot host the store here" in finished["error"]
    assert "if another node was also given --node-rank 0" in finished["error"]
    del held


def test_log_dir_and_tee_give_torchruns_per_rank_files(tmp_path, worker_env, agents):
    logs = tmp_path / "logs"
    argv = ["--nproc-per-node", "2", "--log-dir", str(logs), "--tee", "3", PROTO, "--steps", "2"]
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(150) == 0, agent.stderr_file.read_text()[-2000:]
    files = sorted(p.relative_to(logs).parts[-2:] for p in logs.rglob("*.log"))
    assert ("0", "stderr.log") in files and ("1", "stdout.log") in files
