"""Several agents on 127.0.0.1 = several nodes: node loss, rejoin, graceful preemption."""

from __future__ import annotations

import signal

import pytest

from tests.e2e.workers.harness import (
    FAST_RDZV,
    PROTO,
    env_with,
    free_port,
    listening,
    read_audit,
    start_agent,
    start_store,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _world_sizes(audit):
    return [w for _, _, w in read_audit(audit)]


def test_node_loss_shrinks_then_a_new_node_grows_the_group(tmp_path, worker_env, agents):
    snap, audit = tmp_path / "snap", tmp_path / "audit"
    port, env = free_port(), env_with(worker_env)
    argv = [
        "--min-nodes",
        "1",
        "--max-nodes",
        "2",
        "--snapshot-dir",
        str(snap),
        "--snapshot-every",
        "5",
        PROTO,
        "--steps",
        "250",  # long enough for a third node to start after the fast recovery
        "--step-time",
        "0.1",
        "--audit",
        str(audit),
    ]
    a = start_agent(tmp_path, "a", argv, env, port=port)
    agents.append(a)
    wait_for(lambda: listening(port), 60, "a to host the store")  # b joins as a client
    b = start_agent(tmp_path, "b", argv, env, port=port)
    agents.append(b)
    wait_for(lambda: 2 in _world_sizes(audit), 90, "steps at world size 2")
    b.kill_tree()
    lost = a.wait_event("peer.lost", 10)  # its closed connection, not its heartbeats' expiry
    assert lost["how"] == "connection_closed" and lost["nodes"] == ["b"]  # its --node name
    assert len(lost["addresses"]) == 1 and lost["addresses"][0].endswith(f":{b.proc.pid}")
    wait_for(lambda: _world_sizes(audit)[-1:] == [1], 60, "steps at world size 1")
    shrink = a.wait_event("membership.changed", 10, lambda e: e["new_world_size"] == 1)
    assert shrink["old_world_size"] == 2
    assert shrink["reason"] == "node_lost"
    recovered = a.wait_event("recovery.completed", 10)
    assert recovered["cause"] == "node_lost" and recovered["world_size_after"] == 1
    assert recovered["downtime_s"] < 20
    c = start_agent(tmp_path, "c", argv, env, port=port)
    agents.append(c)
    grow = a.wait_event("membership.changed", 90, lambda e: e["timestamp"] > shrink["timestamp"])
    assert (grow["new_world_size"], grow["reason"]) == (2, "node_joined")
    assert a.wait(150) == 0 and c.wait(60) == 0
    finished = a.events("job.finished")[-1]
    assert finished["status"] == "succeeded" and finished["restarts"] == 0  # membership is free
    steps = read_audit(audit)
    assert max(s for s, _, _ in steps) == 250
    assert [w for s, _, w in steps if s == 250] == [2, 2]  # finished at world size 2 again
    # a script that is no TrainingSession is replaced after its old workers stopped, never
    # alongside them (it would train beside them and write its own snapshots)
    assert not any(e["alongside"] for e in a.events("workers.started"))
    assert not a.events("group.handed_over")


def test_sigterm_to_one_of_two_agents_stops_it_cleanly_and_the_other_continues(
    tmp_path, worker_env, agents
):
    snap, audit = tmp_path / "snap", tmp_path / "audit"
    port, env = free_port(), env_with(worker_env)
    store = start_store(port, env)
    try:
        argv = [
            "--min-nodes",
            "1",
            "--max-nodes",
            "2",
            "--grace-period",
            "10",
            "--snapshot-dir",
            str(snap),
            "--snapshot-every",
            "50",
            PROTO,
            "--steps",
            "80",
            "--step-time",
            "0.1",
            "--audit",
            str(audit),
        ]
        conf = FAST_RDZV + ",is_host=false"
        a = start_agent(tmp_path, "a", argv, env, port=port, rdzv_conf=conf)
        b = start_agent(tmp_path, "b", argv, env, port=port, rdzv_conf=conf)
        agents.extend([a, b])
        wait_for(lambda: sum(1 for w in _world_sizes(audit) if w == 2) >= 10, 90, "steps at 2")
        b.proc.send_signal(signal.SIGTERM)
        assert b.wait(15) == 143
        received = b.events("preemption.received")
        assert received and received[0]["signal"] == "SIGTERM" and received[0]["grace_s"] == 10
        assert b.events("job.finished")[-1]["status"] == "preempted"
        peer = a.wait_event("worker.failed", 15)
        assert peer["cause"] == "preempted" and peer["exit_code"] == 75
        shrink = a.wait_event("membership.changed", 30)
        assert (shrink["new_world_size"], shrink["reason"]) == (1, "peer_preempted")
        recovered = a.wait_event("recovery.completed", 30)
        assert recovered["steps_lost"] == 0  # the final snapshot was taken at the stop step
        assert a.wait(120) == 0
        assert a.events("job.finished")[-1]["restarts"] == 0
        assert max(s for s, _, _ in read_audit(audit)) == 80
        assert not a.events("peer.lost")  # b said goodbye: it left, it was not lost
    finally:
        store.kill()
        store.wait(10)


def test_a_frozen_node_is_dropped_by_its_silence_and_the_job_goes_on(tmp_path, worker_env, agents):
    """SIGSTOP sends no reset: the survivor's worker just blocks in its collective. The lost
    heartbeats make the survivor re-form at once (not after the collective timeout); thawed,
    the frozen node finds itself out and rejoins or exits cleanly."""
    audit = tmp_path / "audit"
    port, env = free_port(), env_with(worker_env)
    # 40 s: the survivor must re-form by the heartbeat check (peer.silent, ~5 s), never by this;
    # it bounds the thawed node when the survivor finishes (store gone) before it can rejoin
    argv = ["--min-nodes", "1", "--max-nodes", "2", "--collective-timeout", "40", PROTO,
            "--steps", "150", "--step-time", "0.1", "--audit", str(audit)]  # fmt: skip
    a = start_agent(tmp_path, "a", argv, env, port=port)
    agents.append(a)
    wait_for(lambda: listening(port), 60, "a to host the store")
    b = start_agent(tmp_path, "b", argv, env, port=port)
    agents.append(b)
    wait_for(lambda: 2 in _world_sizes(audit), 90, "steps at world size 2")
    b.signal_tree(signal.SIGSTOP)
    silent = a.wait_event("peer.silent", 30)
    assert silent["nodes"]
    shrink = a.wait_event("membership.changed", 30, lambda e: e["new_world_size"] == 1)
    assert shrink["reason"] == "node_lost"
    assert not a.events("peer.lost")  # frozen is alive: its connection stays open
    wait_for(lambda: _world_sizes(audit)[-1:] == [1], 60, "steps at world size 1")
    b.signal_tree(signal.SIGCONT)
    assert a.wait(180) == 0
    assert b.wait(120) in (0, 1)  # rejoined and finished, or out with the store: never hangs
    assert a.events("job.finished")[-1]["restarts"] == 0  # a lost node is free
    assert max(s for s, _, _ in read_audit(audit)) == 150
