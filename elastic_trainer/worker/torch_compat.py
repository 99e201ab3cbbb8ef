"""The torch internals a worker uses beyond torch's public API, each guarded: a release that
moves one loses what it measures, never the job.

Checked against torch 2.14.1 and 2.15.0 (``TESTED_TORCH``);
``tests/unit/worker/test_torch_compat.py`` asserts that each still exists, so a release that
moves one fails a millisecond test.

- ``torch.autograd.Variable._execution_engine.queue_callback``: runs a function once the
  backward pass in progress has ended, after the callbacks queued before it (DDP and FSDP2
  queue their end-of-backward work with it). ``step_timing.FSDPWait`` brackets FSDP2's final
  callback with two of its own, one queued before it and one after: on CUDA that callback is
  where the compute stream waits for the last reduce-scatter, i.e. for the slowest rank.
  torch has no public way to run code at the end of a backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TESTED_TORCH = ("2.14", "2.15")


def _queue_callback() -> Callable[[Callable[[], None]], None] | None:
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    return queue if callable(queue) else None


def queue_backward_callback(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward pass in progress ends, after the callbacks queued
    so far. False, and nothing queued, where torch no longer offers it or no backward pass
    is running."""
    queue = _queue_callback()
    if queue is None:
        return False
    try:
        queue(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    return True


def checks() -> dict[str, Callable[[], bool]]:
    """Each internal this module uses, by name: True while torch still has it."""
    return {"Variable._execution_engine.queue_callback": lambda: _queue_callback() is not None}
