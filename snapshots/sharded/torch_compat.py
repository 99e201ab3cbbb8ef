"""The torch APIs the sharded snapshots rely on beyond plain tensors, in one place.

``snapshots`` does not import elastic_trainer, so it keeps its own list, with the same
discipline as ``elastic_trainer/supervisor/torch_compat.py``: each use with the reason, checked
against torch 2.14.1 and 2.15.0, and ``tests/unit/snapshots/sharded/test_torch_compat.py``
asserts that each
still exists, so a torch release that moves one fails a millisecond test, not a job.

One torch *private* piece is used, behind ``save_without_crc32`` below, which falls back to
plain ``torch.save`` when it is gone or changed:

- ``torch._C.PyTorchFileWriter(file, compute_crc32, alignment)`` and
  ``torch.serialization._save``: what ``torch.save`` runs, with two of its settings chosen
  per call instead of through torch's process-wide config (``set_crc32_options``,
  ``config.save.storage_alignment``), which would also change the user's own ``torch.save``
  calls on other threads. See ``save_without_crc32`` for why.

What follows is public but young API (DCP, DTensor) whose behaviour the format depends on:

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

import contextlib
import functools
import importlib
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch

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


# The private pieces behind save_without_crc32 (checked like USED, but a job survives their
# loss: the save falls back to torch.save).
PRIVATE: tuple[tuple[str, str], ...] = (
    ("torch._C", "PyTorchFileWriter"),
    ("torch.serialization", "_save"),
)


def checks() -> dict[str, Callable[[], bool]]:
    """name -> a check that it still exists."""
    return {f"{m}.{a}": (lambda m=m, a=a: _exists(m, a)) for m, a in (*USED, *PRIVATE)}


def save_without_crc32(obj: Any, sink: Any, *, alignment: int) -> None:
    """``torch.save(obj, sink)`` without the zip format's CRC-32 of each record, and with
    each tensor's bytes starting at a file offset that is a multiple of ``alignment``.

    Why: every byte of a snapshot file is hashed (BLAKE3 or sha256) on its way to storage
    and checked before anything is unpickled, so the CRC adds no protection, and torch
    computes it holding the GIL (a pause for the training thread's Python code, in
    proportion to the bytes). ``torch.load`` does not check it (torch documents as much for
    ``set_crc32_options``); only a zip tool's own test would complain. The alignment lets
    the local writer hand large tensors to the disk past the page cache (``O_DIRECT`` needs
    aligned file offsets; torch's default is 64 bytes).

    Where the private pieces are gone or changed, this is plain ``torch.save`` (CRCs and
    torch's alignment: slower, the same snapshot)."""
    if not _private_writer_works():
        torch.save(obj, sink)
        return
    _save_uncrc(obj, sink, alignment)


def _save_uncrc(obj: Any, sink: Any, alignment: int) -> None:
    writer = torch._C.PyTorchFileWriter(sink, False, alignment)
    try:
        torch.serialization._save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # As torch.save's own context does: ending the archive marks the writer finished even
        # when that fails too; a writer destroyed unfinished ends it in its destructor, where
        # a second failure (the sink refusing writes) aborts the process.
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()
    sink.flush()


@functools.cache
def _private_writer_works() -> bool:
    """Tried once, on a throwaway buffer: a torch whose pieces differ gets torch.save."""
    try:
        buf = io.BytesIO()
        _save_uncrc({"probe": torch.zeros(1)}, buf, 4096)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        return bool(torch.equal(loaded["probe"], torch.zeros(1)))
    except Exception:  # any change of signature or behaviour: use the public path
        return False


def _exists(module: str, path: str) -> bool:
    value: object = importlib.import_module(module)
    for part in path.split("."):
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return True
