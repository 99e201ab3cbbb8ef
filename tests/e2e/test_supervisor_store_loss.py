"""README "When the rendezvous store host dies", end to end on 127.0.0.1.

A standalone ``elastic-train store`` serves two agents started with ``is_host=false``. Once
both nodes train at world size 2 the store process is SIGKILLed: the workers must keep
training (their gloo group does not use the rendezvous store) and each agent must say so with
``store.unreachable``. The next membership event (one node's whole process tree SIGKILLed)
cannot be handled without a store: the survivor must report ``store.unreachable`` again, stop
its workers, exit 1 with ``job.finished`` status ``store_lost`` and leave no process behind.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.e2e.workers.harness import (
    FAST_RDZV,
    PROTO,
    Agent,
    descendants_alive,
    env_with,
    read_audit,
    start_agent,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]

STORE_FIELDS = ("endpoint", "error", "consequence")


class Store:
    """One ``elastic-train store`` subprocess on a free port of 127.0.0.1."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.ready, self.log = tmp / "store.ready", tmp / "store.log"
        cmd = [sys.executable, "-m", "elastic_trainer", "store", "--host", "127.0.0.1"]
        cmd += ["--port", "0", "--ready-file", str(self.ready), "--log-format", "json"]
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        self.endpoint: str = wait_for(self._endpoint, 60, "the store's ready file")
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    def _endpoint(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"store exited with {self.proc.returncode}, see {self.log}")
        return self.ready.read_text().strip() if self.ready.exists() else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def store(tmp_path, worker_env):
    server = Store(tmp_path, env_with(worker_env))
    yield server
    server.kill()


def _steps_at(audit: Path, world_size: int) -> int:
    """The highest step completed by a rank at ``world_size`` (0 when none)."""
    return max((s for s, _, w in read_audit(audit) if w == world_size), default=0)


def _store_event(agent: Agent, consequence_has: str) -> dict | None:
    return next(
        (
            e
            for e in agent.events("store.unreachable")
            if consequence_has in str(e.get("consequence", ""))
        ),
        None,
    )


def test_store_loss_keeps_training_until_the_next_membership_event(
    tmp_path, worker_env, agents, store
):
    audit = tmp_path / "audit"
    env = env_with(worker_env)
    argv = ["--min-nodes", "1", "--max-nodes", "2", PROTO, "--steps", "5000"]
    argv += ["--step-time", "0.1", "--audit", str(audit)]
    conf = FAST_RDZV + ",is_host=false"
    a = start_agent(tmp_path, "a", argv, env, port=store.port, rdzv_conf=conf)
    b = start_agent(tmp_path, "b", argv, env, port=store.port, rdzv_conf=conf)
    agents.extend([a, b])
    wait_for(lambda: _steps_at(audit, 2) >= 5, 120, "steps at world size 2")

    store.kill()
    killed_at = _steps_at(audit, 2)
    # Each agent notices at its next scale-up poll and says running workers continue.
    for agent in (a, b):
        event = wait_for(
            lambda agent=agent: _store_event(agent, "running workers continue"),
            30,
            f"{agent.name}: store.unreachable while training",
        )
        assert all(event.get(f) for f in STORE_FIELDS), event
        assert event["endpoint"] == f"127.0.0.1:{store.port}"
    noticed_at = _steps_at(audit, 2)
    wait_for(lambda: _steps_at(audit, 2) >= noticed_at + 10, 30, "steps after the store died")
    assert _steps_at(audit, 2) >= killed_at + 10
    assert a.proc.poll() is None and b.proc.poll() is None
    assert len(a.events("store.unreachable")) == 1  # once, not once per poll

    a.remember_tree()
    survivors_tree = [p.pid for p in a.tree if p.pid != a.proc.pid]
    assert survivors_tree, "agent a should have worker processes"
    b.kill_tree()
    assert a.wait(90) == 1
    lost = a.events("store.unreachable")
    assert len(lost) >= 2, lost  # the one while training + the one when re-forming failed
    final = lost[-1]
    assert all(final.get(f) for f in STORE_FIELDS), final
    assert "running workers continue" not in final["consequence"]
    # It could not re-form: no second round, no step at world size 1.
    assert len(a.events("rendezvous.completed")) == 1
    assert _steps_at(audit, 1) == 0
    finished = a.events("job.finished")[-1]
    assert finished["status"] == "store_lost" and finished["exit_code"] == 1
    # The survivor stopped its workers: nothing it started outlives it.
    wait_for(lambda: not descendants_alive(survivors_tree), 15, "a's workers to be gone")
    # ... and no worker of either node is left anywhere (they all name the audit file).
    assert not _processes_naming(str(audit))


def _processes_naming(needle: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = proc.info.get("cmdline") or []
        if proc.info.get("status") != psutil.STATUS_ZOMBIE and any(needle in c for c in cmdline):
            found.append(proc.info["pid"])
    return found
