"""torchrun's static mode: a node's group rank is its --node-rank, whatever torch numbered it."""

from __future__ import annotations

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

from elastic_trainer.supervisor.rendezvous import with_group_rank


def _info(rank: int) -> RendezvousInfo:
    return RendezvousInfo(HashStore(), rank, 2, RendezvousStoreInfo("127.0.0.1", 29511))


@pytest.mark.parametrize(("torch_rank", "node_rank"), [(0, 1), (1, 0), (1, 1)])
def test_static_mode_reports_the_node_rank_as_group_rank(torch_rank, node_rank) -> None:
    before = _info(torch_rank)
    after = with_group_rank(before, node_rank)
    assert after.rank == node_rank
    # the rest is torch's: the same store, world and workers' store (MASTER_ADDR:MASTER_PORT)
    assert (after.store, after.world_size) == (before.store, before.world_size)
    assert after.bootstrap_store_info is before.bootstrap_store_info


def test_elastic_mode_keeps_torchs_rank() -> None:
    info = _info(1)
    assert with_group_rank(info, None) is info
