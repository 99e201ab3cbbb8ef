"""The default job's datasets: deterministic, class-structured, lazily generated, clear errors."""

from __future__ import annotations

import os

import pytest
import torch

from elastic_trainer.errors import DatasetError
from elastic_trainer.jobs.data import (
    IMAGE_SIZE,
    DataSpec,
    SyntheticImages,
    build_datasets,
    pad_crop_flip,
)


def test_synthetic_samples_are_a_pure_function_of_seed_and_index() -> None:
    a = SyntheticImages(50, seed=3, split="train")
    b = SyntheticImages(50, seed=3, split="train")
    for index in (0, 17, 49):
        (xa, ya), (xb, yb) = a[index], b[index]
        assert torch.equal(xa, xb) and ya == yb
    assert a[0][0].shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    other_seed = SyntheticImages(50, seed=4, split="train")
    assert not torch.equal(a[0][0], other_seed[0][0])


def test_train_and_val_splits_differ() -> None:
    train = SyntheticImages(10, seed=0, split="train")
    val = SyntheticImages(10, seed=0, split="val")
    assert not torch.equal(train[0][0], val[0][0])


def test_synthetic_labels_cover_all_classes_roughly_evenly() -> None:
    data = SyntheticImages(2000, seed=0, split="train")
    counts = torch.bincount(torch.tensor([data.label(i) for i in range(len(data))]), minlength=10)
    assert counts.min() > 150 and counts.max() < 250


def test_synthetic_classes_are_learnable_by_template_matching() -> None:
    # Class structure, not noise: correlating with the (shift-free) class templates beats
    # chance by far, though not perfectly (the task must stay non-trivial for a CNN).
    data = SyntheticImages(400, seed=1, split="val")
    templates = data._templates.flatten(1)
    correct = 0
    for i in range(len(data)):
        image, label = data[i]
        # max over circular shifts approximates what convolutions learn
        scores = torch.stack(
            [
                (torch.roll(image, (dy, dx), dims=(1, 2)).flatten() @ templates.T)
                for dy in range(-6, 7, 2)
                for dx in range(-6, 7, 2)
            ]
        ).amax(0)
        correct += int(scores.argmax()) == label
    accuracy = correct / len(data)
    assert 0.3 < accuracy < 0.99


def test_index_out_of_range_raises_index_error() -> None:
    with pytest.raises(IndexError):
        SyntheticImages(5, seed=0, split="train")[5]


def test_augmentation_depends_on_seed_epoch_and_index_only() -> None:
    data = build_datasets(DataSpec(train_samples=20, val_samples=5, seed=7))
    data.train.set_epoch(2)
    first = data.train[3][0]
    torch.manual_seed(12345)  # the global RNG must not leak into the augmentation
    assert torch.equal(data.train[3][0], first)
    data.train.set_epoch(3)
    epochs_differ = any(
        not torch.equal(data.train[i][0], build_augmented_at(2, i)) for i in range(20)
    )
    assert epochs_differ


def build_augmented_at(epoch: int, index: int) -> torch.Tensor:
    data = build_datasets(DataSpec(train_samples=20, val_samples=5, seed=7))
    data.train.set_epoch(epoch)
    return data.train[index][0]


def test_pad_crop_flip_keeps_shape_and_content() -> None:
    image = torch.arange(3 * 8 * 8, dtype=torch.float32).view(3, 8, 8) + 1
    torch.manual_seed(0)
    out, label = pad_crop_flip((image, 4))
    assert out.shape == image.shape and label == 4
    # a crop of the zero-padded image: every non-zero value comes from the original
    assert set(out[out != 0].tolist()) <= set(image.flatten().tolist())


def test_sample_counts_take_a_prefix() -> None:
    data = build_datasets(DataSpec(train_samples=30, val_samples=10))
    assert len(data.train) == 30 and len(data.val) == 10 and data.num_classes == 10


def test_unknown_dataset_is_a_dataset_error() -> None:
    with pytest.raises(DatasetError, match="unknown --dataset"):
        build_datasets(DataSpec(name="mnist"))


def test_cifar10_missing_folder_names_the_fix(tmp_path) -> None:
    with pytest.raises(DatasetError, match="--download") as info:
        build_datasets(DataSpec(name="cifar10", data_dir=str(tmp_path)))
    assert "\n" not in str(info.value)


def test_imagefolder_without_split_folders_names_the_layout(tmp_path) -> None:
    with pytest.raises(DatasetError, match="train/<class>"):
        build_datasets(DataSpec(name="imagefolder", data_dir=str(tmp_path)))


def test_imagefolder_missing_path(tmp_path) -> None:
    with pytest.raises(DatasetError, match="not a folder"):
        build_datasets(DataSpec(name="imagefolder", data_dir=str(tmp_path / "nope")))


def test_imagefolder_with_empty_class_folder(tmp_path) -> None:
    for split in ("train", "val"):
        os.makedirs(tmp_path / split / "cats")
    with pytest.raises(DatasetError, match="no images"):
        build_datasets(DataSpec(name="imagefolder", data_dir=str(tmp_path)))


def test_imagefolder_reads_resizes_and_normalises_images(tmp_path) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for cls, colour in (("cats", (255, 0, 0)), ("dogs", (0, 0, 255))):
            os.makedirs(tmp_path / split / cls)
            for i in range(2):
                Image.new("RGB", (40, 48), colour).save(tmp_path / split / cls / f"{i}.png")
    data = build_datasets(DataSpec(name="imagefolder", data_dir=str(tmp_path)))
    assert data.num_classes == 2 and len(data.train) == 4
    image, label = data.val[3]
    assert image.shape == (3, IMAGE_SIZE, IMAGE_SIZE) and label == 1
    assert image[2].mean() > 1.0 > image[0].mean()  # blue survives normalisation


def test_imagefolder_corrupt_image_is_a_dataset_error(tmp_path) -> None:
    for split in ("train", "val"):
        os.makedirs(tmp_path / split / "cats")
        (tmp_path / split / "cats" / "broken.png").write_bytes(b"not a png")
    data = build_datasets(DataSpec(name="imagefolder", data_dir=str(tmp_path)))
    with pytest.raises(DatasetError, match=r"broken\.png"):
        data.val[0]
