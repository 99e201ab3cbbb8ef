"""Coordinated stop through the real launcher: the stop file, one all-reduce, one final
snapshot, and the exit codes the supervisor reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_trainer import protocol
from elastic_trainer.runtime.audit import read_audit_log
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
    control = tmp_path / "control"
    control.mkdir()
    return launch_workers(SCRIPT, 2, args, env={**env, protocol.ENV_CONTROL_DIR: str(control)})


def _progress(path: Path) -> dict:
    return json.loads(path.read_text())


def test_stop_file_stops_every_rank_at_the_same_step_with_a_final_snapshot(tmp_path, worker_env):
    result = _launch(tmp_path, worker_env)
    # own node stopping: EXIT_PREEMPTED on both ranks, so the launcher succeeds
    assert protocol.EXIT_PREEMPTED == 0
    assert result.returncode == 0, result.output[-3000:]
    # rank 0 created the stop file after step 3; the ranks agreed on it at step 4
    store = SnapshotStore(str(tmp_path / "snapshots"))
    assert [info.step for info in store.list()] == [4]
    store.close()
    control = tmp_path / "control"
    for local_rank in (0, 1):
        progress = _progress(control / protocol.progress_file(local_rank))
        assert (progress["step"], progress["restored_step"]) == (4, None)
    assert sorted({r.step for r in read_audit_log(str(tmp_path / "audit"))}) == [1, 2, 3, 4]
    assert not (tmp_path / "final.pt").exists()


def test_a_peer_nodes_stop_exits_peer_preempted(tmp_path, worker_env):
    # each rank plays a node with its own control directory; only rank 0's node stops
    result = _launch(tmp_path, worker_env, "--control-dir-per-rank")
    assert result.returncode != 0  # torchrun reports rank 1's 75 as a failure
    assert f"exitcode  : {protocol.EXIT_PEER_PREEMPTED}" in result.output, result.output[-3000:]
    for rank in (0, 1):
        progress = _progress(tmp_path / "control" / f"rank{rank}" / protocol.progress_file(rank))
        assert progress["step"] == 4
    store = SnapshotStore(str(tmp_path / "snapshots"))
    assert [info.step for info in store.list()] == [4]
    store.close()
