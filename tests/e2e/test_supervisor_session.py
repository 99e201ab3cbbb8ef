"""Real agents running a real TrainingSession worker (DDP + ElasticSampler + audit log).

Node loss then regrowth, and a graceful SIGTERM of one node of two: the job finishes and the
sample audit log proves every epoch trained each sample exactly once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from elastic_trainer.worker.audit import check_exactly_once, effective_records, read_audit_log
from tests.e2e.workers.harness import (
    HERE,
    Agent,
    env_with,
    free_port,
    listening,
    start_agent,
    steps_at,
    wait_for,
    wait_new,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKER = str(HERE / "sup_session_worker.py")
SAMPLES, GLOBAL_BATCH, EPOCHS = 96, 8, 10
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH  # 120: every world size (1, 2) divides the batch


def _argv(
    snap: Path, audit: Path, snapshot_every: int, *extra: str, worker: tuple[str, ...] = ()
) -> list[str]:
    return [
        "--min-nodes",
        "1",
        "--max-nodes",
        "2",
        "--nproc-per-node",
        "1",
        *extra,
        "--snapshot-dir",
        str(snap),
        "--snapshot-every",
        str(snapshot_every),
        WORKER,
        "--audit-dir",
        str(audit),
        "--samples",
        str(SAMPLES),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--epochs",
        str(EPOCHS),
        "--step-time",
        "0.1",
        *worker,
    ]


def _events(agents: list[Agent], name: str) -> list[dict]:
    return [e for agent in agents for e in agent.events(name)]


def _assert_exactly_once(audit: Path) -> list:
    records = read_audit_log(str(audit))
    assert check_exactly_once(records, SAMPLES, complete_epochs=range(EPOCHS)) == []
    kept = effective_records(records)
    assert max(r.step for r in kept) == STEPS
    return kept


# (worker flags, where the survivor restores from, where the joining node does). Replicated
# (DDP) state: the survivor from its node's own copy, the joiner receives it over the group.
# Sharded (FSDP2) state: the survivor from its own shards and the lost node's mirrored ones,
# rebuilt into a storage snapshot (worker.memory.mirror); the joiner the same way: the running
# group stops to admit it without a storage save (every rank holds that step's in-memory copy,
# session._resumes_from_memory), and the changed world rebuilds a snapshot from those copies.
STATE_KINDS = {"ddp": ((), "memory", "mirror"), "fsdp": (("--fsdp",), "mirror", "mirror")}


@pytest.mark.parametrize("kind", sorted(STATE_KINDS))
def test_node_loss_then_regrowth_trains_every_sample_exactly_once(
    tmp_path, worker_env, agents, kind
):
    snap, audit = tmp_path / "snap", tmp_path / "audit"
    port, env = free_port(), env_with(worker_env)
    worker, survivor_source, joiner_source = STATE_KINDS[kind]
    # A lone node's steps slow down while this file exists: however loaded the machine, the
    # job cannot end before b has joined (a may form a first round alone) or c has.
    hold = tmp_path / "hold"
    hold.touch()
    # sharded state's default (auto) may space its copies out by their cost: this test is
    # about the restore from mirrors, so it asks for a copy every step
    extra = ("--memory-snapshot-every", "1") if kind == "fsdp" else ()
    argv = _argv(snap, audit, 8, *extra, worker=(*worker, "--hold-file", str(hold)))
    a = start_agent(tmp_path, "a", argv, env, port=port)
    agents.append(a)
    wait_for(lambda: listening(port), 60, "a to host the store")  # b joins as a client
    b = start_agent(tmp_path, "b", argv, env, port=port)
    agents.append(b)
    a.wait_event("rendezvous.completed", 90, lambda e: e["world_size"] == 2)
    hold.unlink()
    # a committed snapshot of the 2-node group, and training past it, before the node dies
    first = min(wait_for(lambda: steps_at(audit, 2), 90, "steps at world size 2"))
    wait_for(
        lambda: [e for e in _events([a, b], "snapshot.saved") if e["step"] >= first],
        90,
        "a snapshot at world size 2",
    )
    saved = max(e["step"] for e in _events([a, b], "snapshot.saved"))
    # A step's in-memory copy becomes whole in the background (the sharded tier's mirror send,
    # which skips a step while the previous one still runs; the replicated tier's optimizer
    # tensors, by the next optimizer step): two steps past the snapshot, and far from the next
    # one (every 8 steps), the survivors' copies are newer than storage. (One step past, a
    # loaded CI machine once still had only the snapshot's step whole, and the restore rightly
    # took storage.)
    wait_for(lambda: max(steps_at(audit, 2), default=0) > saved + 2, 60, "steps past the snapshot")
    assert max(steps_at(audit, 2)) < STEPS  # acted mid-run, not after the end

    before = {name: len(a.events(name)) for name in ("rendezvous.completed", "membership.changed")}
    hold.touch()
    b.kill_tree()
    assert b.proc.returncode == -signal.SIGKILL
    shrink = wait_new(a, "membership.changed", before["membership.changed"], 60)
    assert (shrink["old_world_size"], shrink["new_world_size"]) == (2, 1)
    assert shrink["reason"] == "node_lost"
    assert (
        wait_new(a, "rendezvous.completed", before["rendezvous.completed"], 10)["world_size"] == 1
    )
    restored = a.wait_event("snapshot.restored", 60, lambda e: e["world_size"] == 1)
    assert restored["saved_world_size"] == 2 and restored["step"] >= saved
    assert restored["source"] == survivor_source  # in-memory copies, not storage
    wait_for(
        lambda: max(steps_at(audit, 1), default=0) > restored["step"], 60, "steps at world size 1"
    )
    recovered = a.wait_event("recovery.completed", 10, lambda e: e["world_size_after"] == 1)
    assert recovered["world_size_before"] == 2 and recovered["snapshot_step"] == restored["step"]
    assert recovered["steps_lost"] <= 1

    changes = len(a.events("membership.changed"))
    c = start_agent(tmp_path, "c", argv, env, port=port)
    agents.append(c)
    grow = wait_new(a, "membership.changed", changes, 90)
    hold.unlink()
    assert (grow["old_world_size"], grow["reason"]) == (1, "node_joined")
    assert a.wait(180) == 0 and c.wait(60) == 0
    # a's new workers started while the old ones trained, which stopped once they were ready
    admitted = [e for e in a.events("workers.started") if e["world_size"] == 2][-1]
    assert admitted["alongside"] is True
    handed_over = a.events("group.handed_over")  # (b's join too, if a trained alone first)
    assert handed_over and all(e["ready"] for e in handed_over), handed_over
    # the new node had no copy of its own
    assert [e["source"] for e in c.events("snapshot.restored")][:1] == [joiner_source]
    finished = a.events("job.finished")[-1]
    assert finished["status"] == "succeeded" and finished["restarts"] == 0  # membership is free
    # node a was never preempted: its supervisor's own restarts must not read as preemptions
    reasons = {e["reason"] for e in [*a.events("session.stopping"), *c.events("session.stopping")]}
    assert not reasons & {"preempted", "peer_preempted"}, reasons  # nor a peer's restart

    kept = _assert_exactly_once(audit)
    sizes = [r.world_size for r in kept]
    assert sizes[-1] == 2  # (a may have trained alone before b joined) grew, shrank, grew
    shrunk = sizes.index(1, sizes.index(2))
    assert 2 in sizes[shrunk:]


def test_a_joiner_whose_worker_dies_while_the_group_forms_does_not_stop_the_running_one(
    tmp_path, worker_env, agents
):
    """b's first worker dies before it joins the new group: b leaves the round and re-joins.
    a's new workers can never get that group; a abandons them (its old ones never stopped)
    and admits b again alongside: a trains on throughout, instead of waiting the hand-over's
    60 s and then stopping for a group that waits in ``init_process_group``."""
    snap, audit = tmp_path / "snap", tmp_path / "audit"
    port, env = free_port(), env_with(worker_env)
    hold = tmp_path / "hold"
    hold.touch()
    argv = _argv(snap, audit, 8, worker=("--hold-file", str(hold)))
    a = start_agent(tmp_path, "a", argv, env, port=port)  # alone first
    agents.append(a)
    a.wait_event("session.started", 90)
    died = tmp_path / "b-died-once"
    b = start_agent(tmp_path, "b", [*argv, "--die-once", str(died)], env, port=port)
    agents.append(b)
    abandoned = a.wait_event("group.handover_abandoned", 90)
    assert abandoned["reason"] == "round_moved_on" and died.exists()
    a.wait_event("group.handed_over", 90)
    hold.unlink()
    assert a.wait(180) == 0 and b.wait(60) == 0
    (handed_over,) = a.events("group.handed_over")
    assert handed_over["ready"] is True
    assert handed_over["pause_s"] is not None  # the new workers stepped: measured on their clock
    started = a.events("workers.started")
    assert [(e["world_size"], e["alongside"]) for e in started] == [
        (1, False),
        (2, True),  # abandoned: killed before it had its group
        (2, True),
    ]
    # nothing of a's failed or restarted for a failure: its first workers trained on
    assert not a.events("worker.failed")
    assert {e["reason"] for e in a.events("group.restarting")} == {"membership"}
    assert a.events("job.finished")[-1]["restarts"] == 0
    assert [e["exit_code"] for e in b.events("worker.failed")][:1] == [3]
    _assert_exactly_once(audit)


def test_sigterm_to_one_of_two_commits_a_final_snapshot_and_loses_no_step(
    tmp_path, worker_env, agents
):
    snap, audit = tmp_path / "snap", tmp_path / "audit"
    port, env = free_port(), env_with(worker_env)
    # A lone a's steps slow down while this file exists: however loaded the machine, the job
    # cannot end before b has joined (a may form a first round alone).
    hold = tmp_path / "hold"
    hold.touch()
    # No periodic snapshot in this run: zero steps lost can only come from the final one.
    argv = _argv(snap, audit, 10_000, "--grace-period", "20", worker=("--hold-file", str(hold)))
    a = start_agent(tmp_path, "a", argv, env, port=port)
    agents.append(a)
    wait_for(lambda: listening(port), 60, "a to host the store")
    b = start_agent(tmp_path, "b", argv, env, port=port)
    agents.append(b)
    a.wait_event("rendezvous.completed", 120, lambda e: e["world_size"] == 2)
    hold.unlink()
    wait_for(lambda: len(steps_at(audit, 2)) >= 5, 120, "steps at world size 2")

    earlier = len(_events([a, b], "session.stopping"))  # a scale-up also stops the workers
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait(30) == 143
    assert b.events("job.finished")[-1]["status"] == "preempted"
    # Rank 0 reports the stop, and rank 0 runs on a, which goes on: its line may land after b
    # has left.
    stopping = wait_for(
        lambda: sorted(_events([a, b], "session.stopping"), key=lambda e: e["timestamp"])[earlier:],
        30,
        "a worker to report the coordinated stop",
    )
    stop_step = stopping[0]["step"]
    assert {e["step"] for e in stopping} == {stop_step}  # every rank stopped at one step
    assert stop_step < STEPS
    final = wait_for(
        lambda: [e for e in _events([a, b], "snapshot.saved") if e["step"] == stop_step],
        30,
        "the final snapshot at the stop step",
    )
    assert len(final) == 1  # committed once, by rank 0

    recovered = a.wait_event("recovery.completed", 60, lambda e: e["world_size_after"] == 1)
    assert recovered["steps_lost"] == 0 and recovered["snapshot_step"] == stop_step
    assert recovered["world_size_before"] == 2
    restored = a.wait_event("snapshot.restored", 10, lambda e: e["world_size"] == 1)
    assert (restored["step"], restored["saved_world_size"]) == (stop_step, 2)
    shrink = a.wait_event("membership.changed", 10, lambda e: e["new_world_size"] == 1)
    assert shrink["reason"] == "peer_preempted"
    assert a.wait(180) == 0
    finished = a.events("job.finished")[-1]
    assert finished["status"] == "succeeded" and finished["restarts"] == 0

    kept = _assert_exactly_once(audit)
    assert [r.world_size for r in kept if r.step > stop_step] == [1] * (STEPS - stop_step)
