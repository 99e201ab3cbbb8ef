"""Every listener of a loopback job's process trees binds loopback only: the rendezvous store,
presence, metrics, the workers' process-group store (torch's rank 0 bound every interface)
and whatever gloo opens, through a worker restart."""

from __future__ import annotations

import ipaddress
import json

import psutil
import pytest

from tests.e2e.workers.harness import FAST_RDZV, HERE, env_with, free_port, spawn_agent, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GATED = str(HERE / "gated_ddp.py")


def listeners(root_pids: list[int]) -> dict[tuple[str, int], str]:
    """(address, port) -> the command of the process listening there, over the whole trees."""
    out = {}
    for pid in root_pids:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                conns = proc.net_connections(kind="inet")
                name = " ".join(proc.cmdline()[:4])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for conn in conns:
                if conn.status == psutil.CONN_LISTEN:
                    out[(conn.laddr.ip, conn.laddr.port)] = name
    return out


def test_every_listener_of_a_loopback_job_binds_loopback(tmp_path, worker_env, agents) -> None:
    port, metrics_port = free_port(), free_port()
    env = env_with(worker_env)
    for node in ("n0", "n1"):
        extra = ["--metrics-port", str(metrics_port)] if node == "n0" else []
        argv = [
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", FAST_RDZV, "--nnodes", "2",
            "--nproc-per-node", "1", "--max-restarts", "2", *extra, GATED, str(tmp_path),
        ]  # fmt: skip
        agents.append(spawn_agent(tmp_path, node, argv, env, job_id="listeners"))
    wait_for(lambda: (tmp_path / "waiting").exists() or any(a.proc.poll() for a in agents),
             180, "the restarted workers to reach the gate")  # fmt: skip
    try:
        seen = json.loads((tmp_path / "env.json").read_text())
        found = listeners([a.proc.pid for a in agents])
        ports = {p for _, p in found}
        # the test sees what it claims to: the store, the metrics and the workers' store
        assert {port, metrics_port, int(seen["MASTER_PORT"])} <= ports, found
        beyond = {k: v for k, v in found.items() if not ipaddress.ip_address(k[0]).is_loopback}
        assert beyond == {}, f"listening beyond loopback: {beyond}"
    finally:
        (tmp_path / "go").touch()
    assert [a.wait(120) for a in agents] == [0, 0], agents[0].stderr_file.read_text()[-2000:]
