"""``--fsdp``: the built-in job's model sharded with FSDP2 (``fully_shard``).

Each residual block (a ResNet's ``layerN`` children) or each stage of a ``features``
sequence (MobileNet, EfficientNet, VGG...) is its own unit, so that only one unit's full
parameters exist at a time; then the root (stem, head). The parameters become DTensors,
so ``TrainingSession``'s snapshots go sharded on their own: every rank writes its shards,
and a resume at another world size reshards.

Mixed precision: on CUDA with ``--amp``, parameters are gathered in bf16 and gradients
reduced in fp32 (FSDP's own policy, no autocast nor GradScaler); on CPU it is off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def units(model: nn.Module) -> list[nn.Module]:
    """The modules that each become one FSDP unit before the root."""
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    if all(isinstance(s, nn.Sequential) for s in stages):  # ResNet, ResNeXt, Wide ResNet
        return [block for stage in stages for block in stage]  # type: ignore[union-attr]
    features = getattr(model, "features", None)
    if isinstance(features, nn.Sequential):
        return [m for m in features if any(True for _ in m.parameters())]
    return []


def shard(model: nn.Module, device: torch.device, *, amp: bool) -> nn.Module:
    """Collective (the process group must exist): ``model`` sharded in place, returned."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if amp and device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full (gathered) state dict as CPU tensors, on every rank."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    return get_model_state_dict(model, options=options)
