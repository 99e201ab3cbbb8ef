"""A tiny elastic-train worker for the Slurm test with the real supervisor.

Trains a 4->1 linear model through ``TrainingSession`` (restore, progress, coordinated stop,
final snapshot) and appends one line per step to ``OUT/steps.jsonl`` (rank 0):
``{"step", "restored_step", "restart"}``. Runs until ``DONE`` exists.
Usage: store_slurm_worker.py OUT DONE
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import elastic_trainer as et

STEP_S = 0.05  # paces the loop on a 2-core machine; not a synchronisation


def main(out: str, done: str) -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = et.TrainingSession({"model": model, "optimizer": optimizer})
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    while not os.path.exists(done):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        session.step_done()
        if session.context.rank == 0:
            record = {"step": session.step, "restored_step": session.restored_step}
            with open(os.path.join(out, "steps.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps({**record, "restart": restart}) + "\n")
        if session.should_stop:
            break
        time.sleep(STEP_S)
    return session.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
