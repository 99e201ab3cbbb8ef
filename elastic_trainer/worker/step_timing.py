"""This rank's step time, split into compute and waiting in collectives.

In synchronous data parallel training every rank's step takes the same wall time: the fast
ranks wait for the slowest inside a collective. Where they wait depends on the wrapper:

- DDP all-reduces gradients inside ``backward``: a fast rank finishes its last bucket and
  waits until the slowest rank has launched the same bucket. ``DDPWait`` times that with a
  comm hook (torch's own all-reduce hook, timed): the wait of a step is the time from the last
  bucket's launch to the last bucket's completion.
- FSDP2 waits inside its own hooks: the all-gather in each sharded module's pre-forward, the
  re-gather of parameters in its pre-backward, the reduce-scatter in its post-backward and,
  on CUDA, the wait for the last reduce-scatter in its end-of-backward callback. ``FSDPWait``
  brackets each of them with hooks of ours just before and just after FSDP's.
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

from elastic_trainer.worker.torch_compat import queue_backward_callback


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
    """Times FSDP2's own hooks on every sharded module, where this rank waits for the others.

    - forward, its pre-forward hook (the all-gather): between a hook of ours just before it
      (``prepend``) and one just after it;
    - backward, the pre-backward hook FSDP puts on the module's outputs (the re-gather of
      parameters resharded after forward): from a hook of ours on the same output tensor,
      registered before FSDP's (our forward hook runs before its), to a pre-hook on the
      autograd node that made the tensor (a node's pre-hooks run after its tensors' hooks);
    - backward, the post-backward node FSDP puts between the module's inputs and its forward
      (its reduce-scatter, and the wait for an earlier one): a pre-hook and a hook on that
      node, told apart as the node the inputs gained across FSDP's pre-forward hook;
    - the end of backward, FSDP's final callback (on CUDA where the compute stream waits for
      the last reduce-scatter): callbacks of ours queued just before and after it, where torch
      lets us (``worker.torch_compat``; elsewhere that wait counts as compute).

    Brackets may nest (an inner sharded module's output can be its parent's too): only the
    outermost one is a span, so no wait counts twice. On CUDA FSDP's waits are the compute
    stream's waits for its communication streams, enqueued between two marks of ours on it.
    Not seen: a script that finalizes backward itself (torch 2.15's
    ``set_manual_backward_finalization``) waits for the last reduce-scatter in its own call
    of ``finalize_backward``, which counts as compute.
    """

    def __init__(self, stopwatch: Stopwatch) -> None:
        self._stopwatch = stopwatch
        self._spans: list[tuple[Any, Any]] = []
        self._depth = 0  # brackets open now
        self._open: Any = None  # the outermost one's start
        self._inputs: list[Any] = []  # the input nodes FSDP's pre-forward hook got
        self._final: _Bracket | None = None  # around FSDP's final callback, being queued
        self._in_backward = False

    @classmethod
    def attach(cls, model: Any, stopwatch: Stopwatch) -> FSDPWait | None:
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not sharded:
            return None
        probe = cls(stopwatch)
        for module in sharded:
            module.register_forward_pre_hook(probe._before, prepend=True, with_kwargs=True)
            module.register_forward_pre_hook(probe._after, with_kwargs=True)
            module.register_forward_hook(probe._outputs, prepend=True)
        return probe

    def enter(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self._open = self._stopwatch.mark()

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._spans.append((self._open, self._stopwatch.mark()))

    def _before(self, _module: Any, args: Any, kwargs: Any) -> None:
        self._inputs = _nodes((args, kwargs)) if torch.is_grad_enabled() else []
        self.enter()

    def _after(self, _module: Any, args: Any, kwargs: Any) -> None:
        self.exit()
        inputs, self._inputs = self._inputs, []
        if not torch.is_grad_enabled():
            return
        bracketed: list[Any] = []
        for node in _nodes((args, kwargs)):
            if any(node is seen for seen in inputs + bracketed):
                continue
            bracketed.append(node)  # FSDP's post-backward node: one for all its inputs
            bracket = _Bracket(self)
            node.register_prehook(bracket.open)
            node.register_hook(bracket.close)

    def _outputs(self, _module: Any, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        brackets: list[tuple[Any, _Bracket]] = []
        for tensor in _tensors(output):
            node = tensor.grad_fn
            if node is None:
                continue
            bracket = next((b for n, b in brackets if n is node), None)
            if bracket is None:
                bracket = _Bracket(self)
                brackets.append((node, bracket))
                node.register_prehook(lambda *_, b=bracket: self._pre_backward_ended(b))
            tensor.register_hook(lambda _, b=bracket: self._pre_backward_began(b))

    def _pre_backward_began(self, bracket: _Bracket) -> None:
        if not self._in_backward:  # the pass's first: FSDP's queues its final callback now
            self._in_backward = True
            final = _Bracket(self)
            self._final = final if queue_backward_callback(final.open) else None
        bracket.open()

    def _pre_backward_ended(self, bracket: _Bracket) -> None:
        bracket.close()
        final, self._final = self._final, None
        if final is not None:  # after FSDP's, which its pre-backward hook has queued
            queue_backward_callback(final.close)
            queue_backward_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._in_backward = False

    def take(self) -> list[tuple[Any, Any]]:
        spans, self._spans = self._spans, []
        # a backward that raised leaves brackets open and its callbacks unrun
        self._depth, self._final, self._in_backward = 0, None, False
        return spans


class _Bracket:
    """One of ``FSDPWait``'s brackets: ``close`` counts only after its own ``open``."""

    def __init__(self, probe: FSDPWait) -> None:
        self._probe = probe
        self._opened = False

    def open(self, *_: Any) -> None:
        if not self._opened:
            self._opened = True
            self._probe.enter()

    def close(self, *_: Any) -> None:
        if self._opened:
            self._opened = False
            self._probe.exit()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors that require grad in ``value`` (nested tuples, lists and dicts)."""
    found, stack = [], [value]
    while stack:  # a loop, not recursion: it runs three times per module and step
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


def _nodes(value: Any) -> list[Any]:
    """The autograd nodes that made the tensors in ``value``."""
    return [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]


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
