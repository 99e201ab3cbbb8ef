"""The torch APIs the sharded snapshots rely on beyond plain tensors, in one place.

``snapshots`` does not import elastic_trainer, so it keeps its own list, with the same
discipline as ``elastic_trainer/torch_compat.py``: each use with the reason, checked against
torch 2.14.1 and 2.15.0, and ``tests/unit/test_snapshot_torch_compat.py`` asserts that each
still exists, so a torch release that moves one fails a millisecond test, not a job.

No torch *private* name is used today. What follows is public but young API (DCP, DTensor)
whose behaviour the format depends on:

- ``DefaultSavePlanner.create_global_plan``: deduplicates replicated write items, each to
  the rank with the fewest bytes planned so far (``dedup_save_plans``); we compute it on
  every rank from all-gathered local plans, so it must stay deterministic.
- ``DefaultLoadPlanner.set_up_planner/create_local_plan/resolve_tensor/commit_tensor``:
  the reshard geometry (which stored box goes where in which local shard).
- ``torch.distributed.checkpoint.metadata``: Metadata, TensorStorageMetadata,
  ChunkStorageMetadata, TensorProperties, built in memory from our JSON table. DCP's own
  ``.metadata`` file (a pickle) and ``FileSystemReader`` are never used.
- ``torch.distributed.checkpoint.state_dict``: get/set_model_state_dict and
  get/set_optimizer_state_dict for FSDP2 (DTensor) models and their optimizers.
- ``DTensor.placements`` / ``DTensor.device_mesh``: recorded in the table, for people.
- ``DTensor.to_local``: which local shards an overlapped save may copy later (those of the
  optimizer's parameters and state, matched by data pointer).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

TESTED_TORCH = ("2.14", "2.15")

# (module, attribute path) pairs the sharded format uses.
USED: tuple[tuple[str, str], ...] = (
    ("torch.distributed.checkpoint", "DefaultSavePlanner.create_global_plan"),
    ("torch.distributed.checkpoint", "DefaultSavePlanner.create_local_plan"),
    ("torch.distributed.checkpoint", "DefaultSavePlanner.resolve_data"),
    ("torch.distributed.checkpoint", "DefaultLoadPlanner.create_local_plan"),
    ("torch.distributed.checkpoint", "DefaultLoadPlanner.resolve_tensor"),
    ("torch.distributed.checkpoint", "DefaultLoadPlanner.commit_tensor"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.planner", "WriteItemType.BYTE_IO"),
    ("torch.distributed.checkpoint.state_dict", "get_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "set_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "get_optimizer_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "set_optimizer_state_dict"),
    ("torch.distributed.tensor", "DTensor.placements"),
    ("torch.distributed.tensor", "DTensor.device_mesh"),
    ("torch.distributed.tensor", "DTensor.to_local"),
)


def checks() -> dict[str, Callable[[], bool]]:
    """name -> a check that it still exists."""
    return {f"{m}.{a}": (lambda m=m, a=a: _exists(m, a)) for m, a in USED}


def _exists(module: str, path: str) -> bool:
    value: object = importlib.import_module(module)
    for part in path.split("."):
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return True
