"""The host's side of the state as an optimizer step begins, held for a GPU's just-in-time
copy (``on_failure``, ``step_mark``).

On a GPU the host takes a step (it moves the optimizers' host-side counters, such as Adam's
``step``, and then the learning-rate schedulers) while the device may still wait to begin
it: a copy of the state the device holds then needs the host's side as it was at the
optimizer's pre-hook. What the host moves on at a step is frozen here: the state dicts of
the optimizers and the learning-rate schedulers, with their CPU tensors cloned and their
device tensors referenced (the device has not changed them yet, ``step_mark.began`` tells),
and the plain values of the state (the sampler's position, the session's counters). Other
Statefuls (modules: their tensors are the device's; a ``GradScaler``: its scale is a device
tensor, and reading it synchronises) are read when the copy is made.

Only where the device can fall behind the host (``on_failure`` holds on a GPU only): on a
CPU the optimizer's step is done when it returns and nothing is held.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from snapshots.format.serialization import is_stateful

MOVED_BY_THE_HOST = (
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
)


def held_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (names to Statefuls or plain values) with what the host moves on at a step
    frozen as it is now; launches no device work (a device copy would queue behind the step)."""
    held: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, MOVED_BY_THE_HOST):
            held[name] = frozen(value.state_dict())
        elif is_stateful(value):
            held[name] = value
        else:
            held[name] = frozen(value)
    return held


class Scalar(NamedTuple):
    """A 0-d CPU tensor (an optimizer's step counter) held as a number: ``item`` takes a
    quarter of a ``clone``'s time, and this runs for every parameter at every step."""

    value: Any
    dtype: torch.dtype


def frozen(tree: Any) -> Any:
    """A copy of ``tree``'s containers and CPU tensors (0-d ones as ``Scalar``s, which
    ``thawed`` makes tensors again); device tensors and other leaves (numbers, strings:
    immutable) are referenced."""
    with torch.no_grad():
        return _frozen(tree)


# Leaves kept as they are without a call (a parameter group lists every parameter's index).
_ATOMS = frozenset({int, float, bool, str, type(None)})


def _frozen(tree: Any) -> Any:
    # exact types first: this runs at every step's pre-hook, over every parameter's state
    kind = type(tree)
    if kind is dict:
        return {k: v if type(v) in _ATOMS else _frozen(v) for k, v in tree.items()}
    if kind is list:
        return [v if type(v) in _ATOMS else _frozen(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        if not tree.is_cpu:
            return tree
        return Scalar(tree.item(), tree.dtype) if tree.dim() == 0 else tree.clone()
    return _each(tree, _frozen)


def thawed(tree: Any) -> Any:
    """``frozen``'s ``tree`` with its ``Scalar``s tensors again: when a held copy is written."""
    if isinstance(tree, Scalar):
        return torch.tensor(tree.value, dtype=tree.dtype)
    if is_stateful(tree):  # read at the copy (held_state left it live), whatever its type
        return tree
    return _each(tree, thawed)


def _each(tree: Any, change: Callable[[Any], Any]) -> Any:
    """``tree`` (a dict, list or tuple; anything else as it is) rebuilt from its items
    ``change``d."""
    if isinstance(tree, dict):
        return {key: change(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [change(value) for value in tree]
    if isinstance(tree, tuple):
        values = (change(value) for value in tree)
        return type(tree)(*values) if hasattr(tree, "_fields") else tuple(values)
    return tree
