"""StoreFailover's reads of who hosts the store."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.supervisor.agent.store_failover import StoreFailover
from elastic_trainer.supervisor.rendezvous import handler as rendezvous


class Store:
    """A store holding the host key of job ``job`` (or none), counting its reads."""

    def __init__(self, host: str | None) -> None:
        self.values = {rendezvous.store_host_key("job"): host.encode()} if host else {}
        self.reads = 0

    def check(self, keys: list[str]) -> bool:
        self.reads += 1
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        self.reads += 1
        return self.values[key]


def failover() -> StoreFailover:
    cfg: Any = SimpleNamespace(job_id="job")
    membership: Any = None
    return StoreFailover(cfg=cfg, membership=membership, job_key=JobKey.generate())


def test_the_store_s_host_is_read_once_per_store() -> None:
    """It was read after every round: two round trips for every agent before its workers
    start, on a store every agent is busy with then."""
    moves = failover()
    first, second = Store("n0"), Store("n1")
    handler = SimpleNamespace(store=first)
    assert [moves.store_host(handler) for _ in range(3)] == ["n0"] * 3
    assert first.reads == 2  # one check, one get
    handler.store = second  # moved: another store, read again
    assert moves.store_host(handler) == "n1" and second.reads == 2


def test_a_store_without_a_host_is_asked_again() -> None:
    """None is no answer to keep: a standalone store, or one that failed the read."""
    moves = failover()
    store = Store(None)
    handler = SimpleNamespace(store=store)
    assert moves.store_host(handler) is None
    store.values[rendezvous.store_host_key("job")] = b"n2"
    assert moves.store_host(handler) == "n2"
    assert moves.store_host(SimpleNamespace(store=None)) is None
