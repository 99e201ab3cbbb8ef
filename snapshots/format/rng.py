"""Random number generator state as plain tensors and ints (loadable with weights_only).

numpy's ``get_state()`` tuple holds an ndarray, which the weights-only unpickler refuses;
Python's holds a 625-int tuple. Both become int64 tensors here.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None  # type: ignore[assignment]


def capture_rng_state() -> dict[str, Any]:
    return FrozenRNGState().state_dict()


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    if np is not None and "numpy" in state:
        n = state["numpy"]
        keys = n["keys"].numpy().astype("uint32")
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState:
    """A Stateful for the process's RNGs. Restore it last: loading other state may draw."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_rng_state(state_dict)


class FrozenRNGState(RNGState):
    """An ``RNGState`` whose states are those of the instant it is made (``RNGState`` reads
    them when it is written): for a copy written after the step it describes, when the next
    step may have drawn already. Taken raw (about 60 µs, most of it numpy's), encoded only
    when written."""

    def __init__(self) -> None:
        self._torch = torch.get_rng_state()
        self._python = random.getstate()
        self._numpy = np.random.get_state(legacy=True) if np is not None else None
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self._python
        state: dict[str, Any] = {
            "torch": self._torch,
            "python": {
                "version": version,
                "state": torch.tensor(internal, dtype=torch.int64),
                "gauss": gauss,
            },
        }
        if self._numpy is not None:
            kind, keys, pos, has_gauss, cached = self._numpy
            state["numpy"] = {
                "kind": str(kind),
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            }
        if self._cuda is not None:
            state["cuda"] = self._cuda
        return state
