"""Another local user writes into a running job's rendezvous store (its loopback port is open
to every local process): no code runs, no forged member is counted, the job goes on and
says so (``store.tampered``)."""

from __future__ import annotations

import base64
import json
import pickle
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from tests import c10d_wire
from tests.e2e.workers.harness import (
    FAST_RDZV,
    HERE,
    env_with,
    free_port,
    listening,
    spawn_agent,
    wait_for,
)
from tests.local_users import as_user, other_user

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GATE = str(HERE / "gated_ddp.py")
JOB = "tampered"


class _RunsCode:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os

        return (os.system, (self.command,))


def _forged_state() -> bytes:
    """A state in our own format naming a member that does not exist, signed with a key the
    attacker made up (they cannot have the job's)."""
    body = {
        "format": 1, "key": "attacker", "round": 7, "complete": True, "deadline": None,
        "closed": False, "participants": [["evil", 1, 0, 0]], "wait_list": [],
        "redundancy_list": [], "last_heartbeats": [["evil", 1, 0, 2**62]],
    }  # fmt: skip
    return b"et1." + b"0" * 64 + b"." + json.dumps(body).encode()


def test_another_user_writing_the_store_runs_nothing_and_forges_no_member(
    tmp_path, worker_env, agents
) -> None:
    user = other_user()
    port = free_port()
    env = env_with(worker_env)
    tmp_path.chmod(0o755)  # the sentinel's folder: only the job's user could create it
    for node in ("n0", "n1"):
        argv = [
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", FAST_RDZV, "--nnodes", "2",
            "--nproc-per-node", "1", GATE, str(tmp_path), "--no-failure",
        ]  # fmt: skip
        agents.append(spawn_agent(tmp_path, node, argv, env, job_id=JOB))
    wait_for(lambda: (tmp_path / "waiting").exists() or any(a.proc.poll() for a in agents),
             180, "the workers to reach the gate")  # fmt: skip
    sentinel = tmp_path / "code-ran"
    key = f"torch.rendezvous.{JOB}"
    watcher = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    plants = {
        # what torch's c10d backend stored, and every agent unpickled at each heartbeat
        "code": base64.b64encode(pickle.dumps(_RunsCode(f"touch {sentinel}"))),
        "member": _forged_state(),
    }
    for what, value in plants.items():
        attack = f"{c10d_wire.source()}\nClient('127.0.0.1', {port}).set({key!r}, {value!r})"
        done = as_user(user, attack)
        assert done.returncode == 0, done.stderr
        # an agent read it at its next heartbeat, refused it, and wrote the last good state
        wait_for(lambda v=value: bytes(watcher.get(key)) != v, 60, f"the {what} plant replaced")
    assert any(a.events("store.tampered") for a in agents)
    (tmp_path / "go").touch()
    assert [a.wait(120) for a in agents] == [0, 0], agents[0].stderr_file.read_text()[-2000:]
    assert not sentinel.exists()
    for agent in agents:
        sizes = {e["world_size"] for e in agent.events("rendezvous.completed")}
        assert sizes == {2}
        assert not agent.events("worker.failed")


def test_a_node_given_another_secret_is_one_line_and_exit_2(tmp_path, worker_env, agents) -> None:
    port = free_port()
    env = env_with(worker_env)
    secrets = []
    for name in ("a", "b"):
        path = tmp_path / f"secret-{name}"
        path.write_text(name * 32)
        path.chmod(0o600)
        secrets.append(path)
    for node, path in zip(("n0", "n1"), secrets, strict=True):
        argv = [
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", FAST_RDZV, "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-secret-file", str(path), GATE, str(tmp_path),
            "--no-failure",
        ]  # fmt: skip
        agents.append(spawn_agent(tmp_path, node, argv, env, job_id=JOB))
        if node == "n0":  # its store is up, its state written with its secret
            wait_for(lambda: listening(port), 60, "n0's store")
    assert agents[1].wait(60) == 2
    (finished,) = agents[1].events("job.finished")
    assert finished["status"] == "config_error"
    said = [json.dumps(e) for e in agents[1].events() if e["level"] in ("error", "warning")]
    assert any("signed with another secret" in line for line in said), said
    assert agents[0].proc.poll() is None  # the job's own node goes on waiting for its peer
