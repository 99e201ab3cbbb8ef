"""Sharded snapshots on gloo: FSDP2 saved by every rank, resharded at other world sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from snapshots import SnapshotStore, sharding
from tests.dist import sharded_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def run_phase(tmp: Path, phase: str, world: int, **args: Any) -> list[dict[str, Any]]:
    tag = args.setdefault("tag", f"w{world}")
    mp.spawn(
        sharded_workers.spawn_phase, args=(world, str(tmp), phase, args), nprocs=world, join=True
    )
    return [
        json.loads((tmp / f"result-{phase}-{tag}-{r}.json").read_text()) for r in range(world)
    ]


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def assert_state_equal(actual: Any, expected: Any) -> None:
    """Tensors with assert_close, everything else (names, hyperparameters) with ==."""
    skel_a, tensors_a = sharding.split(actual, ())
    skel_e, tensors_e = sharding.split(expected, ())
    assert skel_a == skel_e
    torch.testing.assert_close(tensors_a, tensors_e, rtol=0, atol=0)


def test_fsdp_saved_at_2_loads_at_3_and_at_1_with_equal_full_state(tmp_path: Path) -> None:
    saved = run_phase(tmp_path, "fsdp_save", 2)
    assert [r["committed"] for r in saved] == [2, 2]
    store = SnapshotStore(str(tmp_path / "snaps"), create=False)
    info = store.latest()
    assert info is not None and info.format_version == 2 and info.world_size == 2
    expected = _load(tmp_path / "expected-2.pt")
    for world in (3, 1):
        loaded = run_phase(tmp_path, "fsdp_load", world)
        assert {r["step"] for r in loaded} == {2}
        assert loaded[0]["meta"] == {"note": "x"}
        assert_state_equal(_load(tmp_path / f"loaded-w{world}.pt"), expected)


def test_fsdp_same_world_size_is_bit_identical(tmp_path: Path) -> None:
    saved = run_phase(tmp_path, "fsdp_save", 2)
    loaded = run_phase(tmp_path, "fsdp_load", 2)
    assert [r["local"] for r in loaded] == [r["local"] for r in saved]
