"""Train through the real launcher on gloo, stop, resume at other world sizes.

One tiny DDP Linear model, 61 samples, global batch 12 (5 full steps + a 1-sample step per
epoch, so ranks holding only a padding sample are exercised), 3 epochs = 18 steps.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from elastic_trainer.worker.audit import check_exactly_once, effective_records, read_audit_log
from tests.dist.workers.launcher import launch_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SCRIPT = str(Path(__file__).parent / "workers" / "train_linear.py")
SAMPLES, STEPS = 61, 18


class Run:
    """One job: a snapshot folder and an audit folder that successive launches share."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env = root, env
        self.out = root / "final.pt"

    def launch(self, nproc: int, *extra: str) -> str:
        args = [
            "--snapshot-dir", str(self.root / "snapshots"),
            "--audit-dir", str(self.root / "audit"),
            "--out", str(self.out),
            *extra,
        ]  # fmt: skip
        result = launch_workers(SCRIPT, nproc, args, env=self.env)
        assert result.returncode == 0, result.output[-4000:]
        return result.output

    def fork(self, root: Path) -> Run:
        """A copy of this job's snapshots and audit log, to continue another way."""
        shutil.copytree(self.root, root)
        return Run(root, self.env)

    def final_params(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out, weights_only=True)

    def step_sets(self) -> dict[int, list[int]]:
        steps: dict[int, list[int]] = {}
        for record in effective_records(read_audit_log(str(self.root / "audit"))):
            steps.setdefault(record.step, []).extend(record.indices)
        return {step: sorted(indices) for step, indices in steps.items()}

    def world_sizes(self) -> dict[int, int]:
        records = effective_records(read_audit_log(str(self.root / "audit")))
        return {r.step: r.world_size for r in records}

    def coverage_problems(self) -> list[str]:
        records = read_audit_log(str(self.root / "audit"))
        return check_exactly_once(records, SAMPLES, complete_epochs=[0, 1, 2])


def test_resume_at_other_world_sizes_trains_every_sample_once_and_matches(tmp_path, worker_env):
    reference_1 = Run(tmp_path / "ref1", worker_env)
    reference_1.launch(1)
    reference_2 = Run(tmp_path / "ref2", worker_env)
    reference_2.launch(2)

    elastic = Run(tmp_path / "elastic", worker_env)
    elastic.launch(2, "--max-steps", "4")
    assert not elastic.out.exists()
    same_size = elastic.fork(tmp_path / "same-size")
    elastic.launch(3, "--max-steps", "11")
    elastic.launch(1)
    same_size.launch(2)

    # world sizes really changed at the planned steps
    sizes = elastic.world_sizes()
    assert [sizes[s] for s in (1, 4, 5, 11, 12, 18)] == [2, 2, 3, 3, 1, 1]
    # the audit log proves exactly-once coverage of every epoch, across all three attempts
    assert elastic.coverage_problems() == []
    assert same_size.coverage_problems() == []
    # every step trained the same samples whatever the world size
    assert len(reference_1.step_sets()) == STEPS
    assert elastic.step_sets() == reference_1.step_sets() == reference_2.step_sets()
    # and the model ends where an uninterrupted run ends
    ref1, ref2 = reference_1.final_params(), reference_2.final_params()
    torch.testing.assert_close(elastic.final_params(), ref1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref2, ref1, rtol=1e-5, atol=1e-6)
    for name, value in same_size.final_params().items():
        assert torch.equal(value, ref2[name]), f"{name} differs after 2 -> stop -> 2"
