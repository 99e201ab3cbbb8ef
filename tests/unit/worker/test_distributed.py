"""worker/distributed.py: a rank other than 0 connects to rank 0's store once it listens.

The rank-0 worker hosts the workers' store; a TCPStore client that finds its port still closed
retries only after torch's connect backoff (~0.5 s). These tests start the "store" (a plain
listening socket) from inside the wait, so the order is fixed without any real sleep.
"""

from __future__ import annotations

import socket

import pytest

from elastic_trainer.errors import ConfigError
from elastic_trainer.worker import distributed
from elastic_trainer.worker.context import WorkerContext

HOST = "127.0.0.1"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def reachable(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


@pytest.fixture
def store_later(monkeypatch):
    """A closed port whose store starts listening at the first pause of the wait; the list
    holds the listening socket once it does."""
    port, listening = closed_port(), []

    def pause(_seconds: float) -> None:
        if not listening:
            listening.append(socket.create_server((HOST, port)))

    monkeypatch.setattr(distributed.time, "sleep", pause)
    yield port, listening
    for sock in listening:
        sock.close()


def start_group(monkeypatch, rank: int, port: int) -> list[bool]:
    """Run init_worker at ``rank`` with torch's init_process_group replaced by one that
    records whether the store accepted a connection when it was called."""
    calls: list[bool] = []
    monkeypatch.setattr(distributed, "_created_here", False)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        distributed.dist, "init_process_group", lambda **_: calls.append(reachable(port))
    )
    ctx = WorkerContext(rank=rank, world_size=2, master_addr=HOST, master_port=port)
    distributed.init_worker(ctx, configure_logs=False)
    return calls


def test_a_later_rank_calls_torch_only_once_the_store_listens(monkeypatch, store_later):
    port, listening = store_later
    assert start_group(monkeypatch, rank=1, port=port) == [True]
    assert len(listening) == 1  # it did wait: the store came up during the wait


def test_rank_0_hosts_the_store_and_does_not_wait(monkeypatch, store_later):
    port, listening = store_later
    assert start_group(monkeypatch, rank=0, port=port) == [False]
    assert listening == []


def test_a_store_that_never_listens_hands_over_to_torch_after_the_wait(monkeypatch):
    monkeypatch.setattr(distributed.time, "sleep", lambda _s: None)
    assert distributed.wait_for_store(HOST, closed_port(), within_s=0.0) is False


def test_an_unresolvable_host_is_not_waited_for(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(distributed.time, "sleep", pauses.append)
    assert distributed.wait_for_store("host.invalid", 1, within_s=60.0) is False
    assert pauses == []


def test_two_ranks_sharing_one_gpu_are_refused_before_nccl_starts(monkeypatch):
    """NCCL's own answer would be 'Duplicate GPU detected' from every rank's first
    collective; the worker says what to change instead, before any CUDA call."""
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(distributed.torch.cuda, "set_device", pytest.fail)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", pytest.fail)
    ctx = WorkerContext(
        rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr=HOST, master_port=1
    )
    with pytest.raises(ConfigError, match="2 workers on this node but 1 visible GPU: NCCL"):
        distributed.init_worker(ctx, configure_logs=False)
