"""The step split on a GPU (worker/step_timing.py): CUDA events, read one step late.

One rank, NCCL, DDP on the GPU (its comm hook runs, its all-reduce of one rank is the
collective): the host runs ahead of the device, so a host clock would see the launch, not the
work. The forward spins the GPU for a known time that grows after step 10; the compute the
session would send must follow the device's time, one step late, not the host's.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_trainer.worker.step_timing import StepTiming, Stopwatch

SPIN_CYCLES = 20_000_000  # torch.cuda._sleep: about 10 ms at ~2 GHz
STEPS = 20


class Spin(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.cycles = SPIN_CYCLES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return self.linear(x)


@pytest.fixture
def nccl_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_compute_follows_the_device_one_step_late(nccl_group, record):
    device = torch.device("cuda", 0)
    spin = Spin().to(device)
    model = DDP(spin, device_ids=[0])
    timing = StepTiming(Stopwatch(device))
    assert timing.stopwatch.cuda and timing.watch(model)  # the comm hook took
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32, 64, device=device)
    figures = []
    for step in range(1, STEPS + 1):
        if step == 11:
            spin.cycles = 3 * SPIN_CYCLES  # the device slows, the host does not
        model(data).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        figures.append(timing.compute_us())
        flag = torch.zeros(1, device=device)
        dist.all_reduce(flag)  # the session's own all-reduce, synchronising as .tolist() does
        flag.tolist()
        timing.released()
    assert figures[0] == 0 and figures[1] == 0  # nothing to read yet: one step late
    before, after = figures[4:10], figures[12:]  # step 11's figure is read at step 12
    ratio = min(after) / max(before)
    record(before_us=before, after_us=after, ratio=round(ratio, 2))
    assert 2.0 < ratio < 4.0, (before, after)
