"""Coordinated stop through the real launcher: the stop file, one all-reduce, one final
snapshot, and the exit codes the supervisor reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_trainer.contract import protocol
from elastic_trainer.worker.audit import read_audit_log
from snapshots import SnapshotStore
from tests.dist.workers.launcher import launch_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = str(Path(__file__).parent / "workers" / "train_linear.py")


def _launch(tmp_path, env, *extra):
    args = [
        "--snapshot-dir", str(tmp_path / "snapshots"),
        "--audit-dir", str(tmp_path / "audit"),
        "--out", str(tmp_path / "final.pt"),
        "--snapshot-every", "100",
        "--stop-at-step", "3",
        *extra,
    ]  # fmt: skip
    return launch_workers(SCRIPT, 2, args, env=env)


def _steps_by_attempt(tmp_path: Path) -> dict[int, set[tuple[int, int]]]:
    """attempt number (0, 1, ... in order) -> {(step, rank)} from the sample audit log.

    The audit's ``attempt`` id grows from attempt to attempt; ``restart_count`` would not: a
    membership restart is not charged to the budget."""
    by_id: dict[int, set[tuple[int, int]]] = {}
    for record in read_audit_log(str(tmp_path / "audit")):
        by_id.setdefault(record.attempt, set()).add((record.step, record.rank))
    return {n: by_id[key] for n, key in enumerate(sorted(by_id))}


def test_stop_file_stops_every_rank_at_the_same_step_with_a_final_snapshot(tmp_path, worker_env):
    result = _launch(tmp_path, worker_env)
    # own node stopping: EXIT_PREEMPTED on both ranks, which the supervisor reads as done
    assert protocol.EXIT_PREEMPTED == 0
    assert result.returncode == protocol.SUPERVISOR_EXIT_OK, result.output[-3000:]
    assert result.named("worker.failed") == []
    assert result.named("job.finished")[-1]["status"] == "succeeded"
    # rank 0 created the stop file after step 3; the ranks agreed on it at step 4
    store = SnapshotStore(str(tmp_path / "snapshots"))
    assert [info.step for info in store.list()] == [4]
    store.close()
    assert _steps_by_attempt(tmp_path) == {0: {(s, r) for s in (1, 2, 3, 4) for r in (0, 1)}}
    assert not (tmp_path / "final.pt").exists()


def test_a_peer_nodes_stop_exits_peer_preempted(tmp_path, worker_env):
    # each rank plays a node with its own control directory; only rank 0's node stops
    result = _launch(tmp_path, worker_env, "--control-dir-per-rank")
    failed = result.named("worker.failed")
    assert [(e["rank"], e["exit_code"], e["cause"]) for e in failed] == [
        (1, protocol.EXIT_PEER_PREEMPTED, "preempted")
    ], result.output[-3000:]
    # a peer's stop is a membership change: not charged (--max-restarts 0), the group re-forms
    assert [e["reason"] for e in result.named("group.restarting")] == ["membership"]
    assert result.returncode == protocol.SUPERVISOR_EXIT_OK, result.output[-3000:]
    steps = _steps_by_attempt(tmp_path)
    # both ranks stopped at step 4 together; the next attempt resumed from the final snapshot
    assert steps[0] == {(s, r) for s in (1, 2, 3, 4) for r in (0, 1)}
    assert min(step for step, _ in steps[1]) == 5
    assert (tmp_path / "final.pt").exists()


def test_a_peer_nodes_restart_is_no_preemption_and_saves_nothing_to_storage(tmp_path, worker_env):
    """Rank 0's supervisor restarts the group (its marker, then SIGTERM); rank 1, another
    node, learns it in the step's all-reduce: both stop at that step with their in-memory
    copy, and neither writes a storage snapshot (no node is going away)."""
    result = _launch(
        tmp_path, worker_env, "--control-dir-per-rank", "--stop-at-step", "0",
        "--restart-at-step", "3",
    )  # fmt: skip
    assert result.returncode == protocol.SUPERVISOR_EXIT_OK, result.output[-3000:]
    # (rank 1, unsignalled, says nothing: its exit code says it stopped for a peer)
    stopping = {e["rank"]: e["reason"] for e in result.named("session.stopping")}
    assert stopping == {0: "restarting"}, result.output[-3000:]
    out = result.output[-4000:]
    failed = result.named("worker.failed")
    assert [(e["rank"], e["exit_code"]) for e in failed] == [(1, protocol.EXIT_PEER_PREEMPTED)], out
    restored = result.named("snapshot.restored")
    assert {(e["step"], e["source"]) for e in restored} == {(4, "memory")}, out
    steps = _steps_by_attempt(tmp_path)
    assert steps[0] == {(s, r) for s in (1, 2, 3, 4) for r in (0, 1)}, out
    assert min(step for step, _ in steps[1]) == 5, out
    saved = [e["step"] for e in result.named("snapshot.saved")]
    assert 4 not in saved, out  # the stop saved nothing to storage
