"""State trees of DTensor (FSDP2) models and optimizers, the supported way.

A module whose parameters are DTensors is read with ``get_model_state_dict`` and restored
with ``set_model_state_dict``; an optimizer over such parameters with
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (keys are parameter names, not
ids, so they mean the same at any world size). Everything else goes through its own
``state_dict`` / ``load_state_dict``, as in format 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from snapshots.errors import SnapshotError, UnsafeStateError
from snapshots.format import sharding
from snapshots.format.serialization import is_stateful
from snapshots.format.sharding import ShardTable
from snapshots.sharded import shards


def is_sharded_module(value: Any) -> bool:
    return isinstance(value, torch.nn.Module) and any(
        isinstance(p, DTensor) for p in value.parameters()
    )


def has_dtensors(state: Mapping[str, Any]) -> bool:
    return any(is_sharded_module(v) for v in state.values())


def _owner(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> torch.nn.Module | None:
    """The DTensor module in ``state`` that owns the optimizer's parameters, if any."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for value in state.values():
        if is_sharded_module(value) and any(id(p) in params for p in value.parameters()):
            return value
    if any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        raise UnsafeStateError(
            "an optimizer over DTensor parameters needs its model in the same state "
            "(pass {'model': model, 'optimizer': optimizer})"
        )
    return None


def tree_of(key: str, state: Mapping[str, Any]) -> Any:
    """The state tree of ``state[key]``: FSDP2 models and optimizers the supported way."""
    value = state[key]
    if is_sharded_module(value):
        return get_model_state_dict(value)
    if isinstance(value, torch.optim.Optimizer):
        model = _owner(value, state)
        if model is not None:
            return get_optimizer_state_dict(model, value)
    return value.state_dict() if is_stateful(value) else value


def split_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(skeletons by key, every tensor by fqn) of a state mapping."""
    skeletons: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key in state:
        if not isinstance(key, str):
            raise UnsafeStateError(f"state keys must be str, got {key!r}")
        skeletons[key], found = sharding.split(tree_of(key, state), (key,))
        tensors.update(found)
    return skeletons, tensors


def templates_for(into: Mapping[str, Any] | None) -> shards.TemplateFn:
    """Local shards to read into: this rank's current DTensors for the FSDP2 entries of
    ``into`` (only their overlapping chunks are read); other tensors are read whole."""

    def templates(table: ShardTable, skeleton: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key in into or {}:
            if key in skeleton and _needs_template(key, into or {}):
                _, found = sharding.split(tree_of(key, into or {}), (key,))
                out.update({n: t for n, t in found.items() if isinstance(t, DTensor)})
        return out

    return templates


def _needs_template(key: str, into: Mapping[str, Any]) -> bool:
    value = into[key]
    if is_sharded_module(value):
        return True
    return isinstance(value, torch.optim.Optimizer) and _owner(value, into) is not None


def restore(into: Mapping[str, Any], state: Mapping[str, Any], *, step: int) -> None:
    """Restore every Stateful of ``into``; RNG states last (loading may draw)."""
    from snapshots.format.rng import RNGState

    targets = [k for k, v in into.items() if is_stateful(v)]
    targets.sort(key=lambda k: isinstance(into[k], RNGState))
    for key in targets:
        if key not in state:
            raise SnapshotError(
                f"snapshot of step {step} has no entry {key!r} (it has {sorted(state)}); "
                "restore only entries that were saved"
            )
        _restore_one(key, into, state[key])


def _restore_one(key: str, into: Mapping[str, Any], value: Any) -> None:
    target = into[key]
    if is_sharded_module(target):
        set_model_state_dict(target, value)
        return
    if isinstance(target, torch.optim.Optimizer):
        model = _owner(target, into)
        if model is not None:
            set_optimizer_state_dict(model, target, value)
            return
    target.load_state_dict(value)
