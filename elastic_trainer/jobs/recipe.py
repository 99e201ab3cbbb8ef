"""The training recipe's pure parts: schedule, optimizer, mixed precision, progress, best-k.

The classic distributed CIFAR-10 / ResNet recipe (PyTorch-Ignite's and the tutorials'): SGD
with Nesterov momentum 0.9 and weight decay 1e-4, a linear warm-up then a linear decay of the
learning rate to zero, stepped per optimizer step (not per epoch), so that it is exact at any
resume point.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

MOMENTUM = 0.9
WEIGHT_DECAY = 1e-4


def lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based), as LambdaLR wants.

    Warm-up rises linearly to 1 over ``warmup_steps`` (starting above 0 so step 0 learns);
    then the factor falls linearly, reaching 0 after the last step.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    return max(0.0, (total_steps - step) / decay_steps)


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.SGD:
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------- mixed precision


@dataclass(frozen=True)
class Precision:
    """How forward passes run: bf16 autocast on CPU, fp16 + loss scaling on CUDA, or fp32.

    The GradScaler always exists (disabled without fp16) so that every snapshot has the same
    keys whatever the device; a disabled scaler's state is simply empty.
    """

    device_type: str
    dtype: torch.dtype | None  # None: full precision

    @classmethod
    def choose(cls, device: torch.device, amp: bool) -> Precision:
        if not amp:
            return cls(device.type, None)
        return cls(device.type, torch.float16 if device.type == "cuda" else torch.bfloat16)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device_type, enabled=self.dtype == torch.float16)


# --------------------------------------------------------------------------- progress


@dataclass
class ProgressMeter:
    """Turns completed steps into progress reports at most every ``every_s`` seconds.

    Throughput and ETA come from the steps since the previous report, so a slow first step
    (imports, warm-up) or a restart does not skew them for the rest of the run.
    """

    total_steps: int
    every_s: float
    clock: Callable[[], float] = time.monotonic
    _last_time: float | None = None
    _last_step: int = 0
    _samples: int = 0

    def start(self, step: int) -> None:
        self._last_time, self._last_step, self._samples = self.clock(), step, 0

    def update(
        self, *, step: int, epoch: int, loss: float, lr: float, samples: int, force: bool = False
    ) -> dict[str, Any] | None:
        """Record one step of ``samples`` samples; return the report's fields when one is due."""
        if self._last_time is None:
            self.start(step - 1)
        self._samples += samples
        now = self.clock()
        elapsed = now - (self._last_time or now)
        if not force and elapsed < self.every_s:
            return None
        steps = max(1, step - self._last_step)
        report = {
            "step": step,
            "epoch": epoch,
            "loss": round(loss, 5),
            "lr": lr,
            "samples_per_s": round(self._samples / elapsed, 2) if elapsed > 0 else None,
            "eta_s": round(elapsed / steps * (self.total_steps - step), 1),
        }
        self.start(step)
        return report


# --------------------------------------------------------------------------- best models


@dataclass
class BestModels:
    """The ``keep`` best evaluations (accuracy, then the earlier step wins ties).

    Plain data so it rides in every snapshot: after a restart the job still knows which
    exported files are the best two and which to delete.
    """

    keep: int = 2
    entries: list[dict[str, Any]] = field(default_factory=list)
    # The step of the newest evaluation: a run restored from a snapshot taken at the end of
    # an epoch, before that epoch's evaluation, knows to evaluate first.
    last_evaluated_step: int | None = None

    def offer(self, *, step: int, accuracy: float, path: str) -> tuple[bool, list[str]]:
        """Consider a new evaluation: (export it?, paths of exports that drop out)."""
        if any(e["step"] == step for e in self.entries):
            return False, []  # re-evaluation of the same step after a restart
        ranked = sorted(
            [*self.entries, {"step": step, "accuracy": accuracy, "path": path}],
            key=lambda e: (-e["accuracy"], e["step"]),
        )
        self.entries, dropped = ranked[: self.keep], ranked[self.keep :]
        kept = any(e["step"] == step for e in self.entries)
        return kept, [e["path"] for e in dropped if e["step"] != step]

    def state_dict(self) -> dict[str, Any]:
        return {
            "keep": self.keep,
            "entries": [dict(e) for e in self.entries],
            "last_evaluated_step": self.last_evaluated_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.keep = int(state["keep"])
        self.entries = [dict(e) for e in state["entries"]]
        self.last_evaluated_step = state.get("last_evaluated_step")


def export_name(step: int, accuracy: float) -> str:
    return f"model-step{step:08d}-acc{accuracy:.4f}.pt"


def steps_for(samples: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch: the job drops the ``samples % global_batch_size`` tail."""
    return samples // global_batch_size


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
