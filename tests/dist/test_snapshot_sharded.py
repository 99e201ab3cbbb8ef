"""Sharded snapshots on gloo: FSDP2 saved by every rank, resharded at other world sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from snapshots import SnapshotStore
from snapshots.cli import main
from snapshots.format import layout, sharding
from tests.dist import sharded_workers, spawning
from tests.tamper import damage

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def run_phase(tmp: Path, phase: str, world: int, **args: Any) -> list[dict[str, Any]]:
    tag = args.setdefault("tag", f"w{world}")
    spawning.spawn(
        sharded_workers.spawn_phase, args=(world, str(tmp), phase, args), nprocs=world, join=True
    )
    return [json.loads((tmp / f"result-{phase}-{tag}-{r}.json").read_text()) for r in range(world)]


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def assert_state_equal(actual: Any, expected: Any) -> None:
    """Tensors with assert_close, everything else (names, hyperparameters) with ==."""
    skel_a, tensors_a = sharding.split(actual, ())
    skel_e, tensors_e = sharding.split(expected, ())
    assert skel_a == skel_e
    torch.testing.assert_close(tensors_a, tensors_e, rtol=0, atol=0)


def test_fsdp_saved_at_2_loads_at_3_and_at_1_with_equal_full_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = run_phase(tmp_path, "fsdp_save", 2)
    assert [r["committed"] for r in saved] == [2, 2]
    store = SnapshotStore(str(tmp_path / "snaps"), create=False)
    info = store.latest()
    assert info is not None and info.format_version == 2 and info.world_size == 2
    assert main(["show", str(tmp_path / "snaps")]) == 0
    ranks = json.loads(capsys.readouterr().out)["sharded"]["ranks"]
    files = sorted((tmp_path / "snaps" / layout.step_dir(2)).glob("shard-*.bin"))
    assert [(r["rank"], r["file"], r["bytes"]) for r in ranks] == [
        (rank, f.name, f.stat().st_size) for rank, f in enumerate(files)
    ]
    assert all(r["chunks"] > 0 and r["tensors"] > 0 for r in ranks)  # each holds its shards
    expected = _load(tmp_path / "expected-2.pt")
    assert main(["export", str(tmp_path / "snaps"), "-o", str(tmp_path / "full.pt")]) == 0
    exported = _load(tmp_path / "full.pt")  # one process, no process group
    assert_state_equal({k: exported[k] for k in expected}, expected)
    for world in (3, 1):
        loaded = run_phase(tmp_path, "fsdp_load", world)
        assert {r["step"] for r in loaded} == {2}
        assert loaded[0]["meta"] == {"note": "x"}
        assert_state_equal(_load(tmp_path / f"loaded-w{world}.pt"), expected)


def test_fsdp_same_world_size_is_bit_identical(tmp_path: Path) -> None:
    saved = run_phase(tmp_path, "fsdp_save", 2)
    loaded = run_phase(tmp_path, "fsdp_load", 2)
    assert [r["local"] for r in loaded] == [r["local"] for r in saved]


def test_ddp_ranks_each_write_a_share_and_load_at_another_world_size(tmp_path: Path) -> None:
    run_phase(tmp_path, "ddp_save", 2)
    shards = sorted((tmp_path / "snaps" / layout.step_dir(1)).glob("shard-*.bin"))
    sizes = [p.stat().st_size for p in shards]
    assert len(sizes) == 2 and min(sizes) >= 0.4 * sum(sizes)  # about half each
    loaded = run_phase(tmp_path, "ddp_load", 3)
    assert {r["step"] for r in loaded} == {1}
    torch.testing.assert_close(
        _load(tmp_path / "loaded-ddp-w3.pt"), _load(tmp_path / "expected-ddp.pt"), rtol=0, atol=0
    )


def test_one_damaged_shard_file_makes_every_rank_fall_back_together(tmp_path: Path) -> None:
    run_phase(tmp_path, "fsdp_save", 2, steps=[2, 4])
    folder = tmp_path / "snaps" / layout.step_dir(4)
    shard = next(folder.glob("shard-00001.*.bin"))
    pristine = shard.read_bytes()
    for how in ("flip", "truncate", "delete"):
        damage(shard, how)
        verdict = SnapshotStore(str(tmp_path / "snaps"), create=False).verify(4)
        assert not verdict.ok and shard.name in " ".join(verdict.problems)
        loaded = run_phase(tmp_path, "fsdp_load", 2, tag=how)
        assert [r["step"] for r in loaded] == [2, 2], how
        assert_state_equal(_load(tmp_path / f"loaded-{how}.pt"), _load(tmp_path / "expected-2.pt"))
        shard.write_bytes(pristine)


@pytest.mark.parametrize(("kill_rank", "kill_at"), [(1, "mid_file:2"), (0, "before_manifest:2")])
def test_sigkill_of_one_rank_mid_save_commits_nothing(
    tmp_path: Path, kill_rank: int, kill_at: str
) -> None:
    with pytest.raises(mp.ProcessExitedException):
        run_phase(tmp_path, "fsdp_kill", 2, kill_rank=kill_rank, kill_at=kill_at)
    store = SnapshotStore(str(tmp_path / "snaps"), create=False)
    assert store.committed_steps() == [2]
    loaded = store.load()  # one process, full tensors: the previous snapshot, whole
    assert loaded.info.step == 2
    expected = _load(tmp_path / "expected-2.pt")
    assert_state_equal(loaded.state["model"], expected["model"])


def test_blocking_save_past_its_deadline_is_given_up_on_every_rank_together(
    tmp_path: Path,
) -> None:
    # The hazard: rank 0 gives up before copying while rank 1 starts; rank 1's writer then
    # waits in the commit's gather until commit_timeout_s (30 s here; 900 s by default).
    ranks = run_phase(tmp_path, "fsdp_deadline", 2, deadline_s=1.0, commit_timeout_s=30.0)
    assert all(r["raised"] for r in ranks), ranks
    assert all(r["seconds"] < 20 for r in ranks), ranks  # did not hang
    assert [r["committed"] for r in ranks] == [2, 2]
    assert SnapshotStore(str(tmp_path / "snaps"), create=False).committed_steps() == [2]
