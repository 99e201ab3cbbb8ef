"""Two writers saving the same steps into one folder (two generations of a job that both
believe they own it): exactly one commits each step, and a committed step never mixes the
two writers' files."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from snapshots import SnapshotExistsError, SnapshotStore
from snapshots.format import layout

STEPS = 20


def _state(writer: int, step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(1000 * writer + step)
    return {"w": torch.randn(32, 8, generator=gen), "b": torch.randn(8, generator=gen)}


def test_one_winner_per_step_and_never_mixed_files(tmp_path: Path) -> None:
    barrier = threading.Barrier(2)
    won: dict[int, list[int]] = {step: [] for step in range(1, STEPS + 1)}
    errors: list[BaseException] = []

    def writer(me: int) -> None:
        store = SnapshotStore(str(tmp_path), async_save=False, keep=None)
        for step in range(1, STEPS + 1):
            barrier.wait(30)  # both start each step together
            try:
                store.save(step, _state(me, step))
                won[step].append(me)
            except SnapshotExistsError:
                pass
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=writer, args=(me,)) for me in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    store = SnapshotStore(str(tmp_path), async_save=False, keep=None)
    for step, winners in won.items():
        assert len(winners) == 1, f"step {step}: winners {winners}"
        manifest = json.loads((tmp_path / layout.manifest_path(step)).read_text())
        tokens = {layout.token_of(f["name"]) for f in manifest["files"]}
        assert len(tokens) == 1, f"step {step} mixes files of two saves: {tokens}"
        loaded = store.load(step).state
        want = _state(winners[0], step)
        assert torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["b"], want["b"])  # type: ignore[arg-type]
