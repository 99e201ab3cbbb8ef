"""This rank's step time, split into compute and waiting in collectives.

In synchronous data parallel training every rank's step takes the same wall time: the fast
ranks wait for the slowest inside a collective. Where they wait depends on the wrapper:

- DDP all-reduces gradients inside ``backward``: a fast rank finishes its last bucket and
  waits until the slowest rank has launched the same bucket. ``DDPWait`` times that with a
  comm hook (torch's own all-reduce hook, timed): the wait of a step is the time from the last
  bucket's launch to the last bucket's completion.
- FSDP2 all-gathers parameters in each sharded module's pre-forward hook: ``FSDPWait``
  brackets that hook with one of ours before it (``prepend``) and one after it. Waits inside
  backward (its re-gathers and reduce-scatters) are not seen, so an FSDP2 straggler's slowdown
  is under-stated (``docs/stragglers.md``).
- The session's own all-reduce at every ``step_done`` (its stop vote): the first collective
  of a step for a model without DDP or FSDP, and timed for every model.

A step's compute is its wall time (between the releases of two ``step_done`` all-reduces)
less those waits: data loading, forward, backward, the optimizer, the script's own work.

On CUDA the host runs ahead of the device, so host clocks say nothing of the device's time:
``Stopwatch.cuda`` marks with CUDA events on the current stream instead (a DDP hook's
completion callback runs on a stream synchronized with the collective's), read once the
session's all-reduce has synchronized the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class Stopwatch:
    """Marks points in time and the seconds between two of them: host ``perf_counter``, or
    CUDA events recorded on the current stream."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return float(end - start)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


class DDPWait:
    """Times DDP's gradient all-reduce with a comm hook: torch's default all-reduce, with the
    last bucket's launch and completion marked. ``take`` returns a step's wait and resets."""

    def __init__(self, stopwatch: Stopwatch) -> None:
        self._stopwatch = stopwatch
        self._launched: Any = None
        self._completed: Any = None

    @classmethod
    def attach(cls, ddp: Any, stopwatch: Stopwatch) -> DDPWait | None:
        """Register on ``ddp``; None when the script registered its own comm hook first
        (DDP allows one; the script's wins and this rank's waits in backward go unseen)."""
        probe = cls(stopwatch)
        # DDP checks a hook's annotations against its own classes: a lambda has none
        hook = lambda state, bucket: probe._hook(state, bucket)  # noqa: E731
        try:
            ddp.register_comm_hook(ddp.process_group, hook)
        except (RuntimeError, ValueError):
            return None
        return probe

    def _hook(self, process_group: Any, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._launched = self._stopwatch.mark()
        self._completed = None

        def completed(future: Any) -> Any:
            self._completed = self._stopwatch.mark()
            return future.value()

        return allreduce_hook(process_group, bucket).then(completed)

    def take(self) -> list[tuple[Any, Any]]:
        launched, completed = self._launched, self._completed
        self._launched = self._completed = None
        return [] if launched is None or completed is None else [(launched, completed)]


class FSDPWait:
    """Times FSDP2's pre-forward hooks (their all-gather waits) on every sharded module."""

    def __init__(self, stopwatch: Stopwatch) -> None:
        self._stopwatch = stopwatch
        self._spans: list[tuple[Any, Any]] = []
        self._open: Any = None

    @classmethod
    def attach(cls, model: Any, stopwatch: Stopwatch) -> FSDPWait | None:
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not sharded:
            return None
        probe = cls(stopwatch)
        for module in sharded:
            module.register_forward_pre_hook(probe._before, prepend=True)
            module.register_forward_pre_hook(probe._after)
        return probe

    def _before(self, *_: Any) -> None:
        self._open = self._stopwatch.mark()

    def _after(self, *_: Any) -> None:
        if self._open is not None:
            self._spans.append((self._open, self._stopwatch.mark()))
            self._open = None

    def take(self) -> list[tuple[Any, Any]]:
        spans, self._spans = self._spans, []
        return spans


def probe_for(model: Any, stopwatch: Stopwatch) -> DDPWait | FSDPWait | None:
    """The wait probe that fits ``model`` (DDP, or a module tree with FSDP2 modules)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return DDPWait.attach(model, stopwatch)
    if isinstance(model, torch.nn.Module):
        return FSDPWait.attach(model, stopwatch)
    return None


Span = tuple[Any, Any]  # two marks of a Stopwatch


class StepTiming:
    """One rank's compute per step: the wall time between two ``released`` calls (the end of
    the session's all-reduce) less the waits the probes saw in between.

    ``compute_us`` is read as ``step_done`` starts (before its all-reduce, into which the
    figure goes), so it counts everything up to that point and no wait in that all-reduce.
    On the host the figure is this step's. On CUDA it is the previous step's: its events
    completed when the previous all-reduce synchronized the stream, and reading this step's
    would stall the host on the device every step.
    """

    def __init__(self, stopwatch: Stopwatch) -> None:
        self.stopwatch = stopwatch
        self._probes: list[Callable[[], list[Span]]] = []
        self._models: set[int] = set()
        self._released: Any = None
        self._pending: tuple[Span, list[Span]] | None = None  # CUDA: read one step later

    def watch(self, model: Any) -> bool:
        """Attach the probe that fits ``model`` once; False when none fits."""
        if id(model) in self._models:
            return True
        self._models.add(id(model))
        probe = probe_for(model, self.stopwatch)
        if probe is not None:
            self._probes.append(probe.take)
        return probe is not None

    def compute_us(self) -> int:
        """A step's compute in µs (0 while there is none to read yet)."""
        waits = [span for take in self._probes for span in take()]
        step = None if self._released is None else (self._released, self.stopwatch.mark())
        if self.stopwatch.cuda:
            ready, self._pending = self._pending, None if step is None else (step, waits)
        else:
            ready = None if step is None else (step, waits)
        if ready is None:
            return 0
        (start, end), spans = ready
        seconds = self.stopwatch.seconds
        compute = seconds(start, end) - sum(max(0.0, seconds(a, b)) for a, b in spans)
        return max(1, round(compute * 1e6))  # 0 means "no figure"

    def released(self) -> None:
        self._released = self.stopwatch.mark()
