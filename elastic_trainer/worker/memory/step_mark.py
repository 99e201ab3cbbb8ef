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
    """The CUDA event of the optimizer's last step on ``device``, and the stream copies use."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event()
        self._stream = torch.cuda.Stream(device=device)  # a pool stream: non-blocking
        self.record()  # the state as restored: its copies to the device may still be queued

    def record(self) -> None:
        """At the optimizer's step end (its post-hook), on the stream that ran the step."""
        self._event.record(torch.cuda.current_stream(self._device))

    def done(self, within_s: float = 0.0) -> bool:
        """Has the device finished the last recorded step, waiting at most ``within_s`` for
        it? (Polled: ``Event.synchronize`` would wait for ever on a stream that never moves
        again.)"""
        deadline = time.monotonic() + within_s
        while not self._event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(SETTLE_POLL_S)
        return True

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Inside: tensor copies go on the copy stream, after the last step only."""
        self._stream.wait_event(self._event)
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
