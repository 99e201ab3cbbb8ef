"""Evaluation reduced over all ranks, and the best-model exports next to the snapshots."""

from __future__ import annotations

import contextlib
import math
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from elastic_trainer.jobs.models import logits_of
from elastic_trainer.jobs.recipe import BestModels, Precision, eval_mode, export_name
from snapshots.storage.modes import create_file, make_folder, modes_for

EVAL_BATCH = 256
EXPORT_GLOB = "model-step*.pt"


@dataclass(frozen=True)
class Evaluation:
    loss: float
    accuracy: float
    samples: int


def rank_shard(dataset: Dataset, rank: int, world_size: int) -> Subset:
    """Every ``world_size``-th sample from ``rank``: the shards cover the set exactly once."""
    return Subset(dataset, range(rank, len(dataset), world_size))  # type: ignore[arg-type]


def evaluate(
    model: nn.Module,
    dataset: Dataset,
    *,
    precision: Precision,
    device: torch.device,
    num_workers: int = 0,
    lockstep: bool = False,
) -> Evaluation:
    """Loss and accuracy over the whole ``dataset``, each rank taking its shard.
    ``lockstep``: every rank runs the same number of forwards (FSDP)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    loader = DataLoader(
        rank_shard(dataset, rank, world), batch_size=EVAL_BATCH, num_workers=num_workers
    )
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    batches = 0
    with eval_mode(model):
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            with precision.autocast():
                logits = logits_of(model(images)).float()
            totals[0] += nn.functional.cross_entropy(logits, labels, reduction="sum")
            totals[1] += (logits.argmax(dim=1) == labels).sum()
            totals[2] += labels.numel()
            batches += 1
        if lockstep and batches:
            # FSDP all-gathers parameters in every forward: every rank must run as many
            # forwards as the rank with the largest shard (extra ones are not counted)
            for _ in range(_most_batches(len(dataset), world) - batches):  # type: ignore[arg-type]
                model(images)
    if world > 1:
        dist.all_reduce(totals)
    count = max(1.0, totals[2].item())
    return Evaluation(totals[0].item() / count, totals[1].item() / count, int(totals[2].item()))


def _most_batches(samples: int, world: int) -> int:
    return math.ceil(math.ceil(samples / world) / EVAL_BATCH)


def plain_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A state_dict of CPU tensors only: ``torch.load(path, weights_only=True)`` reads it."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _filesystem(directory: str) -> tuple[Any, str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(directory)
    return fs, path


def export_if_best(
    model: nn.Module,
    best: BestModels,
    *,
    directory: str,
    step: int,
    accuracy: float,
    weights: dict[str, torch.Tensor] | None = None,
    group_access: bool = False,
) -> str | None:
    """Write the model if it is among the best ``best.keep``, then delete every other export.
    On local disk the folder is made 0700 and each export 0600 (0750/0640 with
    ``group_access``), whatever the umask, as snapshots are (``snapshots.storage.modes``).

    Written under a temporary name and renamed, so a reader never sees half a file. The sweep
    also removes exports of steps that a restart rolled back. ``weights``: what to write
    instead of the model's own state dict (an FSDP model's gathered weights). Returns the
    exported path (a path or URL in ``directory``), or None.
    """
    target = directory.rstrip("/") + "/" + export_name(step, accuracy)
    keep, _ = best.offer(step=step, accuracy=accuracy, path=target)
    fs, root = _filesystem(directory)
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    modes = modes_for(group_access)
    if local and not os.path.isdir(root):
        os.makedirs(os.path.dirname(root.rstrip("/")) or ".", exist_ok=True)
        with contextlib.suppress(FileExistsError):  # made meanwhile: its mode stands
            make_folder(root, modes.folder)
    fs.makedirs(root, exist_ok=True)
    if keep:
        path = root.rstrip("/") + "/" + export_name(step, accuracy)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        saved = weights if weights is not None else plain_weights(model)
        if local:
            with os.fdopen(create_file(tmp, os.O_WRONLY, modes.file), "wb") as handle:
                torch.save(saved, handle)
        else:
            with fs.open(tmp, "wb") as handle:
                torch.save(saved, handle)
        fs.mv(tmp, path)
    wanted = {e["path"].rstrip("/").rsplit("/", 1)[-1] for e in best.entries}
    for path in fs.glob(root.rstrip("/") + "/" + EXPORT_GLOB):
        if path.rstrip("/").rsplit("/", 1)[-1] not in wanted:
            fs.rm(path)
    return target if keep else None


def default_export_dir(export_dir: str | None, snapshot_dir: str | None) -> str | None:
    if export_dir:
        return export_dir
    if snapshot_dir:
        return (
            snapshot_dir.rstrip("/") + "/best"
            if "://" in snapshot_dir
            else os.path.join(snapshot_dir, "best")
        )
    return None
