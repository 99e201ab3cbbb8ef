"""What ``TrainingSession`` itself costs per step at its defaults, timed directly.

Whole-job wall ratios (``snapshot_stall.py --jobs-only``) cannot resolve 1 % on a shared
machine; this times the session's own per-step work where it runs: ``step_done`` (the
all-reduce of its counters, the sampler, the progress record) and the optimizer hooks of
the just-in-time copy (the phase, each step's RNG states), against the training step they
ride on (ResNet-18, one process, a world of one on gloo).

    python bench/session_step_cost.py [--steps 30] [--batch 32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from snapshot_stall import make_trainer

from elastic_trainer.worker.context import WorkerContext, WorkerSettings
from elastic_trainer.worker.session import TrainingSession

WARM_UP = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    trainer = make_trainer(args.batch)
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


if __name__ == "__main__":
    main()
