"""The built-in job with --fsdp through elastic-train: snapshot at world size 2, resume at 3,
then at 1. Each sample is trained exactly once across both changes, and the full (gathered)
model right after each resume equals the one in the snapshot it resumed from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_trainer import check_exactly_once, read_audit_log
from snapshots import SnapshotStore
from snapshots.cli import main as snapshots_main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PROBE = str(Path(__file__).parent / "workers" / "fsdp_probe.py")
# 48 samples, global batch 6: 8 steps per epoch, a batch 1, 2 and 3 ranks all divide
TINY = [
    "--fsdp", "--model", "resnet18", "--train-samples", "48", "--val-samples", "12",
    "--global-batch-size", "6", "--epochs", "2", "--progress-every", "0.01",
    "--sample-log", "audit",
]  # fmt: skip


def launch(run_dir: Path, env: dict[str, str], nproc: int, *job_args: str) -> None:
    cmd = [
        sys.executable, "-m", "elastic_trainer", "--standalone",
        "--nproc-per-node", str(nproc), "--snapshot-dir", str(run_dir / "ckpt"),
        "--log-file", str(run_dir / "events.jsonl"), "--log-format", "json",
        PROBE, *TINY, *job_args,
    ]  # fmt: skip
    done = subprocess.run(
        cmd, env=env, cwd=run_dir, capture_output=True, text=True, timeout=200, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def test_fsdp_job_resumes_at_3_then_at_1_exactly_once_with_the_saved_model(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    env = {**worker_env, "FSDP_PROBE_DIR": str(tmp_path)}
    launch(tmp_path, env, 2, "--max-steps", "3")
    store = SnapshotStore(str(tmp_path / "ckpt"), create=False)
    first = store.latest()
    assert first is not None and (first.step, first.world_size, first.format_version) == (3, 2, 2)
    launch(tmp_path, env, 3, "--max-steps", "11")  # into epoch 2
    second = store.latest()
    assert second is not None and (second.step, second.world_size) == (11, 3)
    launch(tmp_path, env, 1)
    assert store.latest().step == 16  # type: ignore[union-attr]
    for step in (3, 11):
        out = tmp_path / f"exported-{step}.pt"
        assert (
            snapshots_main(["export", str(tmp_path / "ckpt"), "--step", str(step), "-o", str(out)])
            == 0
        )
        saved = torch.load(out, weights_only=True)["model"]
        resumed = torch.load(tmp_path / f"resumed-{step}.pt", weights_only=True)
        assert saved.keys() == resumed.keys()
        torch.testing.assert_close(resumed, saved, rtol=0, atol=0)
    records = read_audit_log(str(tmp_path / "audit"))
    assert check_exactly_once(records, 48, complete_epochs=[0, 1]) == []


@pytest.mark.timeout(480)
def test_fsdp_resume_at_the_same_world_size_is_bit_identical_to_an_uninterrupted_run(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    """Stopped after step 3 and resumed at world size 2 again, the job ends with exactly the
    model and optimizer state of the same job run through: exported, tensor by tensor."""
    finals = {}
    for name, stops in (("through", [None]), ("resumed", ["3", None])):
        run_dir = tmp_path / name
        run_dir.mkdir()
        env = {**worker_env, "FSDP_PROBE_DIR": str(run_dir)}
        for stop in stops:
            launch(run_dir, env, 2, *(["--max-steps", stop] if stop else []))
        assert SnapshotStore(str(run_dir / "ckpt"), create=False).latest().step == 16  # type: ignore[union-attr]
        out = run_dir / "final.pt"
        assert (
            snapshots_main(["export", str(run_dir / "ckpt"), "--step", "16", "-o", str(out)]) == 0
        )
        finals[name] = torch.load(out, weights_only=True)
    assert {"model", "optimizer"} <= finals["through"].keys()
    resumed, through = finals["resumed"], finals["through"]
    torch.testing.assert_close(resumed["model"], through["model"], rtol=0, atol=0)
    torch.testing.assert_close(
        resumed["optimizer"]["state"], through["optimizer"]["state"], rtol=0, atol=0
    )
    assert resumed["optimizer"]["param_groups"] == through["optimizer"]["param_groups"]
