"""Datasets for the default job: synthetic (default), CIFAR-10 and a user's ImageFolder.

Every dataset yields ``(image, label)`` with ``image`` a normalised float tensor of shape
``3 x 32 x 32``. Training sets are wrapped in the runtime's ``AugmentedDataset``, whose
pad + crop + flip draws from an RNG seeded by ``(seed, epoch, index)``: the same sample gets
the same augmentation on any rank, at any world size, before or after a restart — a precondition for
bit-identical resumes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import Dataset, Subset

from elastic_trainer.errors import DatasetError
from elastic_trainer.worker.augment import AugmentedDataset

IMAGE_SIZE = 32
NUM_SYNTHETIC_CLASSES = 10
DATASET_NAMES = ("synthetic", "cifar10", "imagefolder")
Split = Literal["train", "val"]

# CIFAR-10 channel statistics; close enough for any natural-image folder too.
_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed (splitmix64): nearby inputs give unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 29
    return state & ((1 << 63) - 1)


# --------------------------------------------------------------------------- synthetic data


def _class_templates(seed: int, num_classes: int) -> torch.Tensor:
    """One smooth colour pattern per class: a few oriented waves plus a class colour."""
    gen = torch.Generator().manual_seed(mix_seed(seed, 0xC1A55))
    coords = torch.linspace(0.0, 1.0, IMAGE_SIZE)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    templates = torch.zeros(num_classes, 3, IMAGE_SIZE, IMAGE_SIZE)
    for c in range(num_classes):
        for _ in range(3):
            freq = 1.0 + 3.0 * torch.rand((), generator=gen)
            angle = math.pi * torch.rand((), generator=gen)
            phase = 2 * math.pi * torch.rand((), generator=gen)
            wave = torch.sin(
                2 * math.pi * freq * (xx * torch.cos(angle) + yy * torch.sin(angle)) + phase
            )
            colour = torch.randn(3, 1, 1, generator=gen)
            templates[c] += colour * wave
        templates[c] = templates[c] / templates[c].std()
        templates[c] += 0.5 * torch.randn(3, 1, 1, generator=gen)
    return templates


class SyntheticImages(Dataset):
    """CIFAR-shaped images with real class structure, generated lazily from ``(seed, index)``.

    A sample is its class template, randomly shifted and scaled, blended with another class's
    template, plus strong per-pixel noise (signal-to-noise about 0.4: accuracy climbs over
    minutes, not seconds). Linear models struggle with the shifts and blends; a small
    CNN learns them in minutes on a CPU. Nothing is stored: memory stays flat at any size and
    every rank computes the same sample for the same index.
    """

    def __init__(self, size: int, *, seed: int, split: Split, noise: float = 2.5) -> None:
        if size <= 0:
            raise DatasetError(f"synthetic {split} set needs at least 1 sample, got {size}")
        self.size = size
        self.seed = seed
        self.noise = noise
        self.num_classes = NUM_SYNTHETIC_CLASSES
        self._split_id = 0 if split == "train" else 1
        self._templates = _class_templates(seed, self.num_classes)

    def __len__(self) -> int:
        return self.size

    def label(self, index: int) -> int:
        return int(mix_seed(self.seed, self._split_id, index, 1) % self.num_classes)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} samples")
        label = self.label(index)
        gen = torch.Generator().manual_seed(mix_seed(self.seed, self._split_id, index, 2))
        shift_y, shift_x = torch.randint(-6, 7, (2,), generator=gen).tolist()
        other = int(torch.randint(0, self.num_classes, (), generator=gen))
        scale, blend = (0.6 + 0.8 * torch.rand(2, generator=gen)).tolist()
        image = scale * torch.roll(self._templates[label], (shift_y, shift_x), dims=(1, 2))
        image = image + 0.5 * blend * self._templates[other]
        image = image + self.noise * torch.randn(image.shape, generator=gen)
        return image, label


# --------------------------------------------------------------------------- augmentation


def pad_crop_flip(sample: tuple[torch.Tensor, int], pad: int = 4) -> tuple[torch.Tensor, int]:
    """Zero-pad by ``pad``, random-crop back to the input size, random horizontal flip.

    Draws from torch's global RNG: ``AugmentedDataset`` seeds it per (seed, epoch, index).
    """
    image, label = sample
    _, height, width = image.shape
    padded = torch.nn.functional.pad(image, (pad, pad, pad, pad))
    top, left = torch.randint(0, 2 * pad + 1, (2,)).tolist()
    out = padded[:, top : top + height, left : left + width]
    if bool(torch.rand(()) < 0.5):
        out = out.flip(-1)
    return out.contiguous(), label


# --------------------------------------------------------------------------- real datasets


def _to_normalised_tensor(image: Any) -> torch.Tensor:
    from torchvision.transforms.functional import pil_to_tensor, resize

    tensor = pil_to_tensor(image.convert("RGB"))
    if tensor.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        tensor = resize(tensor, [IMAGE_SIZE, IMAGE_SIZE], antialias=True)
    return (tensor.float() / 255.0 - _MEAN) / _STD


class _Classified(Dataset):
    """Adapts a torchvision dataset: normalised 32x32 tensors and a ``num_classes``."""

    def __init__(self, base: Any, num_classes: int) -> None:
        self.base = base
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        try:
            image, label = self.base[index]
        except OSError as exc:  # PIL's UnidentifiedImageError, truncated files...
            raise DatasetError(
                f"cannot read sample {index} ({_sample_path(self.base, index)}): {exc}; "
                f"remove or replace that file"
            ) from exc
        return _to_normalised_tensor(image), int(label)


def _sample_path(base: Any, index: int) -> str:
    samples = getattr(base, "samples", None)
    return str(samples[index][0]) if samples else "?"


def _cifar10(data_dir: str, split: Split, download: bool) -> _Classified:
    from torchvision.datasets import CIFAR10

    try:
        base = CIFAR10(data_dir, train=split == "train", download=download)
    except RuntimeError as exc:
        hint = "" if download else ", or add --download to fetch it (about 170 MB)"
        raise DatasetError(
            f"no usable CIFAR-10 in --data-dir {data_dir!r} ({exc}): point --data-dir at the "
            f"folder holding cifar-10-batches-py{hint}"
        ) from exc
    return _Classified(base, num_classes=10)


def _imagefolder_root(data_dir: str, split: Split) -> str:
    nested = os.path.join(data_dir, split)
    if os.path.isdir(nested):
        return nested
    raise DatasetError(
        f"--data-dir {data_dir!r} has no {split}/ folder: lay it out as "
        f"DIR/train/<class>/<image> and DIR/val/<class>/<image>"
    )


def _imagefolder(data_dir: str, split: Split) -> _Classified:
    from torchvision.datasets import ImageFolder

    root = _imagefolder_root(data_dir, split)
    try:
        base = ImageFolder(root)
    except (FileNotFoundError, OSError) as exc:
        raise DatasetError(
            f"no images under {root!r} ({exc}): put one sub-folder of images per class there"
        ) from exc
    return _Classified(base, num_classes=len(base.classes))


# --------------------------------------------------------------------------- entry point


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """What the job asked for; :func:`build_datasets` turns it into train and val sets."""

    name: str = "synthetic"
    data_dir: str | None = None
    download: bool = False
    train_samples: int | None = None
    val_samples: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class Datasets:
    train: AugmentedDataset
    val: Dataset
    num_classes: int


SYNTHETIC_DEFAULT_TRAIN = 10_000
SYNTHETIC_DEFAULT_VAL = 2_000


def _first(dataset: Any, count: int | None) -> Any:
    """The first ``count`` samples (a prefix, so every rank and every restart agrees)."""
    if count is None or count >= len(dataset):
        return dataset
    subset = Subset(dataset, range(count))
    subset.num_classes = dataset.num_classes  # type: ignore[attr-defined]
    return subset


def _real(spec: DataSpec, split: Split) -> Any:
    if not spec.data_dir:
        raise DatasetError(f"--dataset {spec.name} needs --data-dir DIR")
    if spec.name == "cifar10":
        return _cifar10(spec.data_dir, split, spec.download)
    if not os.path.isdir(spec.data_dir):
        raise DatasetError(f"--data-dir {spec.data_dir!r} is not a folder: check the path")
    return _imagefolder(spec.data_dir, split)


def build_datasets(spec: DataSpec) -> Datasets:
    """Build the train (augmented) and validation sets, or raise one-line DatasetError."""
    if spec.name not in DATASET_NAMES:
        raise DatasetError(f"unknown --dataset {spec.name!r}: use one of {DATASET_NAMES}")
    loaders: dict[str, Callable[[Split], Any]] = {
        "synthetic": lambda split: SyntheticImages(
            _synthetic_size(spec, split), seed=spec.seed, split=split
        ),
    }
    make = loaders.get(spec.name, lambda split: _real(spec, split))
    train = _first(make("train"), spec.train_samples)
    val = _first(make("val"), spec.val_samples)
    _check_not_empty(train, "train", spec)
    _check_not_empty(val, "val", spec)
    augmented = AugmentedDataset(train, pad_crop_flip, seed=spec.seed)
    return Datasets(train=augmented, val=val, num_classes=train.num_classes)


def _synthetic_size(spec: DataSpec, split: Split) -> int:
    if split == "train":
        return spec.train_samples or SYNTHETIC_DEFAULT_TRAIN
    return spec.val_samples or SYNTHETIC_DEFAULT_VAL


def _check_not_empty(dataset: Any, split: str, spec: DataSpec) -> None:
    if len(dataset) == 0:
        raise DatasetError(f"the {split} split of --dataset {spec.name} has no samples")
