"""The node hosting the rendezvous store is lost, twice, and the job goes on (issue 23).

Three agents on 127.0.0.1 = three nodes; the first started hosts the store. Its whole process
tree is SIGKILLed: the two survivors agree on a new host among themselves, it serves the store
on its own address and the rendezvous port, both re-form on it at world size 2. Then the new
host is SIGKILLed too: the last survivor hosts the store itself and trains alone. A node
started afterwards with the job's original endpoint finds the store there (on one machine the
failed-over store serves the same address) and the group grows again. Every sample of every
epoch is trained exactly once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from elastic_trainer.worker.audit import check_exactly_once, effective_records
from tests.e2e.workers.harness import (
    HERE,
    Agent,
    audit_records,
    env_with,
    free_port,
    listening,
    start_agent,
    steps_at,
    wait_for,
    wait_new,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKER = str(HERE / "sup_session_worker.py")
SAMPLES, GLOBAL_BATCH, EPOCHS = 96, 12, 12
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH  # 96: world sizes 1, 2 and 3 divide the batch


def _argv(snap: Path, audit: Path, hold: Path) -> list[str]:
    return [
        "--min-nodes", "1", "--max-nodes", "3", "--nproc-per-node", "1",
        "--snapshot-dir", str(snap), "--snapshot-every", "8",
        WORKER, "--audit-dir", str(audit), "--samples", str(SAMPLES),
        "--global-batch", str(GLOBAL_BATCH), "--epochs", str(EPOCHS),
        "--step-time", "0.1", "--hold-file", str(hold),
    ]  # fmt: skip


def _moved_to(agents: list[Agent], since: dict[str, int], timeout: float) -> tuple[Agent, dict]:
    """Every one of ``agents`` says ``store.moved`` once more, all naming the same new host,
    which exactly one of them is: (that agent, its event)."""
    events = {a.name: wait_new(a, "store.moved", since[a.name], timeout) for a in agents}
    assert len({e["new_host"] for e in events.values()}) == 1, events
    hosts = [a for a in agents if events[a.name]["hosted_here"]]
    assert len(hosts) == 1, events
    return hosts[0], events[hosts[0].name]


def test_the_store_host_is_lost_twice_and_the_job_finishes(tmp_path, worker_env, agents):
    snap, audit, hold = tmp_path / "snap", tmp_path / "audit", tmp_path / "hold"
    port, env = free_port(), env_with(worker_env)
    hold.touch()  # a lone node's steps slow down: the job cannot end before the others join
    argv = _argv(snap, audit, hold)
    a = start_agent(tmp_path, "a", argv, env, port=port)
    agents.append(a)
    wait_for(lambda: listening(port), 60, "a to host the store")
    b = start_agent(tmp_path, "b", argv, env, port=port)
    c = start_agent(tmp_path, "c", argv, env, port=port)
    agents.extend([b, c])
    a.wait_event("rendezvous.completed", 120, lambda e: e["world_size"] == 3)
    wait_for(lambda: len(steps_at(audit, 3)) >= 3, 90, "steps at world size 3")
    assert a.events("rendezvous.completed")[-1]["store_host"] == "a"

    survivors = [b, c]
    since = {x.name: len(x.events("store.moved")) for x in survivors}
    rounds = {x.name: len(x.events("rendezvous.completed")) for x in survivors}
    a.kill_tree()
    assert a.proc.returncode == -signal.SIGKILL
    host, moved = _moved_to(survivors, since, 60)
    assert moved["endpoint"] == f"127.0.0.1:{port}" and moved["why"] == "lost"
    assert moved["old_host"] == "a"  # its --node name; the member name: address and pid
    assert moved["old_member"].endswith(f":{a.proc.pid}")
    for x in survivors:
        formed = wait_new(x, "rendezvous.completed", rounds[x.name], 60)
        assert formed["world_size"] == 2 and formed["store_host"] == host.name
    wait_for(lambda: len(steps_at(audit, 2)) >= 3, 90, "steps at world size 2")
    recovered = host.wait_event("recovery.completed", 30, lambda e: e["world_size_after"] == 2)
    assert recovered["steps_lost"] <= 1

    # the failed-over store survives a second failover
    last = c if host is b else b
    since = {last.name: len(last.events("store.moved"))}
    rounds = len(last.events("rendezvous.completed"))
    old_pid = host.proc.pid
    host.kill_tree()
    again, moved = _moved_to([last], since, 60)
    assert again is last and moved["endpoint"] == f"127.0.0.1:{port}"
    assert moved["old_host"] == host.name and moved["old_member"].endswith(f":{old_pid}")
    assert wait_new(last, "rendezvous.completed", rounds, 60)["world_size"] == 1
    wait_for(lambda: len(steps_at(audit, 1)) >= 2, 90, "steps at world size 1")

    # a node started now, with the job's original endpoint, finds the store and joins
    changes = len(last.events("membership.changed"))
    d = start_agent(tmp_path, "d", argv, env, port=port)
    agents.append(d)
    grow = wait_new(last, "membership.changed", changes, 120, lambda e: e["new_world_size"] == 2)
    assert grow["reason"] == "node_joined"
    hold.unlink()
    assert last.wait(180) == 0 and d.wait(60) == 0
    assert last.events("job.finished")[-1]["status"] == "succeeded"

    records = audit_records(audit)
    assert check_exactly_once(records, SAMPLES, complete_epochs=range(EPOCHS)) == []
    kept = effective_records(records)
    assert max(r.step for r in kept) == STEPS
    sizes = [r.world_size for r in kept]
    assert {3, 2, 1} <= set(sizes) and sizes[-1] == 2


def test_a_preempted_store_host_hands_the_store_over_and_no_step_is_lost(
    tmp_path, worker_env, agents
):
    snap, audit, hold = tmp_path / "snap", tmp_path / "audit", tmp_path / "hold"
    port, env = free_port(), env_with(worker_env)
    hold.touch()
    argv = _argv(snap, audit, hold)
    argv[argv.index("--max-nodes") + 1] = "2"
    a = start_agent(tmp_path, "a", argv, env, port=port)
    agents.append(a)
    wait_for(lambda: listening(port), 60, "a to host the store")
    b = start_agent(tmp_path, "b", argv, env, port=port)
    agents.append(b)
    a.wait_event("rendezvous.completed", 120, lambda e: e["world_size"] == 2)
    wait_for(lambda: len(steps_at(audit, 2)) >= 3, 90, "steps at world size 2")

    a.proc.send_signal(signal.SIGTERM)
    moved = b.wait_event("store.moved", 60)
    assert moved["why"] == "leaving" and moved["hosted_here"]
    assert moved["old_host"] == "a" and moved["old_member"].endswith(f":{a.proc.pid}")
    assert moved["endpoint"] == f"127.0.0.1:{port}"
    assert a.wait(60) == 143 and a.events("job.finished")[-1]["status"] == "preempted"
    formed = b.wait_event("rendezvous.completed", 60, lambda e: e["world_size"] == 1)
    assert formed["store_host"] == "b"
    recovered = b.wait_event("recovery.completed", 60, lambda e: e["world_size_after"] == 1)
    assert recovered["steps_lost"] == 0
    # the store moved before b re-formed: b never reported it unreachable
    assert b.events("store.unreachable") == []
    hold.unlink()
    assert b.wait(180) == 0
    records = audit_records(audit)
    assert check_exactly_once(records, SAMPLES, complete_epochs=range(EPOCHS)) == []
    assert max(r.step for r in effective_records(records)) == STEPS
