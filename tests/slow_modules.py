"""Modules that are slow where a test says: in their forward, in their own backward (used by
tests/unit/worker/test_step_timing_fsdp.py and tests/dist/test_stragglers_fsdp.py)."""

from __future__ import annotations

import time
from typing import Any

import torch


class SleepInBackward(torch.autograd.Function):
    """The identity, whose backward sleeps: slowness inside a module's own backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()  # not a view: FSDP2 warns of views among a module's outputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Block(torch.nn.Module):
    """A linear layer and a ReLU that sleep ``forward_s`` in the forward and ``backward_s``
    in their own backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.forward_s = 0.0
        self.backward_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_s:
            time.sleep(self.forward_s)
        y = self.linear(x).relu()
        return SleepInBackward.apply(y, self.backward_s) if self.backward_s else y
