"""The built-in job (run it with --fsdp), plus a probe for tests/e2e/test_fsdp_job.py: right
after a restore, the full (gathered) model state is written by rank 0 to
``$FSDP_PROBE_DIR/resumed-<step>.pt``."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

import elastic_trainer
from elastic_trainer.jobs import default, fsdp


class ProbedSession(elastic_trainer.TrainingSession):
    def __init__(self, state: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(state, *args, **kwargs)
        if self.restored_step is None:
            return
        weights = fsdp.full_weights(state["model"])  # collective
        if self.context.rank == 0:
            path = os.path.join(os.environ["FSDP_PROBE_DIR"], f"resumed-{self.restored_step}.pt")
            torch.save(weights, path)


elastic_trainer.TrainingSession = ProbedSession  # type: ignore[misc]

if __name__ == "__main__":
    sys.exit(default.main(sys.argv[1:]))
