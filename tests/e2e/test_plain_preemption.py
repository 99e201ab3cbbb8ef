"""A SIGTERM preemption of one node of an unmodified torchrun script: the leaving node says
goodbye before its workers stop, so the survivor's worker dying in gloo ("Connection reset by
peer") is a peer's leaving, not a failure: no worker.failed, nothing charged, no error-level
line, its traceback off the console, and a re-form that does not wait for the leaver."""

from __future__ import annotations

import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.e2e.workers.harness import HERE, env_with, free_port, listening, start_agent, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SCRIPT = str(HERE / "plain_steps.py")


def _at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _worlds(folder: Path) -> list[int]:
    path = folder / "steps-0"
    return [int(line.split()[1]) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_preempted_node_of_a_plain_script_is_a_membership_change(
    tmp_path, worker_env, agents
) -> None:
    port, out = free_port(), tmp_path / "out"
    out.mkdir()
    env = env_with(worker_env)
    argv = ["--nnodes", "1:2", "--nproc-per-node", "1", SCRIPT, str(out), "400", "0.05"]
    a = start_agent(tmp_path, "a", argv, env, port=port)
    agents.append(a)
    wait_for(lambda: listening(port), 60, "a to host the store")
    b = start_agent(tmp_path, "b", argv, env, port=port)
    agents.append(b)
    wait_for(lambda: _worlds(out).count(2) >= 5, 120, "steps at world size 2")
    preempted_at = time.time()
    b.proc.send_signal(signal.SIGTERM)  # the spot notice: to the supervisor, as systemd does
    assert b.wait(60) == 143
    shrink = a.wait_event("membership.changed", 60, lambda e: e["new_world_size"] == 1)
    assert shrink["reason"] == "peer_preempted"
    wait_for(lambda: _worlds(out)[-1:] == [1], 60, "training again at world size 1")
    assert not a.events("worker.failed") and not a.events("peer.lost")
    # b may have joined a's running job (a loaded machine starts it late): one restart more
    (restarting,) = [e for e in a.events("group.restarting") if _at(e) >= preempted_at]
    assert restarting["reason"] == "membership"  # not "failure": nothing charged
    errors = [e for e in a.events() if e["level"] in ("error", "critical")]
    assert errors == []
    shown = [e for e in a.events("output.stderr") if e["level"] != "debug"]
    assert not [e for e in shown if "Traceback" in e["text"] or "reset by peer" in e["text"]]
    (finished,) = b.events("job.finished")
    assert finished["status"] == "preempted"
