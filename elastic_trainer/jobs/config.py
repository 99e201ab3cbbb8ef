"""The default job's flags -> a validated, keyword-only JobConfig.

Every bad value is one line naming the flag, the value and the fix (ConfigError, exit 2);
argparse's own usage dump is replaced by that line too.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

from elastic_trainer.cliparse import OneLineParser
from elastic_trainer.errors import ConfigError
from elastic_trainer.jobs.data import (
    DATASET_NAMES,
    SYNTHETIC_DEFAULT_TRAIN,
    SYNTHETIC_DEFAULT_VAL,
    DataSpec,
)

# Sized for a few minutes on a 2-core CPU (docs/built-in-job.md: the default run).
DEFAULT_GLOBAL_BATCH = 48  # divides every world size of the quick start (1-4 nodes)
DEFAULT_EPOCHS = 4
DEFAULT_LR = 0.1


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    model: str = "resnet18"
    cifar_stem: bool = False
    dataset: str = "synthetic"
    data_dir: str | None = None
    download: bool = False
    train_samples: int | None = None  # None: synthetic default, whole real dataset
    val_samples: int | None = None
    global_batch_size: int = DEFAULT_GLOBAL_BATCH
    max_micro_batch_size: int | None = None
    epochs: int = DEFAULT_EPOCHS
    max_steps: int | None = None
    eval_every: int = 1
    lr: float = DEFAULT_LR
    warmup_epochs: float = 1.0
    amp: bool = False
    fsdp: bool = False
    seed: int = 0
    sample_log: str | None = None
    num_workers: int = 0
    export_dir: str | None = None
    progress_every_s: float = 10.0

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
    p.add_argument("--model", default="resnet18", help="torchvision classification model")
    p.add_argument("--cifar-stem", action="store_true", help="3x3 stem, no max-pool (ResNets)")
    p.add_argument("--dataset", default="synthetic", help="synthetic | cifar10 | imagefolder")
    p.add_argument("--data-dir", help="dataset folder (cifar10, imagefolder)")
    p.add_argument("--download", action="store_true", help="download CIFAR-10 if missing")
    p.add_argument("--train-samples", type=int, help=f"default {SYNTHETIC_DEFAULT_TRAIN} synthetic")
    p.add_argument("--val-samples", type=int, help=f"default {SYNTHETIC_DEFAULT_VAL} synthetic")
    p.add_argument("--global-batch-size", type=int, default=DEFAULT_GLOBAL_BATCH)
    p.add_argument("--max-micro-batch-size", type=int, help="cap per forward pass (accumulate)")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    p.add_argument("--max-steps", type=int, help="stop (with a snapshot) after this step")
    p.add_argument("--eval-every", type=int, default=1, help="evaluate every k epochs")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help="peak learning rate")
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--amp", action="store_true", help="bf16 on CPU, fp16 + GradScaler on CUDA")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2 (one unit per residual block or stage, then the root)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-log", metavar="DIR", help="write the sampler's audit log here")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--export-dir", help="best-model folder (default <snapshot-dir>/best)")
    p.add_argument("--progress-every", type=float, default=10.0, dest="progress_every_s")
    return p


def parse_args(argv: Sequence[str] | None = None) -> JobConfig:
    """Parse and validate; raises ConfigError with one line on any bad value."""
    namespace = build_parser().parse_args(argv)
    return JobConfig(**vars(namespace))
