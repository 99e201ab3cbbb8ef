"""Model selection by torchvision name, never downloading weights."""

from __future__ import annotations

import pytest
import torch

from elastic_trainer.errors import ConfigError
from elastic_trainer.jobs.models import build_model, check_input_size, logits_of


def test_builds_a_torchvision_model_with_the_requested_classes() -> None:
    model = build_model("resnet18", num_classes=7)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_cifar_stem_replaces_the_resnet_stem() -> None:
    model = build_model("resnet18", num_classes=10, cifar_stem=True)
    assert model.conv1.stride == (1, 1) and isinstance(model.maxpool, torch.nn.Identity)


def test_cifar_stem_rejects_models_without_one() -> None:
    with pytest.raises(ConfigError, match="ResNet"):
        build_model("squeezenet1_1", num_classes=10, cifar_stem=True)


def test_unknown_model_says_how_to_list_valid_names() -> None:
    with pytest.raises(ConfigError) as info:
        build_model("resnet9000", num_classes=10)
    message = str(info.value)
    assert "resnet9000" in message and "list_models" in message and "\n" not in message


def test_detection_models_are_not_classification_models() -> None:
    with pytest.raises(ConfigError):
        build_model("fasterrcnn_resnet50_fpn", num_classes=10)


def test_models_that_cannot_take_32px_inputs_fail_fast() -> None:
    model = build_model("vit_b_32", num_classes=10)
    with pytest.raises(ConfigError, match="32x32") as info:
        check_input_size(model, "vit_b_32", 32)
    assert "\n" not in str(info.value)


def test_googlenet_output_is_plain_logits() -> None:
    model = build_model("googlenet", num_classes=10).train()
    assert logits_of(model(torch.zeros(2, 3, 32, 32))).shape == (2, 10)
