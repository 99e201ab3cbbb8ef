"""Any torchvision classification model, by name, with random weights (never downloaded).

The stem is left as torchvision builds it by default. The CIFAR-style stem (3x3 stride-1 first
convolution, no max-pool) that CIFAR recipes use for ResNets keeps 32x32 feature maps in the
first stage and costs about 15x the compute: a few points of accuracy on real CIFAR-10, but no
way to finish the default run in five minutes on a 2-core CPU. ``--cifar-stem`` opts in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elastic_trainer.errors import ConfigError, first_line

_LIST_HINT = (
    "python -c 'import torchvision; print(torchvision.models.list_models("
    "module=torchvision.models))'"
)


def classification_models() -> list[str]:
    """Names torchvision registers as classification models (not detection, video...)."""
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def build_model(name: str, *, num_classes: int, cifar_stem: bool = False) -> nn.Module:
    """Build ``name`` with random weights and ``num_classes`` outputs, or raise ConfigError."""
    import torchvision

    if name not in classification_models():
        raise ConfigError(
            f"unknown --model {name!r}: use a torchvision classification model such as "
            f"resnet18 or mobilenet_v3_small; list them all with {_LIST_HINT}"
        )
    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    if name in ("googlenet", "inception_v3"):
        # The auxiliary heads only exist for ImageNet-sized inputs and change the output type.
        kwargs.update(aux_logits=False, init_weights=True)
    model = torchvision.models.get_model(name, **kwargs)
    if cifar_stem:
        _use_cifar_stem(model, name)
    return model


def _use_cifar_stem(model: nn.Module, name: str) -> None:
    conv = getattr(model, "conv1", None)
    if not isinstance(conv, nn.Conv2d) or not hasattr(model, "maxpool"):
        raise ConfigError(
            f"--cifar-stem only applies to ResNet-style models (conv1 + maxpool), not {name!r}"
        )
    model.conv1 = nn.Conv2d(3, conv.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()


def check_input_size(model: nn.Module, name: str, image_size: int) -> None:
    """Fail fast, with one line, for models that cannot take ``image_size`` inputs."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, image_size, image_size))
    except (RuntimeError, ValueError, AssertionError) as exc:  # torch._assert: ViTs
        first = first_line(str(exc)) or type(exc).__name__
        raise ConfigError(
            f"--model {name!r} cannot take {image_size}x{image_size} images ({first}): "
            f"pick a convolutional model such as resnet18"
        ) from exc
    finally:
        model.train(was_training)


def logits_of(output: Any) -> torch.Tensor:
    """Some torchvision models return named tuples; the logits come first."""
    return output if isinstance(output, torch.Tensor) else output[0]
