"""The built-in job: train an image classifier, fault tolerant and elastic.

This is what ``elastic-train`` runs when no script is given, and the reference example of a
training script on the public worker API. The lines that make it restartable are marked
``# elastic:``; everything else is the classic CIFAR-10 / ResNet recipe.

    python -m elastic_trainer.jobs.default --epochs 1            # one process, no launcher
    elastic-train --min-nodes 1 --max-nodes 4                    # the same job, supervised
    elastic-train --nproc-per-node 2 -- --model mobilenet_v3_small --amp
    elastic-train --nproc-per-node 2 -- --fsdp     # FSDP2: sharded model, sharded snapshots
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ConfigError, ElasticTrainError
from elastic_trainer.jobs import fsdp, recipe
from elastic_trainer.jobs.config import JobConfig, parse_args
from elastic_trainer.jobs.data import IMAGE_SIZE, Datasets, build_datasets
from elastic_trainer.jobs.display import Progress
from elastic_trainer.jobs.evaluation import default_export_dir, evaluate, export_if_best
from elastic_trainer.jobs.models import (
    build_model,
    check_input_size,
    logits_of,
)
from elastic_trainer.worker import failure
from elastic_trainer.worker.plan import batch_plan
from elastic_trainer.worker.progress import STOP_MAX_STEPS


@dataclass
class Trainer:
    """Everything the loop touches; ``state()`` is what every snapshot holds."""

    cfg: JobConfig
    data: Datasets
    model: nn.Module  # the plain module: snapshots stay loadable at any world size
    forward: nn.Module  # the DDP wrapper when world size > 1, else the model (also FSDP's)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: recipe.Precision
    scaler: torch.amp.GradScaler
    best: recipe.BestModels
    device: torch.device
    total_steps: int

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,  # fp16 loss scale; empty when disabled
            "best_models": self.best,
        }


def build(cfg: JobConfig, device: torch.device) -> Trainer:
    """Data, model and optimizer: everything that can fail on bad input fails here."""
    data = build_datasets(cfg.data_spec())
    _check_batch_fits(cfg, len(data.train))
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and every run
    model = build_model(cfg.model, num_classes=data.num_classes, cifar_stem=cfg.cifar_stem)
    check_input_size(model, cfg.model, IMAGE_SIZE)
    model.to(device)
    optimizer, scheduler = _optimization(cfg, model, len(data.train))
    steps_per_epoch = recipe.steps_for(len(data.train), cfg.global_batch_size)
    # --fsdp: FSDP's own mixed-precision policy on CUDA (jobs.fsdp), no autocast nor scaler
    precision = recipe.Precision.choose(device, cfg.amp and not cfg.fsdp)
    return Trainer(
        cfg=cfg,
        data=data,
        model=model,
        forward=model,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=precision,
        scaler=precision.scaler(),
        best=recipe.BestModels(keep=2),
        device=device,
        total_steps=cfg.epochs * steps_per_epoch,
    )


def _optimization(
    cfg: JobConfig, model: nn.Module, train_samples: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = recipe.build_optimizer(model, cfg.lr)
    steps_per_epoch = recipe.steps_for(train_samples, cfg.global_batch_size)
    scheduler = recipe.build_scheduler(
        optimizer,
        warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
        total_steps=cfg.epochs * steps_per_epoch,
    )
    return optimizer, scheduler


def _distribute(t: Trainer, ctx: Any) -> None:
    """DDP when world size > 1; with --fsdp, FSDP2 at every world size (the optimizer is
    made again over the sharded parameters). Collective."""
    if t.cfg.fsdp and dist.is_initialized():
        fsdp.shard(t.model, t.device, amp=t.cfg.amp)
        t.optimizer, t.scheduler = _optimization(t.cfg, t.model, len(t.data.train))
    elif ctx.world_size > 1:
        device_ids = [ctx.device] if ctx.device.type == "cuda" else None
        t.forward = nn.parallel.DistributedDataParallel(t.model, device_ids=device_ids)


def _check_batch_fits(cfg: JobConfig, train_samples: int) -> None:
    if train_samples < cfg.global_batch_size:
        raise ConfigError(
            f"--global-batch-size {cfg.global_batch_size} exceeds the {train_samples} training "
            f"samples: every epoch would be empty; use a smaller batch or more --train-samples"
        )


def train_epoch(t: Trainer, session: Any, loader: DataLoader, progress: Progress) -> None:
    """One epoch (or what is left of it after a restore), one optimizer step at a time."""
    loss_sum, samples = 0.0, 0
    for images, labels in loader:
        images, labels = images.to(t.device), labels.to(t.device)
        with session.accumulate(t.forward), t.precision.autocast():  # elastic: DDP no_sync
            loss = nn.functional.cross_entropy(logits_of(t.forward(images)).float(), labels)
            # elastic: weigh the micro-batch so the update is the global batch's mean
            t.scaler.scale(session.scale_loss(loss, len(labels))).backward()
        loss_sum, samples = loss_sum + loss.item() * len(labels), samples + len(labels)
        if not session.step_ready:  # elastic: more micro-batches in this step
            continue
        lr = t.optimizer.param_groups[0]["lr"]
        t.scaler.step(t.optimizer)
        t.scaler.update()
        t.optimizer.zero_grad(set_to_none=True)
        t.scheduler.step()
        session.step_done()  # elastic: cursor, progress file, stop agreement, snapshots
        stopping = session.should_stop or session.sampler.epoch_done
        progress.step(
            step=session.step,
            epoch=session.epoch,
            loss=loss_sum / max(1, samples),
            lr=lr,
            samples=samples * session.context.world_size,
            force=stopping,
        )
        loss_sum, samples = 0.0, 0
        if session.should_stop:  # elastic: preemption or --max-steps, agreed by all ranks
            return


def evaluate_and_export(t: Trainer, session: Any, rank: int) -> None:
    """Collective: every rank evaluates its shard; rank 0 reports and exports."""
    sharded = fsdp.is_sharded(t.model)
    result = evaluate(
        t.model,
        t.data.val,
        precision=t.precision,
        device=t.device,
        num_workers=t.cfg.num_workers,
        lockstep=sharded,
    )
    t.best.last_evaluated_step = session.step
    weights = fsdp.full_weights(t.model) if sharded else None  # collective
    if rank != 0:
        return
    emit(
        "train.evaluated",
        step=session.step,
        epoch=session.epoch,
        val_loss=round(result.loss, 5),
        val_accuracy=round(result.accuracy, 5),
        val_samples=result.samples,
    )
    directory = default_export_dir(t.cfg.export_dir, session.context.snapshot_dir)
    if directory is None:
        return
    path = export_if_best(
        t.model,
        t.best,
        directory=directory,
        step=session.step,
        accuracy=result.accuracy,
        weights=weights,
        group_access=session.context.settings.snapshot_group_access,
    )
    if path is not None:
        emit(
            "train.model_exported",
            step=session.step,
            path=path,
            val_accuracy=round(result.accuracy, 5),
        )


def run(cfg: JobConfig) -> int:
    from elastic_trainer import ElasticSampler, TrainingSession, WorkerContext, init_worker

    ctx = WorkerContext.from_env()
    t = build(cfg, ctx.device)  # before the process group: bad flags fail fast
    init_worker(ctx)
    _distribute(t, ctx)
    # elastic: a constant global batch whatever the world size (gradient accumulation)
    # drop_last: every step is a full global batch (BatchNorm never sees a 1-sample batch)
    sampler = ElasticSampler(
        t.data.train,
        seed=cfg.seed,
        global_batch_size=cfg.global_batch_size,
        max_micro_batch_size=cfg.max_micro_batch_size,
        drop_last=True,
    )
    # elastic: restores the newest snapshot into these objects, then snapshots every N steps
    session = TrainingSession(
        t.state(), sampler, context=ctx, audit_dir=cfg.sample_log, max_steps=cfg.max_steps
    )
    progress = Progress(
        enabled=ctx.rank == 0,
        total_steps=t.total_steps,
        start_step=session.step,
        every_s=cfg.progress_every_s,
    )
    with session:  # elastic: a final snapshot on the way out (exit code after a preemption)
        if _restored_before_evaluation(t, session, cfg):
            evaluate_and_export(t, session, ctx.rank)
        for epoch in session.epochs(cfg.epochs):
            # elastic: the loader gets its own generator, so creating it mid-epoch after a
            # restore does not draw from the global RNG that the snapshot restored (dropout)
            loader = DataLoader(
                t.data.train,
                batch_size=sampler.micro_batch_size,
                sampler=sampler,
                num_workers=cfg.num_workers,
                generator=torch.Generator().manual_seed(cfg.seed),
            )
            t.model.train()
            train_epoch(t, session, loader, progress)
            preempted = session.stop_reason not in (None, STOP_MAX_STEPS)
            if sampler.epoch_done and not preempted and _evaluation_due(cfg, epoch):
                evaluate_and_export(t, session, ctx.rank)
        progress.close()
    return 0


def _evaluation_due(cfg: JobConfig, epoch: int) -> bool:
    last = epoch + 1 == cfg.epochs
    return last or (epoch + 1) % cfg.eval_every == 0


def _restored_before_evaluation(t: Trainer, session: Any, cfg: JobConfig) -> bool:
    """A snapshot taken on an epoch's last step precedes that epoch's evaluation."""
    sampler = session.sampler
    return (
        session.restored_step is not None
        and sampler.epoch_done
        and _evaluation_due(cfg, sampler.epoch)
        and t.best.last_evaluated_step != session.step
    )


def preflight(argv: Sequence[str], world_sizes: Sequence[int] = (1,)) -> list[str]:
    """Check flags, model and dataset without training (no process group), for every world
    size the job may run at. The supervisor calls it before any worker starts (see
    ``elastic_trainer.supervisor.cli.preflight``): a typo is one line and exit 2, not a crash in
    every worker. Raises ConfigError for what cannot work; returns warnings for world sizes
    the job may reach but cannot train at."""
    cfg = parse_args(argv)
    model = build_model(cfg.model, num_classes=10, cifar_stem=cfg.cifar_stem)
    check_input_size(model, cfg.model, IMAGE_SIZE)  # ViTs, Inception: refused here
    data = build_datasets(cfg.data_spec())
    _check_batch_fits(cfg, len(data.train))
    first, *later = sorted(set(world_sizes))
    batch_plan(cfg.global_batch_size, first, cfg.max_micro_batch_size)  # raises: cannot start
    return [_world_size_warning(cfg, w) for w in later if cfg.global_batch_size % w]


def _world_size_warning(cfg: JobConfig, world_size: int) -> str:
    return (
        f"--global-batch-size {cfg.global_batch_size} is not divisible by world size "
        f"{world_size}, which the node range allows: the job will stop with exit 2 if it "
        "re-forms at that size; use a batch every reachable world size divides"
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    except ElasticTrainError as exc:
        return failure.refuse(exc)


if __name__ == "__main__":
    sys.exit(main())
