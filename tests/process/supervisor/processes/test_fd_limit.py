"""A running supervisor against a flood of idle connections from another process: at a soft
open-file limit of 1,024, 1,000 connections held to each of its ports (the rendezvous store,
torch's, holds every one it accepts) killed it with ``EMFILE`` and a traceback, and no
``job.finished``. It raises its soft limit to the hard one at start (``fd_limit.py``)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.e2e.workers.harness import env_with, free_port, spawn_agent, wait_for

pytestmark = pytest.mark.timeout(120)

SOFT, HARD = 1024, 4096
FLOOD = 1000  # per port

# The job: one worker that waits at a gate while the test floods the supervisor's ports.
GATE = """
import os, sys, time
folder = sys.argv[1]
open(os.path.join(folder, "waiting"), "w").close()
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.05)  # polls a file the test writes: no timing assumed
"""

# Holds FLOOD idle connections to each port in argv until its stdin closes; says how many.
HOLD = """
import json, resource, socket, sys
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held, failed = [], 0
for port in map(int, sys.argv[2:]):
    for _ in range(int(sys.argv[1])):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            failed += 1
print(json.dumps({"held": len(held), "failed": failed}), flush=True)
sys.stdin.read()
"""


def listening_ports(pid: int) -> list[int]:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_of_idle_connections_at_a_soft_limit_of_1024_does_not_end_the_job(
    tmp_path: Path, worker_env
) -> None:
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit(1)")
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2 * HARD:
        pytest.skip(f"needs a hard open-file limit of {2 * HARD} here (for the flood)")
    gate = tmp_path / "gate.py"
    gate.write_text(GATE)
    argv = [
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nnodes", "1",
        "--nproc-per-node", "1", str(gate), str(tmp_path),
    ]  # fmt: skip
    agent = spawn_agent(
        tmp_path, "n0", argv, env_with(worker_env), job_id="fd-flood",
        wrap=["prlimit", f"--nofile={SOFT}:{HARD}"],
    )  # fmt: skip
    flood = None
    try:
        wait_for(lambda: (tmp_path / "waiting").exists() or agent.proc.poll() is not None,
                 60, "the worker at its gate")  # fmt: skip
        ports = listening_ports(agent.proc.pid)  # the store's and presence's
        assert len(ports) >= 2, ports
        flood = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(FLOOD), *map(str, ports)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert json.loads(flood.stdout.readline())["held"] == FLOOD * len(ports)  # type: ignore[union-attr]
        # what it has to survive: the soft limit it started with, reached (the store takes
        # connections from its backlog in its own time)
        wait_for(lambda: open_files(agent.proc.pid) >= SOFT - 8, 30, "the store holds the flood")
        (tmp_path / "go").touch()
        code = agent.wait(60)
    finally:
        (tmp_path / "go").touch()
        if flood is not None:
            flood.kill()
            flood.wait(10)
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)
    log = agent.stderr_file.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    (finished,) = agent.events("job.finished")
    assert finished["status"] == "succeeded"
