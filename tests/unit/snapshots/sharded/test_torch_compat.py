"""Each torch API the sharded snapshots rely on still exists (snapshots.sharded.torch_compat)."""

from __future__ import annotations

import pytest
import torch

from snapshots.sharded import torch_compat as _torch_compat


@pytest.mark.parametrize("name", sorted(_torch_compat.checks()))
def test_torch_piece_still_exists(name: str) -> None:
    assert _torch_compat.checks()[name](), f"torch {torch.__version__} changed {name}"


def test_a_missing_piece_is_noticed() -> None:
    assert not _torch_compat._exists("torch.distributed.checkpoint", "DefaultSavePlanner.gone")
