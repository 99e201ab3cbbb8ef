"""torchrun's static mode: a node's group rank is its --node-rank, whatever torch numbered it,
and the workers' store is on the node that holds global rank 0."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

from elastic_trainer.supervisor.rendezvous.handler import with_group_rank

# what torch's rank 0 published: the address of the node *torch* numbered 0
TORCHS_MASTER = RendezvousStoreInfo("127.0.0.12", 29511)


def _info(store: HashStore, torch_rank: int) -> RendezvousInfo:
    return RendezvousInfo(store, torch_rank, 2, TORCHS_MASTER)


@pytest.mark.parametrize("node_1_torch_rank", [0, 1])
def test_every_node_gets_node_rank_0s_address_as_master(node_1_torch_rank) -> None:
    store = HashStore()  # the round's store, shared by both nodes
    addrs = {0: "127.0.0.11", 1: "127.0.0.12"}
    torch_rank = {1: node_1_torch_rank, 0: 1 - node_1_torch_rank}

    def join(node_rank: int) -> RendezvousInfo:
        info = _info(store, torch_rank[node_rank])
        return with_group_rank(info, node_rank, local_addr=addrs[node_rank])

    # node 1 first: it must wait for node rank 0's address, not take torch's
    with ThreadPoolExecutor(2) as pool:
        later = pool.submit(join, 1)
        first = pool.submit(join, 0)
        infos = {0: first.result(timeout=30), 1: later.result(timeout=30)}

    for node_rank, info in infos.items():
        assert info.rank == node_rank
        assert (info.store, info.world_size) == (store, 2)
        assert info.bootstrap_store_info.master_addr == addrs[0]
    assert infos[0].bootstrap_store_info.master_port == infos[1].bootstrap_store_info.master_port


def test_elastic_mode_keeps_torchs_rank_and_master() -> None:
    info = _info(HashStore(), 1)
    assert with_group_rank(info, None, local_addr="127.0.0.11") is info
