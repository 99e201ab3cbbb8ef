"""Static mode, a second --node-rank 0 on another host: the probe of --master-addr tells our own
store (an address that routes here) from another node's, and marks a conflict in both."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import HashStore, TCPStore

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.supervisor.rendezvous import static_host
from elastic_trainer.supervisor.rendezvous.signed_store import SignedStore
from tests.e2e.workers.harness import free_port, wait_for

pytestmark = pytest.mark.timeout(60)
KEY = JobKey.generate()  # both nodes are of one job: one secret


def test_a_local_address_is_one_a_socket_binds_to() -> None:
    assert static_host.is_local_address("127.0.0.1") and static_host.is_local_address("::1")
    assert not static_host.is_local_address("no-such-host.invalid")
    # an address of another host: tests/e2e/test_networks.py (network namespaces)


def _probe(own: object, port: int) -> static_host.HostProbe:
    return static_host.HostProbe(
        own, job_id="j", host="127.0.0.1", port=port, line="the line", read_timeout_s=5,
        for_s=30,
    )  # fmt: skip


def _server(port: int) -> SignedStore:
    return SignedStore(TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=5)), KEY)  # fmt: skip


def test_another_nodes_store_at_the_master_addr_is_a_conflict_in_both_stores() -> None:
    port = free_port()
    own, other = SignedStore(HashStore(), KEY), _server(port)
    probe = _probe(own, port).start()
    try:
        wait_for(lambda: static_host.conflict_in(other, "j"), 30, "the conflict in its store")
        assert static_host.conflict_in(own, "j") == static_host.conflict_in(other, "j")
        assert static_host.conflict_in(own, "j") == "the line"
    finally:
        probe.stop()


def test_our_own_store_answering_there_is_no_conflict() -> None:
    port = free_port()
    own = _server(port)  # --master-addr routes here (a Service, NAT)
    probe = _probe(own, port)
    probe.start()._thread.join(30)  # it ends once it has seen whose store answered
    assert not probe._thread.is_alive()
    assert static_host.conflict_in(own, "j") is None


def test_the_probe_waits_for_the_other_store_to_come_up() -> None:
    port = free_port()  # nothing listens yet: the other node starts later
    own = SignedStore(HashStore(), KEY)
    probe = _probe(own, port).start()
    try:
        other = _server(port)
        wait_for(lambda: static_host.conflict_in(own, "j"), 30, "the conflict, once it is up")
        assert static_host.conflict_in(other, "j") == "the line"
    finally:
        probe.stop()
