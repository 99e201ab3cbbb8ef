"""Training after a restore is bit-identical to training without interruption."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from snapshots import RNGState, SnapshotStore, UnsafeStateError


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
    )


def _parts(optimizer: str) -> dict[str, object]:
    model = _model()
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "rng": RNGState(),
    }


def _train(parts: dict[str, object], steps: int) -> None:
    model, opt = parts["model"], parts["optimizer"]
    sched, scaler = parts["scheduler"], parts["scaler"]
    model.train()  # type: ignore[attr-defined]
    for _ in range(steps):
        # draw from every RNG so that a missed restore changes the result
        x = torch.randn(4, 3, 8, 8) + float(np.random.rand()) + random.random()
        loss = model(x).square().mean()  # type: ignore[operator]
        opt.zero_grad()  # type: ignore[attr-defined]
        scaler.scale(loss).backward()  # type: ignore[attr-defined]
        scaler.step(opt)  # type: ignore[attr-defined]
        scaler.update()  # type: ignore[attr-defined]
        sched.step()  # type: ignore[attr-defined]


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_is_bit_identical(tmp_path: Path, optimizer: str) -> None:
    _seed(0)
    reference = _parts(optimizer)
    _train(reference, 6)
    reference_rng = (torch.get_rng_state(), random.getstate(), np.random.rand())

    _seed(0)
    first = _parts(optimizer)
    _train(first, 3)
    store = SnapshotStore(str(tmp_path), keep=2)
    store.save(3, first, epoch=1).result(timeout=60)
    _train(first, 2)  # work after the snapshot is lost in the "crash"
    store.close()

    _seed(1234)  # a new process: different init and RNG streams
    resumed = _parts(optimizer)
    loaded = SnapshotStore(str(tmp_path)).load(into=resumed)
    assert loaded.info.step == 3 and loaded.info.epoch == 1
    _train(resumed, 3)

    for p_ref, p_res in zip(
        reference["model"].state_dict().values(),  # type: ignore[attr-defined]
        resumed["model"].state_dict().values(),
        strict=True,
    ):  # type: ignore[attr-defined]
        assert torch.equal(p_ref, p_res)
    assert reference["scaler"].state_dict() == resumed["scaler"].state_dict()  # type: ignore[attr-defined]
    assert reference["scheduler"].state_dict() == resumed["scheduler"].state_dict()  # type: ignore[attr-defined]
    assert torch.equal(torch.get_rng_state(), reference_rng[0])
    assert random.getstate() == reference_rng[1]
    assert np.random.rand() == reference_rng[2]


def test_rng_states_survive_weights_only_loading(tmp_path: Path) -> None:
    _seed(7)
    store = SnapshotStore(str(tmp_path), async_save=False)
    store.save(1, {"rng": RNGState()})
    expected = (torch.rand(3), random.random(), np.random.rand())
    _seed(99)
    store.load(into={"rng": RNGState()})
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1]
    assert np.random.rand() == expected[2]


def test_values_that_need_code_to_load_are_refused_at_save(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path), async_save=False)
    with pytest.raises(UnsafeStateError, match=r"\['extra'\]\['when'\]"):
        store.save(1, {"extra": {"when": Path("/x")}})
    with pytest.raises(UnsafeStateError, match="numpy"):
        store.save(1, {"arr": np.zeros(3)})
    assert store.latest() is None
