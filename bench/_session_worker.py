"""bench/recovery.py's worker as a ``TrainingSession`` script (``--worker session``).

The same job as tests/e2e/workers/proto_worker.py (one all-reduce per step through a tiny DDP
model, 0.1 s steps, the same audit lines and timing markers), but its state is a model and an
optimizer kept by ``elastic_trainer.TrainingSession`` at its defaults: restored from the
in-memory tier (copied just in time, when a group ends) or the snapshot directory, as a script
written against the README's Python API gets it.

    elastic-train ... bench/_session_worker.py --steps N --step-time S --audit F --markers F
"""

from __future__ import annotations

import time

STARTED_AT = time.time()  # before ``import torch``: bench/recovery.py times the worker start

import argparse  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import elastic_trainer as et  # noqa: E402

IMPORTED_AT = time.time()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--audit", default="", help="append 'step rank world_size time' lines here")
    p.add_argument("--markers", default="", help="append 'name time rank world' lines here")
    return p.parse_args()


def mark(path: str, name: str, at: float, ctx: et.WorkerContext) -> None:
    if path:
        with open(path, "a") as f:
            f.write(f"{name} {at:.3f} {ctx.rank} {ctx.world_size}\n")


def timed(name: str, fn: Callable[..., Any], marks: list[tuple[str, float]]) -> Callable:
    """``fn``, leaving ``(name, its end time)`` in ``marks``: where the session's start goes."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            marks.append((name, time.time()))

    return wrapper


def main() -> None:
    args = parse()
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 4)
    # built before the process group, so its cost counts as worker start, not restore (the
    # first optimizer step of a process imports torch._dynamo unless the warm pool did)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    built = time.time()
    ctx = et.init_worker()
    # the restart path, phase by phase: the script's markers and the session's pieces
    marks = [("began", STARTED_AT), ("imported", IMPORTED_AT), ("optimizer", built)]
    marks.append(("group_ready", time.time()))
    # imported here: a top-level import would make the warm pool preload it whatever it decides
    from elastic_trainer.worker import session as session_module

    marks.append(("session_import", time.time()))
    for name in ("open_memory_tier", "restore_state"):  # a name the session lost: not timed
        if callable(getattr(session_module, name, None)):
            setattr(session_module, name, timed(name, getattr(session_module, name), marks))
    model = DDP(net)  # same parameters as the optimizer's
    marks.append(("ddp", time.time()))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    session = et.TrainingSession(
        {"model": model, "optimizer": optimizer}, context=ctx, max_steps=args.steps
    )
    marks.append(("restored", time.time()))
    for name, at in marks:
        mark(args.markers, name, at, ctx)
    while not session.should_stop:
        torch.nn.functional.mse_loss(model(x), y).backward()  # DDP: the step's all-reduce
        time.sleep(args.step_time)
        optimizer.step()
        optimizer.zero_grad()
        session.step_done()
        if args.audit:
            with open(args.audit, "a") as f:
                f.write(f"{session.step} {ctx.rank} {ctx.world_size} {time.time():.3f}\n")
    session.finish()


if __name__ == "__main__":
    main()
