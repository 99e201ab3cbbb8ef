"""The default job's flags -> a validated, keyword-only JobConfig.

Every bad value is one line naming the flag, the value and the fix (ConfigError, exit 2);
argparse's own usage dump is replaced by that line too.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastic_trainer.cliparse import OneLineParser
from elastic_trainer.contract.settings import SWITCH, add_flags, declared, option, resolve
from elastic_trainer.errors import ConfigError
from elastic_trainer.jobs.data import (
    DATASET_NAMES,
    SYNTHETIC_DEFAULT_TRAIN,
    SYNTHETIC_DEFAULT_VAL,
    DataSpec,
)


def _job(default: Any, *flags: str, **how: Any) -> Any:
    """A job flag: read from the command line only (no environment variable)."""
    return option(default, *flags, own_env=False, **how)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The built-in job's settings; each field declares its flag (``contract.settings``).
    The defaults are sized for a few minutes on a 2-core CPU (docs/built-in-job.md)."""

    model: str = _job(
        "resnet18", "--model", metavar="NAME", help="torchvision classification model"
    )
    cifar_stem: bool = _job(
        False,
        "--cifar-stem",
        kind=SWITCH,
        help="ResNets only: CIFAR-style 3x3 stride-1 stem, no max-pool",
    )
    dataset: str = _job("synthetic", "--dataset", metavar="NAME", help=", ".join(DATASET_NAMES))
    data_dir: str | None = _job(
        None,
        "--data-dir",
        metavar="DIR",
        shown="none",
        help="dataset folder (cifar10, imagefolder)",
    )
    download: bool = _job(False, "--download", kind=SWITCH, help="download CIFAR-10 if missing")
    train_samples: int | None = _job(  # None: synthetic default, whole real dataset
        None,
        "--train-samples",
        parse=int,
        metavar="N",
        shown=f"{SYNTHETIC_DEFAULT_TRAIN} for synthetic; everything for real data",
        help="use the first N training samples",
    )
    val_samples: int | None = _job(
        None,
        "--val-samples",
        parse=int,
        metavar="N",
        shown=f"{SYNTHETIC_DEFAULT_VAL} for synthetic; everything for real data",
        help="use the first N validation samples",
    )
    global_batch_size: int = _job(
        48,  # divides every world size of the quick start (1-4 nodes)
        "--global-batch-size",
        parse=int,
        metavar="B",
        help="samples per optimizer step at any world size",
    )
    max_micro_batch_size: int | None = _job(
        None,
        "--max-micro-batch-size",
        parse=int,
        metavar="M",
        shown="B/W",
        help="cap per forward pass (gradient accumulation above it)",
    )
    epochs: int = _job(4, "--epochs", parse=int, metavar="E", help="passes over the training set")
    max_steps: int | None = _job(
        None,
        "--max-steps",
        parse=int,
        metavar="S",
        shown="none",
        help="stop (with a snapshot) after this optimizer step",
    )
    eval_every: int = _job(
        1, "--eval-every", parse=int, metavar="K", help="evaluate every K epochs"
    )
    lr: float = _job(0.1, "--lr", parse=float, metavar="LR", help="peak learning rate")
    warmup_epochs: float = _job(
        1.0,
        "--warmup-epochs",
        parse=float,
        metavar="W",
        help="epochs until the peak learning rate",
    )
    amp: bool = _job(False, "--amp", kind=SWITCH, help="bf16 on CPU, fp16 + GradScaler on CUDA")
    fsdp: bool = _job(
        False,
        "--fsdp",
        kind=SWITCH,
        help="shard the model with FSDP2 (one unit per residual block or stage, then the root)",
    )
    seed: int = _job(0, "--seed", parse=int, metavar="S", help="the seed everything derives from")
    sample_log: str | None = _job(
        None,
        "--sample-log",
        metavar="DIR",
        shown="none",
        help="write the sampler's audit log here",
    )
    num_workers: int = _job(
        0, "--num-workers", parse=int, metavar="N", help="DataLoader worker processes"
    )
    export_dir: str | None = _job(
        None,
        "--export-dir",
        metavar="DIR",
        shown="best/ in the snapshot folder",
        help="best-model folder",
    )
    progress_every_s: float = _job(
        10.0,
        "--progress-every",
        parse=float,
        metavar="S",
        help="seconds between train.progress events",
    )

    def __post_init__(self) -> None:
        _at_least(1, global_batch_size=self.global_batch_size, epochs=self.epochs)
        _at_least(1, eval_every=self.eval_every)
        _at_least(0, num_workers=self.num_workers)
        _at_least_optional(1, train_samples=self.train_samples, val_samples=self.val_samples)
        _at_least_optional(1, max_steps=self.max_steps)
        _at_least_optional(1, max_micro_batch_size=self.max_micro_batch_size)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr {self.lr} must be a finite number > 0, e.g. --lr 0.1")
        if not (math.isfinite(self.progress_every_s) and self.progress_every_s > 0):
            raise ConfigError(f"--progress-every {self.progress_every_s} must be > 0 seconds")
        if not 0 <= self.warmup_epochs <= self.epochs:
            raise ConfigError(
                f"--warmup-epochs {self.warmup_epochs} must lie in [0, --epochs {self.epochs}]"
            )
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"--dataset {self.dataset!r} is not one of {DATASET_NAMES}")
        if self.dataset != "synthetic" and not self.data_dir:
            raise ConfigError(f"--dataset {self.dataset} needs --data-dir DIR")

    def data_spec(self) -> DataSpec:
        return DataSpec(
            name=self.dataset,
            data_dir=self.data_dir,
            download=self.download,
            train_samples=self.train_samples,
            val_samples=self.val_samples,
            seed=self.seed,
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(minimum: int, **values: int) -> None:
    for name, value in values.items():
        if value < minimum:
            raise ConfigError(f"{_flag(name)} {value} must be >= {minimum}")


def _at_least_optional(minimum: int, **values: int | None) -> None:
    _at_least(minimum, **{k: v for k, v in values.items() if v is not None})


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m elastic_trainer.jobs.default",
        description="The built-in elastic-train job: an image classifier, fault tolerant.",
    )
    add_flags(p, declared(JobConfig).values())
    return p


def parse_args(argv: Sequence[str] | None = None) -> JobConfig:
    """Parse and validate; raises ConfigError with one line on any bad value."""
    ns = build_parser().parse_args(argv)
    return JobConfig(**{name: resolve(ns, {}, how) for name, how in declared(JobConfig).items()})
