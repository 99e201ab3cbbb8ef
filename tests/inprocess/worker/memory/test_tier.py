"""A restore from node memory where a node lacks the newest copy (``MemoryTier.restore``'s
mirror plan), on 3 gloo ranks as threads, each its own node: the source sends its copy's
checked bytes to the rank without it, point to point; nothing received is unpickled."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_trainer.worker import distributed as D
from elastic_trainer.worker.memory import tier as tier_module
from elastic_trainer.worker.memory.plan import Source
from elastic_trainer.worker.memory.tier import MemoryTier
from tests.inprocess.harness import Rank, run_attempt, thread_local_world

WORLD = 3
STEP = 5
_phase = threading.local()


@pytest.fixture
def no_object_collective_in_a_restore(monkeypatch):
    """The object collectives (pickle) fail the test when a rank calls one while restoring."""
    for name in ("broadcast_object_list", "all_gather_object", "gather_object"):
        real = getattr(dist, name)

        def guarded(*args, _real=real, _name=name, **kwargs):
            if getattr(_phase, "restoring", False):
                raise AssertionError(f"{_name} during a restore")
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, guarded)


def _restore(tmp_path: Path, holders: set[int]):
    """Nodes in ``holders`` hold a copy of STEP (weights 5.0); every rank restores into a
    fresh model: (plan source, plan reason, its weights, its restored source) per rank."""

    def fn(rank: Rank):
        memory = MemoryTier(str(tmp_path / f"node{rank.rank}"), every=1)
        model = torch.nn.Linear(300, 200)
        if rank.rank in holders:
            with torch.no_grad():
                model.weight.fill_(5.0)
            memory.save(STEP, {"model": model}, {})
            memory.flush()
        D.barrier()  # every copy is made before anyone restores
        fresh = torch.nn.Linear(300, 200)
        _phase.restoring = True
        try:
            plan, restored = memory.restore({"model": fresh}, {}, None)
        finally:
            _phase.restoring = False
        memory.close()
        source = None if restored is None else restored.source
        return plan.source, plan.reason, float(fresh.weight.detach().mean()), source

    with thread_local_world():
        attempt = run_attempt(fn, WORLD)
    attempt.raise_first()
    return attempt.values()


@pytest.mark.usefixtures("no_object_collective_in_a_restore")
def test_a_node_without_the_copy_receives_it_as_checked_bytes(tmp_path):
    outcomes = _restore(tmp_path, holders={0, 1})
    assert [o[0] for o in outcomes] == [Source.MIRROR] * WORLD
    assert [o[2] for o in outcomes] == [5.0] * WORLD
    assert [o[3] for o in outcomes] == [Source.MEMORY, Source.MEMORY, Source.MIRROR]


def test_bytes_damaged_on_the_way_are_refused_and_every_rank_turns_to_storage(
    tmp_path, monkeypatch
):
    real = tier_module.mirror_message

    def damaged(data, size):
        copy, digest = real(data, size)
        copy = bytearray(copy)
        copy[size // 2] ^= 0xFF
        return copy, digest

    monkeypatch.setattr(tier_module, "mirror_message", damaged)
    outcomes = _restore(tmp_path, holders={0, 1})
    assert [o[0] for o in outcomes] == [Source.STORAGE] * WORLD
    assert all("rank 2: ValueError: the copy from rank 0 fails its" in o[1] for o in outcomes)
    assert outcomes[2][2] != 5.0  # nothing of the damaged copy was loaded


def test_a_source_that_cannot_read_its_copy_still_answers_and_all_turn_to_storage(tmp_path):
    """The source's own read fails (its copy damaged): it sends zeros all the same, so the
    rank waiting for its bytes is not left waiting; every rank turns to storage."""
    damaged = {"done": False}
    real_read_bytes = tier_module.NodeCopies.read_bytes

    def read_bytes(self, step):
        if self.directory.endswith("node0"):
            damaged["done"] = True
            raise ValueError("slot-a (bytes 0-9) fails its checksum (damaged)")
        return real_read_bytes(self, step)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tier_module.NodeCopies, "read_bytes", read_bytes)
        outcomes = _restore(tmp_path, holders={0, 1})
    assert damaged["done"]
    assert [o[0] for o in outcomes] == [Source.STORAGE] * WORLD
    reason = outcomes[0][1]
    assert "rank 0: ValueError: slot-a" in reason
    assert "rank 2: ValueError: the copy from rank 0" in reason
