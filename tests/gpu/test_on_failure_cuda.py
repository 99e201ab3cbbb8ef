"""The just-in-time copy on a GPU, with the training stream stuck the way a collective with a
dead peer leaves it: seconds of matrix products queued on it ahead of everything else. The
copy must not wait for them, and must never describe a step the device has not finished.

Without ``on_failure``'s step mark both tests fail (run on an H200: the copy waited for the
stuck stream; a step still queued was copied)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from elastic_trainer.worker.memory.on_failure import FailureCopy
from elastic_trainer.worker.memory.slots import StaleRead
from elastic_trainer.worker.memory.tier import NodeCopies

STUCK_PRODUCTS = 4000  # 8192^3 bf16 products: ~1.4 ms each on an H100/H200, seconds in all


def stuck_stream(products: int = STUCK_PRODUCTS) -> torch.cuda.Event:
    """Queue seconds of work on the training stream (what a collective waiting for a dead
    peer is to the stream); the event completes only once that work has run."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    for _ in range(products):
        torch.mm(a, a, out=out)
    stuck = torch.cuda.Event()
    stuck.record()
    return stuck


def parts() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer, torch.randn(64, 512, device="cuda")


def failure_copy(
    tmp_path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, counted: list[int]
) -> tuple[FailureCopy, NodeCopies]:
    copies = NodeCopies(str(tmp_path))

    def capture(stepped: bool):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        return counted[0] + stepped, state

    def write(step: int, state, _per_rank) -> bool:
        copies.write(step, {"step": step, "state": state})
        return True

    copy = FailureCopy(capture, write)
    copy.attach([optimizer])
    return copy, copies


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()


def three_steps_counted(
    tmp_path: Path,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, FailureCopy, NodeCopies]:
    model, optimizer, x = parts()
    counted = [0]
    copy, copies = failure_copy(tmp_path, model, optimizer, counted)
    for _ in range(3):  # the allocator holds what a step needs: no cudaMalloc later, which
        train_step(model, optimizer, x)  # would wait for the stuck stream on the host
    counted[0] = 3
    copy.counted()
    return model, optimizer, x, copy, copies


def host(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def test_a_copy_does_not_wait_for_a_stuck_collective_queued_after_its_step(tmp_path: Path):
    model, optimizer, x, copy, copies = three_steps_counted(tmp_path)
    torch.cuda.synchronize()
    expected = host(model.state_dict())
    stuck = stuck_stream()  # the next step's all-reduce, waiting for a dead peer
    optimizer.zero_grad(set_to_none=True)  # the next step's forward and backward, queued
    model(x).square().mean().backward()  # behind it as the host goes on
    try:
        assert copy.copy()
        assert not stuck.query(), "the copy waited for the stuck stream"
        back = copies.read(3)
        assert back["step"] == 3
        saved = back["state"]["model"]
        assert all(torch.equal(saved[k], v) for k, v in expected.items())
    finally:
        copy.close()
        torch.cuda.synchronize()


def test_a_step_still_queued_on_the_device_is_never_copied(tmp_path: Path):
    """The host has stepped (phase STEPPED) but the update waits behind the stuck kernel:
    no copy (it would describe a step the device has not reached); once the device is done,
    the copy is of that step and equals the device's state."""
    model, optimizer, x, copy, copies = three_steps_counted(tmp_path)
    stuck = stuck_stream()
    train_step(model, optimizer, x)  # step 4: queued behind the stuck kernel
    try:
        assert not copy.copy()
        assert not stuck.query(), "the copy waited for the stuck stream"
        assert copies.newest() is None
        torch.cuda.synchronize()
        assert copy.copy() and copies.newest() == 4
        saved = copies.read(4)["state"]["model"]
        assert all(torch.equal(saved[k], v.cpu()) for k, v in model.state_dict().items())
    finally:
        copy.close()
        torch.cuda.synchronize()


def test_a_copy_before_the_first_step_waits_for_the_restore_on_the_device(tmp_path: Path):
    """The copy opens after the restore, whose copies to the device may still be queued: a
    copy then describes the restored state only once the device has it."""
    model, optimizer, x = parts()
    for _ in range(3):
        train_step(model, optimizer, x)
    restored = [torch.zeros_like(p) for p in model.parameters()]  # before: no cudaMalloc later
    torch.cuda.synchronize()
    stuck = stuck_stream()
    with torch.no_grad():  # the restore, queued behind the stuck work
        for param, value in zip(model.parameters(), restored, strict=True):
            param.copy_(value)
    counted = [3]
    copy, copies = failure_copy(tmp_path, model, optimizer, counted)
    try:
        assert not copy.copy()
        assert not stuck.query(), "the copy waited for the stuck stream"
        torch.cuda.synchronize()
        assert copy.copy() and copies.newest() == 3
        saved = copies.read(3)["state"]["model"]
        assert all(not saved[k].any() for k in saved if k.endswith(("weight", "bias")))
    finally:
        copy.close()
        torch.cuda.synchronize()


def test_a_step_still_queued_is_copied_as_it_began(tmp_path: Path):
    """The host took step 4 (Adam's counters and the scheduler moved on) while the device
    waits to begin it behind the stuck kernel: the copy is of step 3, the state the device
    still holds, with the host's side as the optimizer's pre-hook held it; it does not wait
    for the stuck stream."""
    model, optimizer, x = parts()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    copies = NodeCopies(str(tmp_path))
    counted = [0]

    def capture(stepped: bool):
        return counted[0] + stepped, {"model": model, "optimizer": optimizer}

    def write_held(step: int, state, _per_rank, *, valid) -> bool:
        states = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}
        copies.write(step, {"step": step, "state": states}, valid=valid)
        return True

    copy = FailureCopy(capture, lambda *a: False, write_held=write_held)
    copy.attach([optimizer])
    for _ in range(3):
        train_step(model, optimizer, x)
        scheduler.step()
    counted[0] = 3
    copy.counted()
    torch.cuda.synchronize()
    expected = host(model.state_dict())
    expected_moments = [host(s)["exp_avg"] for s in optimizer.state_dict()["state"].values()]
    stuck = stuck_stream()
    train_step(model, optimizer, x)  # step 4: its update queued behind the stuck kernel
    scheduler.step()
    try:
        assert copy.copy()
        assert not stuck.query(), "the copy waited for the stuck stream"
        back = copies.read(3)
        saved = back["state"]["model"]
        assert all(torch.equal(saved[k], v) for k, v in expected.items())
        moments = back["state"]["optimizer"]["state"]
        assert {s["step"].item() for s in moments.values()} == {3.0}
        assert all(torch.equal(moments[i]["exp_avg"], m) for i, m in enumerate(expected_moments))
        assert back["state"]["optimizer"]["param_groups"][0]["lr"] == 0.01 * 0.5**3
    finally:
        copy.close()
        torch.cuda.synchronize()


def test_a_held_copy_the_device_began_the_step_under_is_never_committed(tmp_path: Path):
    """The device leaves the stuck work and begins step 4 while step 3's state is read: the
    read may hold step 4's updates, so nothing is committed (the step's begin event, recorded
    at the optimizer's pre-hook, says so on the real device)."""
    model, optimizer, x = parts()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    copies = NodeCopies(str(tmp_path))
    counted = [0]
    checks: list[bool] = []

    def capture(stepped: bool):
        return counted[0] + stepped, {"model": model, "optimizer": optimizer}

    def write_held(step: int, state, _per_rank, *, valid) -> bool:
        states = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}
        checks.append(valid())  # the device has not begun step 4 yet
        torch.cuda.synchronize()  # it does now, while the copy is still being read
        checks.append(valid())
        try:
            copies.write(step, {"step": step, "state": states}, valid=valid)
        except StaleRead:
            return False
        return True

    copy = FailureCopy(capture, lambda *a: False, write_held=write_held)
    copy.attach([optimizer])
    for _ in range(3):
        train_step(model, optimizer, x)
    counted[0] = 3
    copy.counted()
    torch.cuda.synchronize()
    stuck_stream(products=400)
    train_step(model, optimizer, x)  # step 4: queued behind the stuck kernel
    try:
        assert not copy.copy()
        assert checks == [True, False]
        assert copies.newest() is None
    finally:
        copy.close()
        torch.cuda.synchronize()
