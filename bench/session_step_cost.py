"""What ``TrainingSession`` itself costs per step at its defaults, timed directly.

Whole-job wall ratios (``snapshot_stall.py --jobs-only``) cannot resolve 1 % on a shared
machine; this times the session's own per-step work where it runs: ``step_done`` (the
all-reduce of its counters, the sampler, the progress record) and the optimizer hooks of
the just-in-time copy (the phase, each step's RNG states), against the training step they
ride on (ResNet-18, one process, a world of one).

On a GPU the optimizer's pre-hook also holds the host's side of the state (``held``: the
optimizers' and schedulers' state dicts, CPU tensors cloned) for a copy of a step the device
has not begun; on a CPU nothing is held. ``--hold`` times that work on this host with the
tensors on the meta device (what a GPU's are to it: referenced, never copied), for ResNet-18
with SGD and AdamW and for 1000 parameter tensors (a large transformer's count) with AdamW.

Then the whole loop, side by side: blocks of ``--steps`` steps of a trainer with a session
and of an identical trainer with none (fault tolerance off), interleaved, each block
timed from a synchronised start to a synchronised end. On a GPU this is the figure that
counts: a per-step host-side cost that forced a device synchronisation would stall the
queue of kernels, which the per-call timings above cannot see.

    python bench/session_step_cost.py [--steps 30] [--batch 32] [--blocks 5]
    python bench/session_step_cost.py --steps 10 --blocks 200   # a 90% interval within 1%
    python bench/session_step_cost.py --device cuda --batch 128 --image 224
    python bench/session_step_cost.py --hold
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from snapshot_stall import Trainer, make_trainer

from elastic_trainer.worker.context import WorkerContext, WorkerSettings
from elastic_trainer.worker.session import TrainingSession

WARM_UP = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image", type=int, default=32, help="input height and width")
    parser.add_argument("--blocks", type=int, default=5, help="interleaved blocks per arm")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--hold", action="store_true", help="time the GPU's pre-step hold only")
    args = parser.parse_args()
    if args.hold:
        hold_costs()
        return
    trainer = make_trainer(args.batch, args.device, args.image)
    bare = make_trainer(args.batch, args.device, args.image)
    folder = tempfile.mkdtemp(prefix="session-step-cost-")
    memory = tempfile.mkdtemp(prefix="session-step-cost-", dir="/dev/shm")
    os.makedirs(os.path.join(folder, "control"))
    settings = WorkerSettings(control_dir=os.path.join(folder, "control"), memory_dir=memory)
    session = TrainingSession(
        {"model": trainer.model, "optimizer": trainer.opt},
        context=WorkerContext(settings=settings),
        snapshot_dir=os.path.join(folder, "snapshots"),
        snapshot_every=10**9,  # storage snapshots are measured by snapshot_stall.py
        configure_logs=False,
    )
    # The just-in-time copy's optimizer hooks also run inside trainer.step() (the step time
    # includes them); they are timed here a second time on their own, so the total below
    # counts them twice: an upper bound.
    hooks = session._on_failure
    steps, done, hooked = [], [], []
    try:
        for i in range(WARM_UP + args.steps):
            began = time.perf_counter()
            trainer.step()
            stepped = time.perf_counter()
            session.step_done()
            ended = time.perf_counter()
            if hooks is not None:
                hooks._entering()
                hooks._stepped()
                hooks.counted()
            if i >= WARM_UP:
                steps.append(stepped - began)
                done.append(ended - stepped)
                hooked.append(time.perf_counter() - ended)
        with_session, without = whole_loops(trainer, session, bare, args.steps, args.blocks)
    finally:
        session.close(ended=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    step_ms = sum(steps) / len(steps) * 1e3
    done_us = sorted(done)[len(done) // 2] * 1e6
    hooks_us = sorted(hooked)[len(hooked) // 2] * 1e6
    print(f"training step (mean)          {step_ms:10.1f} ms")
    print(f"step_done (median)            {done_us:10.0f} us   {done_us / 1e3 / step_ms:8.3%}")
    print(f"optimizer hooks (median)      {hooks_us:10.0f} us   {hooks_us / 1e3 / step_ms:8.3%}")
    total = (done_us + hooks_us) / 1e3
    print(f"session per step (at most)    {total * 1e3:10.0f} us   {total / step_ms:8.3%}")
    on, off = statistics.median(with_session), statistics.median(without)
    print(f"device                        {args.device}")
    per_step = off / args.steps * 1e3
    print(
        f"whole loop, no session        {per_step:10.2f} ms/step (median of {args.blocks} blocks)"
    )
    print(f"whole loop, session defaults  {on / args.steps * 1e3:10.2f} ms/step")
    print(f"ratio defaults / off          {on / off:10.3f}x")
    pairs = sorted(a / b for a, b in zip(with_session, without, strict=True))
    print(f"  block by block              {pairs[0]:10.3f}x .. {pairs[-1]:.3f}x")
    mean, low, high = paired_interval(with_session, without)
    print(f"  paired, geometric mean      {mean:10.3f}x, 90% interval {low:.3f}x .. {high:.3f}x")


def paired_interval(
    runs: list[float], base: list[float], resamples: int = 4000
) -> tuple[float, float, float]:
    """The geometric mean of the block-by-block ratios ``runs[i] / base[i]`` and a 90 %
    bootstrap interval of it (its upper end bounds the ratio with 95 % confidence). Each
    pair ran back to back, so a slow spell of the shared machine slows both and cancels in
    the ratio, which the ratio of the two medians does not do."""
    logs = [math.log(a / b) for a, b in zip(runs, base, strict=True)]
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    low, high = means[resamples // 20], means[-resamples // 20 - 1]
    return math.exp(statistics.fmean(logs)), math.exp(low), math.exp(high)


def whole_loops(
    trainer: Trainer, session: TrainingSession, bare: Trainer, steps: int, blocks: int
) -> tuple[list[float], list[float]]:
    """Seconds per block of ``steps`` steps, with the session and without one, alternating
    which arm goes first."""

    def block(t: Trainer, done: Callable[[], None] | None) -> float:
        synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            t.step()
            if done is not None:
                done()
        synchronize()
        return time.perf_counter() - began

    block(bare, None)  # the bare trainer's first steps warm its allocator
    with_session, without = [], []
    for i in range(blocks):
        arms = [(trainer, session.step_done, with_session), (bare, None, without)]
        for t, done, out in arms if i % 2 == 0 else arms[::-1]:
            out.append(block(t, done))
    return with_session, without


def hold_costs(repeats: int = 200) -> None:
    """Median host time of the pre-step hold, the state's tensors on the meta device."""
    import torchvision
    from torch import nn

    from elastic_trainer.worker.memory.held import held_state

    models = {
        "ResNet-18": lambda: torchvision.models.resnet18(num_classes=10),
        "1000 tensors": lambda: nn.Sequential(*[nn.Linear(8, 8) for _ in range(500)]),
    }
    optimizers = {
        "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "AdamW": lambda p: torch.optim.AdamW(p, lr=0.1),
    }
    for model_name, make_model in models.items():
        for optimizer_name, make_optimizer in optimizers.items():
            model = make_model().to("meta")
            optimizer = make_optimizer(model.parameters())
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 100)
            for param in model.parameters():
                param.grad = torch.zeros_like(param)
            optimizer.step()  # its state exists (AdamW: a CPU step counter per tensor)
            scheduler.step()
            state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
            times = []
            for _ in range(repeats):
                began = time.perf_counter()
                held_state(state)
                times.append(time.perf_counter() - began)
            tensors = sum(1 for _ in model.parameters())
            median_us = statistics.median(times) * 1e6
            name = f"{model_name} {optimizer_name}"
            print(f"hold {name:26} {tensors:5} tensors {median_us:8.0f} us")


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
