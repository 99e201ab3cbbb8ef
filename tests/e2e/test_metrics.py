"""A real supervisor with --metrics-port on 127.0.0.1: /metrics and /health while it runs.

Two workers of a TrainingSession script (metrics_worker.py) on one node; the test scrapes
while the job trains (polling with a deadline) and checks what ops would alert on.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.workers.harness import HERE, env_with, free_port, start_agent, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORKER = str(HERE / "metrics_worker.py")


def _get(port: int, path: str) -> tuple[int, bytes] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:  # not listening yet, or already gone
        return None


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    reply = _get(port, "/metrics")
    if reply is None or reply[0] != 200:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply[1].decode())
        for s in family.samples
    }


def _health(port: int) -> tuple[int, dict] | None:
    reply = _get(port, "/health")
    return None if reply is None else (reply[0], json.loads(reply[1]))


def _start(tmp_path: Path, agents: list, metrics_port: int, flags: list[str], args: list[str]):
    argv = [
        "--nproc-per-node",
        "2",
        "--metrics-port",
        str(metrics_port),
        "--snapshot-dir",
        str(tmp_path / "snap"),
        "--snapshot-every",
        "3",
        *flags,
        WORKER,
        *args,
    ]
    agent = start_agent(tmp_path, "node0", argv, env_with({}), port=free_port())
    agents.append(agent)
    return agent


def _alive(agent) -> None:
    if agent.proc.poll() is not None:
        raise AssertionError(f"the supervisor exited {agent.proc.returncode} before the check")


def test_metrics_show_world_size_steps_and_snapshots_while_the_job_runs(tmp_path, agents):
    port = free_port()
    agent = _start(tmp_path, agents, port, [], ["--steps", "40", "--step-time", "0.1"])

    def trained_and_snapshotted():
        _alive(agent)
        m = _scrape(port)
        ok = (
            m.get(("elastic_train_world_size", ())) == 2
            and m.get(("elastic_train_steps_total", ()), 0) >= 6
            and m.get(("elastic_train_last_snapshot_step", ()), 0) >= 3
            and m.get(("elastic_train_snapshot_stall_seconds_count", ()), 0) >= 1
        )
        return m if ok else None

    seen = wait_for(trained_and_snapshotted, 120, "metrics of a training job", step=0.2)
    assert ("elastic_train_last_snapshot_age_seconds", ()) in seen
    assert seen[("elastic_train_restarts_total", (("cause", "failure"),))] == 0
    health = _health(port)
    assert health is not None and health[0] == 200, health
    assert agent.wait(120) == 0
    progress = agent.events("train.progress")
    assert progress and isinstance(progress[0]["loss"], float)  # the script's log_metrics


def test_health_is_503_while_a_worker_hangs_and_200_once_it_trains_again(tmp_path, agents):
    port = free_port()
    marker = tmp_path / "hung-once"
    agent = _start(
        tmp_path,
        agents,
        port,
        ["--hang-timeout", "3", "--max-restarts", "1"],
        ["--steps", "30", "--step-time", "0.05", "--hang-at", "5", "--marker", str(marker)],
    )

    def unhealthy():
        _alive(agent)
        health = _health(port)
        return health if health is not None and health[0] == 503 else None

    _code, body = wait_for(unhealthy, 120, "/health 503 for the hung worker", step=0.1)
    assert body["phase"] == "hung" and "no progress" in body["reason"], body
    wait_for(
        lambda: (_health(port) or (0, {}))[1].get("phase") == "running",
        120,
        "/health 200 again after the restart",
    )
    assert _scrape(port)[("elastic_train_restarts_total", (("cause", "hang"),))] == 1
    assert agent.wait(120) == 0


def test_a_taken_metrics_port_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "elastic_trainer",
                "--standalone",
                "--metrics-port",
                str(port),
                "--log-format",
                "json",
                WORKER,
            ],
            env=env_with({}),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "elastic-train: error:" in line]
    assert errors == [
        f"elastic-train: error: --metrics-port={port} on --metrics-host=127.0.0.1 cannot be "
        "served (Address already in use): pick a free port, or leave --metrics-port out"
    ]
