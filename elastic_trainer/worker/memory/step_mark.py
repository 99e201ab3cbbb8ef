"""Where a CUDA rank's optimizer step stands on the device, not only on the host.

On a GPU, ``optimizer.step()`` returns once its kernels are queued: the host-side phase of
the just-in-time copy (``on_failure.Phase``) then runs ahead of the device. A copy is
consistent only when the step it describes has finished on the device, and it must not
queue behind the work that came after that step: when a peer is lost, that work includes a
collective that never ends (the next step's gradient all-reduce, an NCCL kernel that waits
for the dead peer until the communicator is aborted), and a copy on the training stream would
wait with it.

So the optimizer's post-hook records a CUDA event on the training stream, and a copy reads
the state on a stream of its own, ordered after that event only: it neither waits for
whatever was queued after the step nor reads a step the device has not finished (the copy is
declined then, and storage or another node's copy serves).

A copy the training thread makes after the script raised (a healthy device, most often, a
step or less behind the host) first lets the device finish, for at most ``SETTLE_S``; the
supervisor's request (a peer lost: the stream may never move again) waits for nothing.

The step the host has taken may still be queued when a peer is lost: the host runs ahead
until ``step_done``'s all-reduce, while the device waits in that step's gradient all-reduce.
The device then still holds the state as the step began. The optimizer's pre-hook records a
second event where the step's kernels begin (``begin``): a copy read after the previous
step's end (``reading(before=True)``) describes that state as long as the device has not
reached the step's beginning once the read is over (``began``), and is thrown away otherwise.
Its host side (optimizer counters, learning rates) is the one held at the pre-hook
(``on_failure.Held``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

# How long a copy made on the training thread waits for the device to finish the last step:
# a healthy GPU finishes a step's queued work well within it; a stream stuck behind a dead
# peer never does, and the copy is declined then.
SETTLE_S = 5.0
SETTLE_POLL_S = 0.001


class StepMark:
    """The CUDA events of the optimizer's last step on ``device`` (its beginning and its end,
    and the end of the step before it), and the stream copies use."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)  # a pool stream: non-blocking
        self._end = self._event()  # the state as restored: its copies may still be queued
        self._before: torch.cuda.Event | None = None  # the end of the step before the last
        self._begun: torch.cuda.Event | None = None  # where the last step's kernels begin

    def _event(self) -> torch.cuda.Event:
        # a new event each time: one recorded again would name only its newest point
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def record(self) -> None:
        """At the optimizer's step end (its post-hook), on the stream that ran the step."""
        self._end = self._event()

    def begin(self) -> None:
        """At a step's beginning (the pre-hook of its first optimizer), before its kernels."""
        self._before, self._begun = self._end, self._event()

    def done(self, within_s: float = 0.0) -> bool:
        """Has the device finished the last recorded step, waiting at most ``within_s`` for
        it? (Polled: ``Event.synchronize`` would wait for ever on a stream that never moves
        again.)"""
        deadline = time.monotonic() + within_s
        while not self._end.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(SETTLE_POLL_S)
        return True

    def before_done(self) -> bool:
        """Has the device finished the step before the one that began last?"""
        return self._before is not None and self._before.query()

    def began(self) -> bool:
        """Has the device reached the beginning of the last step (its kernels may run)?"""
        return self._begun is None or self._begun.query()

    @contextlib.contextmanager
    def reading(self, *, before: bool = False) -> Iterator[None]:
        """Inside: tensor copies go on the copy stream, after the last step only (``before``:
        after the step before it)."""
        event = self._before if before else self._end
        if event is None:
            raise RuntimeError("reading(before=True) before any step began")
        self._stream.wait_event(event)
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()


def step_mark_for(optimizers: list[torch.optim.Optimizer]) -> StepMark | None:
    """A mark for the device of the optimizers' parameters when it is a GPU; None on CPU,
    where the optimizer's step is done when it returns."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.device.type == "cuda":
                    return StepMark(param.device)
    return None
