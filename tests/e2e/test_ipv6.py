"""IPv6 literals end to end, on ::1 only: rendezvous endpoint, node addresses, the workers'
MASTER_ADDR, the metrics server and `elastic-train status`, through a worker restart."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request

import pytest

from tests.e2e.workers.harness import FAST_RDZV, HERE, env_with, spawn_agent, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GATED = str(HERE / "gated_ddp.py")


def _free_v6_port() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


def _ipv6_loopback() -> bool:
    try:
        _free_v6_port()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_two_agents_on_ipv6_loopback_restart_and_finish(tmp_path, worker_env, agents):
    port, metrics_port = _free_v6_port(), _free_v6_port()
    env = env_with(worker_env)
    for node in ("n0", "n1"):
        extra = (
            ["--metrics-host", "::1", "--metrics-port", str(metrics_port)] if node == "n0" else []
        )
        argv = [
            "--rdzv-endpoint", f"[::1]:{port}", "--local-addr", "::1", "--rdzv-conf", FAST_RDZV,
            "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2", *extra,
            GATED, str(tmp_path),
        ]  # fmt: skip
        agents.append(spawn_agent(tmp_path, node, argv, env, job_id="v6"))
    wait_for(lambda: (tmp_path / "waiting").exists() or any(a.proc.poll() for a in agents),
             180, "the restarted workers to reach the gate")  # fmt: skip
    try:
        seen = json.loads((tmp_path / "env.json").read_text())
        assert (seen["MASTER_ADDR"], seen["WORLD_SIZE"]) == ("::1", "2")
        with urllib.request.urlopen(f"http://[::1]:{metrics_port}/metrics", timeout=10) as r:
            assert b"elastic_train_world_size 2.0" in r.read()
        status = subprocess.run(
            [sys.executable, "-m", "elastic_trainer", "status", "--rdzv-endpoint",
             f"[::1]:{port}", "--job-id", "v6", "--json"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        nodes = json.loads(status.stdout)["nodes"]
        assert sorted((n["addr"], n["group_rank"]) for n in nodes) == [("::1", 0), ("::1", 1)]
    finally:
        (tmp_path / "go").touch()
    assert [a.wait(120) for a in agents] == [0, 0], agents[0].stderr_file.read_text()[-2000:]
    assert sum(len(a.events("worker.failed")) for a in agents) == 1
    shown = {e["rdzv_endpoint"] for a in agents for e in a.events("supervisor.started")}
    assert shown == {f"[::1]:{port}"}  # what --rdzv-endpoint and `status` take back
    assert all(len(a.events("workers.started")) == 2 for a in agents)  # both restarted
    nodes = {e["node"] for a in agents for e in a.events("job.finished")}
    assert nodes == {"n0", "n1"}
