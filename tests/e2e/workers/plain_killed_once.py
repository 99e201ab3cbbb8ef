"""An unmodified single-process training script: no imports from elastic_trainer, no
progress reports, no checkpoints (every attempt starts again from step 0).

It makes ``--steps`` optimizer steps of ``--step-time`` seconds each; on the first attempt
(``--marker`` absent) it SIGKILLs itself once at step ``--die-at``, so that the steps
before it are redone by the next attempt and the supervisor cannot know how many.
"""

import argparse
import os
import signal
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--marker", default="")
    args = p.parse_args()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        if step == args.die_at and args.marker and not os.path.exists(args.marker):
            open(args.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        time.sleep(args.step_time)


if __name__ == "__main__":
    main()
