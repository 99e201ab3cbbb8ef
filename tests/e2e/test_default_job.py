"""The built-in job end to end under the real CLI: runs, resumes bit-identically, is reported.

Shrunk by flags: 48 samples, global batch 8 (6 steps per epoch), mobilenet_v3_small (it has
BatchNorm *and* dropout, so a resume must restore the RNG streams too).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from snapshots import SnapshotStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TINY_FLAGS = (
    "--model mobilenet_v3_small --train-samples 48 --val-samples 24 --global-batch-size 8 "
    "--epochs 2 --progress-every 0.01"
)
TINY = TINY_FLAGS.split()
STEPS = 12  # 2 epochs x 48 / 8
# Not "snapshots": under an editable install a ./snapshots folder in the worker's cwd would
# shadow the snapshots package (a namespace package found before the editable finder).
SNAPSHOTS = "ckpt"


def launch(
    run_dir: Path,
    env: dict[str, str],
    *,
    nproc: int,
    job_args: list[str],
    supervisor_args: tuple[str, ...] = (),
    wait: bool = True,
) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run the default job under ``elastic-train`` (the one place that knows the launcher)."""
    cmd = [
        sys.executable,
        "-m",
        "elastic_trainer",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--snapshot-dir",
        str(run_dir / SNAPSHOTS),
        "--log-file",
        str(run_dir / "events.jsonl"),
        "--log-format",
        "json",
        *supervisor_args,
        "--",
        *job_args,
    ]
    out = open(run_dir / "output.txt", "a")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=run_dir)
    if not wait:
        return proc
    try:
        code = proc.wait(timeout=200)
    finally:
        out.close()
    return subprocess.CompletedProcess(cmd, code, (run_dir / "output.txt").read_text(), "")


def events(run_dir: Path, name: str | None = None) -> list[dict]:
    found = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if name is None or record.get("event") == name:
            found.append(record)
    return found


def final_model(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return SnapshotStore(str(run_dir / SNAPSHOTS)).load(step).state["model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Uninterrupted runs, recorded once for the tests below (keyed by world size)."""
    return {}


def uninterrupted(runs: dict, tmp_path_factory, worker_env, nproc: int) -> Path:
    if nproc not in runs:
        run_dir = tmp_path_factory.mktemp(f"ws{nproc}")
        amp = ["--amp"] if nproc == 1 else []  # bf16 autocast on CPU
        result = launch(run_dir, worker_env, nproc=nproc, job_args=[*TINY, *amp])
        assert result.returncode == 0, result.stdout[-3000:]
        runs[nproc] = run_dir
    return runs[nproc]


@pytest.mark.parametrize("nproc", [1, 2])
def test_default_job_trains_snapshots_evaluates_and_exports(
    runs, tmp_path_factory, worker_env, nproc
) -> None:
    run_dir = uninterrupted(runs, tmp_path_factory, worker_env, nproc)
    store = SnapshotStore(str(run_dir / SNAPSHOTS))
    assert store.latest().step == STEPS
    saved = store.load(STEPS).state
    assert {"model", "optimizer", "scheduler", "scaler", "best_models"} <= saved.keys()
    progress = events(run_dir, "train.progress")
    assert progress and progress[-1]["step"] == STEPS
    assert {"loss", "lr", "samples_per_s", "eta_s", "epoch"} <= progress[-1].keys()
    evaluated = events(run_dir, "train.evaluated")
    assert [e["step"] for e in evaluated] == [6, 12]
    assert all(e["val_samples"] == 24 for e in evaluated)  # every val sample, once, all ranks
    exported = events(run_dir, "train.model_exported")
    files = sorted((run_dir / SNAPSHOTS / "best").glob("model-*.pt"))
    assert len(files) == 2 and {e["path"] for e in exported} >= {str(f) for f in files}
    weights = torch.load(files[-1], weights_only=True)
    assert weights.keys() == final_model(run_dir).keys()


def test_stopped_mid_epoch_and_resumed_equals_uninterrupted(
    runs, tmp_path_factory, worker_env, tmp_path
) -> None:
    reference = uninterrupted(runs, tmp_path_factory, worker_env, 2)
    stopped = launch(
        tmp_path, worker_env, nproc=2, job_args=[*TINY, "--max-steps", "9", "--sample-log", "audit"]
    )
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    assert SnapshotStore(str(tmp_path / SNAPSHOTS)).latest().step == 9  # mid epoch 2
    resumed = launch(tmp_path, worker_env, nproc=2, job_args=[*TINY, "--sample-log", "audit"])
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert {e["step"] for e in events(tmp_path, "snapshot.restored")} == {9}
    expected, got = final_model(reference), final_model(tmp_path)
    assert expected.keys() == got.keys()
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert different == []
    from elastic_trainer import check_exactly_once, read_audit_log

    records = read_audit_log(str(tmp_path / "audit"))
    assert check_exactly_once(records, 48, complete_epochs=[0, 1]) == []


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_report_of_a_run_with_a_killed_worker(tmp_path, worker_env) -> None:
    job = [*TINY, "--epochs", "4"]
    proc = launch(
        tmp_path,
        worker_env,
        nproc=1,
        job_args=job,
        wait=False,
        # no in-memory copies: the steps since the storage snapshot are redone
        supervisor_args=(
            "--max-restarts",
            "2",
            "--snapshot-every",
            "8",
            "--no-memory-tier",
        ),
    )
    try:
        snapshotted = wait_for(
            lambda: (tmp_path / "events.jsonl").exists() and events(tmp_path, "snapshot.saved"),
            150,
            "the first snapshot",
        )
        assert snapshotted[0]["step"] == 8
        pid = events(tmp_path, "workers.started")[0]["pids"][0]
        # kill between two snapshots (8 and 16), so the steps after 8 are redone
        wait_for(
            lambda: any(e["step"] >= 9 for e in events(tmp_path, "train.progress")),
            60,
            "a step after the snapshot",
        )
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=200) == 0, (tmp_path / "output.txt").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    out = tmp_path / "report.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_trainer",
            "report",
            str(tmp_path / "events.jsonl"),
            "-o",
            str(out),
            "--json",
        ],
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    summary = json.loads(result.stdout)
    recoveries = events(tmp_path, "recovery.completed")
    assert summary["restarts"] == len(events(tmp_path, "group.restarting")) == 1
    assert summary["failures_by_cause"] == {"signal": 1}
    assert summary["restarts_by_cause"] == {"signal": 1}
    assert summary["time_lost_s"] == pytest.approx(sum(r["downtime_s"] for r in recoveries))
    assert summary["steps_redone"] == sum(r["steps_lost"] for r in recoveries) >= 1
    assert summary["snapshots"] == len(events(tmp_path, "snapshot.saved"))
    assert summary["final_step"] == 2 * STEPS
    finished = events(tmp_path, "job.finished")[-1]
    assert summary["status"] == finished["status"] == "succeeded"
    assert summary["goodput"] == finished["goodput"]
    assert summary["final_val_accuracy"] == events(tmp_path, "train.evaluated")[-1]["val_accuracy"]


def test_plain_module_with_a_bad_model_is_one_line_and_exit_2(worker_env) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.jobs.default", "--model", "resnet9000"],
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: unknown --model 'resnet9000'") and "list_models" in last
