"""The built-in job on CUDA under the real CLI: --amp (fp16 + GradScaler), several workers,
--fsdp on NCCL (sharded snapshots resharded on load, exported), a worker crash and a node
loss with their recovery times. The harnesses are the CPU tier's (tests/e2e)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from snapshots import SnapshotStore
from snapshots.cli import main as snapshots_main
from tests.e2e import test_fsdp_job
from tests.e2e.test_default_job import SNAPSHOTS, STEPS, TINY, events, final_model, launch
from tests.e2e.workers.harness import env_with, free_port, listening, start_agent, wait_for
from tests.gpu.conftest import ONE_RANK_PER_GPU, gpu_count

pytestmark = [pytest.mark.timeout(300)]

COLLECTIVE_TIMEOUT_S = 300  # a survivor waiting in a collective for it would show in downtime
RECOVERY_BOUND_S = 60
SUPERVISOR = ("--max-restarts", "1", "--snapshot-every", "8",
              "--collective-timeout", str(COLLECTIVE_TIMEOUT_S))  # fmt: skip


def nccl_world() -> int:
    return min(gpu_count(), 2)


def test_amp_on_cuda_keeps_the_grad_scaler_in_every_snapshot_and_restores_it(
    tmp_path: Path, worker_env: dict[str, str], record
) -> None:
    job = [*TINY, "--amp"]
    stopped = launch(tmp_path, worker_env, nproc=1, job_args=[*job, "--max-steps", "7"])
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    store = SnapshotStore(str(tmp_path / SNAPSHOTS))
    scaler = store.load(7).state["scaler"]
    assert scaler and scaler["scale"] > 0  # enabled: fp16 on CUDA, not an empty state
    assert "_growth_tracker" in scaler
    resumed = launch(tmp_path, worker_env, nproc=1, job_args=job)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert {e["step"] for e in events(tmp_path, "snapshot.restored")} == {7}
    for snap in store.list():
        assert store.load(snap.step).state["scaler"].get("scale", 0) > 0, snap.step
    final = final_model(tmp_path)
    assert all(t.device.type == "cpu" and not t.isnan().any() for t in final.values())
    record(what="amp resume", steps=STEPS, final_scale=store.load(STEPS).state["scaler"]["scale"])


def test_several_workers_on_the_gpus_train_and_resume_bit_identically(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    """``--nproc-per-node`` = the GPU count, a stop at step 9 and a resume equal one
    uninterrupted run."""
    if gpu_count() < 2:
        pytest.skip(ONE_RANK_PER_GPU)
    nproc = gpu_count()
    through, resumed = tmp_path / "through", tmp_path / "resumed"
    for run_dir, stops in ((through, [None]), (resumed, ["9", None])):
        run_dir.mkdir()
        for stop in stops:
            extra = ["--max-steps", stop] if stop else []
            done = launch(run_dir, worker_env, nproc=nproc, job_args=[*TINY, *extra])
            assert done.returncode == 0, done.stdout[-3000:]
    expected, got = final_model(through), final_model(resumed)
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []


def test_more_workers_than_gpus_is_one_line_and_exit_2_not_an_nccl_error(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    """NCCL refuses two ranks on one GPU ('Duplicate GPU detected', from every rank's first
    collective, then a restart loop): the workers say what to change instead."""
    nproc = gpu_count() + 1
    done = launch(tmp_path, worker_env, nproc=nproc, job_args=[*TINY, "--max-steps", "2"])
    assert done.returncode == 2, done.stdout[-3000:]
    gpus = gpu_count()
    assert f"{nproc} workers on this node but {gpus} visible GPU" in done.stdout
    assert f"--nproc-per-node {gpus}" in done.stdout
    assert "Duplicate GPU" not in done.stdout
    assert [e["restart_count"] for e in events(tmp_path, "workers.started")] == [0]


def test_fsdp_on_nccl_reshards_its_snapshots_on_load_and_exports_them(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    """Snapshot at world size 2, resume at 1: the full model right after the resume equals
    the exported snapshot it resumed from, bit for bit."""
    if gpu_count() < 2:
        pytest.skip(ONE_RANK_PER_GPU)
    env = {**worker_env, "FSDP_PROBE_DIR": str(tmp_path)}
    test_fsdp_job.launch(tmp_path, env, 2, "--amp", "--max-steps", "3")
    store = SnapshotStore(str(tmp_path / "ckpt"), create=False)
    first = store.latest()
    assert first is not None and (first.step, first.world_size) == (3, 2)
    test_fsdp_job.launch(tmp_path, env, 1, "--amp")
    out = tmp_path / "exported-3.pt"
    argv = ["export", str(tmp_path / "ckpt"), "--step", "3", "-o", str(out)]
    assert snapshots_main(argv) == 0
    saved = torch.load(out, weights_only=True)["model"]
    resumed = torch.load(tmp_path / "resumed-3.pt", weights_only=True)
    assert saved.keys() == resumed.keys()
    torch.testing.assert_close(resumed, saved, rtol=0, atol=0)


def test_a_worker_crash_on_nccl_recovers_without_waiting_for_the_collective_timeout(
    tmp_path: Path, worker_env: dict[str, str], record
) -> None:
    nproc = nccl_world()
    proc = launch(
        tmp_path,
        worker_env,
        nproc=nproc,
        job_args=[*TINY, "--epochs", "40"],
        wait=False,
        supervisor_args=SUPERVISOR,
    )
    try:
        wait_for(
            lambda: (
                (tmp_path / "events.jsonl").exists()
                and any(e["step"] >= 10 for e in events(tmp_path, "train.progress"))
            ),
            120,
            "step 10",
        )
        pid = events(tmp_path, "workers.started")[0]["pids"][-1]
        os.kill(pid, signal.SIGKILL)
        recovered = wait_for(lambda: events(tmp_path, "recovery.completed"), 120, "recovery")[0]
        assert proc.wait(timeout=240) == 0, (tmp_path / "output.txt").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert recovered["downtime_s"] < RECOVERY_BOUND_S
    sources = {e.get("source") for e in events(tmp_path, "snapshot.restored")}
    record(
        what="worker crash",
        nproc=nproc,
        downtime_s=recovered["downtime_s"],
        steps_lost=recovered["steps_lost"],
        restored_from=sorted(map(str, sources)),
    )
    if nproc > 1:  # the other rank survives: its just-in-time copy serves (worker/memory/held.py)
        assert sources == {"memory"} and recovered["steps_lost"] <= 1


def test_a_node_loss_on_nccl_shrinks_the_group_and_the_survivor_goes_on(
    tmp_path: Path, worker_env: dict[str, str], agents, record
) -> None:
    """Two agents on 127.0.0.1, one GPU each; one vanishes (every process SIGKILLed)."""
    if gpu_count() < 2:
        pytest.skip(ONE_RANK_PER_GPU)
    port = free_port()
    argv = [
        "--min-nodes", "1", "--max-nodes", "2", "--nproc-per-node", "1",
        "--snapshot-dir", str(tmp_path / SNAPSHOTS), "--snapshot-every", "8",
        "--collective-timeout", str(COLLECTIVE_TIMEOUT_S),
        "--", *TINY, "--epochs", "400", "--max-steps", "2000",
    ]  # fmt: skip
    a = start_agent(tmp_path, "a", argv, env_with(worker_env, CUDA_VISIBLE_DEVICES="0"), port=port)
    agents.append(a)
    wait_for(lambda: listening(port), 60, "a to host the store")
    b = start_agent(tmp_path, "b", argv, env_with(worker_env, CUDA_VISIBLE_DEVICES="1"), port=port)
    agents.append(b)
    a.wait_event("train.progress", 120, lambda e: e["step"] >= 10)
    b.kill_tree()
    recovered = a.wait_event("recovery.completed", 120)
    assert recovered["cause"] == "node_lost" and recovered["world_size_after"] == 1
    assert recovered["downtime_s"] < RECOVERY_BOUND_S
    a.wait_event("train.progress", 60, lambda e: e["timestamp"] > recovered["timestamp"])
    restored = a.events("snapshot.restored")[-1]
    record(
        what="node loss",
        downtime_s=recovered["downtime_s"],
        steps_lost=recovered["steps_lost"],
        restored_from=restored.get("source"),
    )
    # The survivor's host has usually stepped while its device waits in the gradient
    # all-reduce with the dead peer: its just-in-time copy is of the step as it began
    # (worker/memory/held.py), not storage's (up to --snapshot-every 8 steps back).
    assert restored.get("source") == "memory" and recovered["steps_lost"] <= 1
