"""The recipe's pure parts: lr schedule, precision choice, progress reports, best-k exports."""

from __future__ import annotations

import itertools
import os
import stat

import pytest
import torch

from elastic_trainer.jobs.evaluation import export_if_best, plain_weights
from elastic_trainer.jobs.recipe import (
    BestModels,
    Precision,
    ProgressMeter,
    build_optimizer,
    build_scheduler,
    lr_factor,
)


def test_lr_warms_up_linearly_then_decays_to_zero() -> None:
    factors = [lr_factor(s, warmup_steps=4, total_steps=12) for s in range(12)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(1 / 8)
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))
    assert lr_factor(12, warmup_steps=4, total_steps=12) == 0.0


def test_no_warmup_starts_at_the_peak() -> None:
    assert lr_factor(0, warmup_steps=0, total_steps=10) == 1.0


def test_optimizer_is_nesterov_sgd_with_weight_decay() -> None:
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, 0.2)
    group = opt.param_groups[0]
    assert group["nesterov"] and group["momentum"] == 0.9 and group["weight_decay"] == 1e-4
    sched = build_scheduler(opt, warmup_steps=2, total_steps=4)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.2, 0.2, 0.1])


def test_precision_bf16_on_cpu_with_a_disabled_scaler() -> None:
    cpu = Precision.choose(torch.device("cpu"), amp=True)
    assert cpu.dtype == torch.bfloat16 and not cpu.scaler().is_enabled()
    with cpu.autocast():
        out = torch.nn.Linear(4, 4)(torch.zeros(1, 4))
    assert out.dtype == torch.bfloat16
    assert Precision.choose(torch.device("cuda"), amp=True).dtype == torch.float16
    assert Precision.choose(torch.device("cpu"), amp=False).dtype is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_reports_at_most_every_interval_with_rate_and_eta() -> None:
    clock = FakeClock()
    meter = ProgressMeter(total_steps=100, every_s=10.0, clock=clock)
    meter.start(0)
    reports = []
    for step in range(1, 21):
        clock.now += 1.0  # one second per step of 32 samples
        report = meter.update(step=step, epoch=0, loss=1.0, lr=0.1, samples=32)
        if report:
            reports.append(report)
    assert [r["step"] for r in reports] == [10, 20]
    assert reports[-1]["samples_per_s"] == 32.0 and reports[-1]["eta_s"] == 80.0


def test_progress_force_reports_now() -> None:
    clock = FakeClock()
    meter = ProgressMeter(total_steps=10, every_s=60.0, clock=clock)
    meter.start(3)
    clock.now += 2.0
    report = meter.update(step=4, epoch=0, loss=0.5, lr=0.1, samples=8, force=True)
    assert report is not None and report["samples_per_s"] == 4.0 and report["eta_s"] == 12.0


def test_best_models_keeps_the_top_two_and_drops_the_rest() -> None:
    best = BestModels(keep=2)
    assert best.offer(step=1, accuracy=0.5, path="a") == (True, [])
    assert best.offer(step=2, accuracy=0.7, path="b") == (True, [])
    assert best.offer(step=3, accuracy=0.6, path="c") == (True, ["a"])
    assert best.offer(step=4, accuracy=0.1, path="d") == (False, [])
    assert best.offer(step=3, accuracy=0.6, path="c") == (False, [])  # re-evaluated step
    assert [e["step"] for e in best.entries] == [2, 3]
    restored = BestModels()
    restored.load_state_dict(best.state_dict())
    assert restored.entries == best.entries


def test_exports_are_plain_weights_and_only_the_best_two_stay(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    best = BestModels(keep=2)
    (tmp_path / "model-step00000099-acc0.9900.pt").write_bytes(b"rolled back by a restart")
    paths = [
        export_if_best(model, best, directory=str(tmp_path), step=s, accuracy=a)
        for s, a in ((1, 0.3), (2, 0.5), (3, 0.4), (4, 0.1))
    ]
    assert paths[3] is None
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["model-step00000002-acc0.5000.pt", "model-step00000003-acc0.4000.pt"]
    loaded = torch.load(tmp_path / left[0], weights_only=True)
    expected = plain_weights(model)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    ("group_access", "modes"), [(False, (0o700, 0o600)), (True, (0o750, 0o640))]
)
def test_exports_are_private_whatever_the_umask(tmp_path, group_access, modes) -> None:
    old = os.umask(0o022)
    try:
        model = torch.nn.Linear(2, 1)
        path = export_if_best(model, BestModels(keep=1), directory=str(tmp_path / "best"),
                              step=1, accuracy=0.5, group_access=group_access)  # fmt: skip
    finally:
        os.umask(old)
    assert path is not None
    assert (
        stat.S_IMODE((tmp_path / "best").stat().st_mode),
        stat.S_IMODE(os.stat(path).st_mode),
    ) == modes
