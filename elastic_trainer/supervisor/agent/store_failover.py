"""The rendezvous store's host gone: elect a survivor to host it (``failover.elect``), move
it there and rebind the handler, or stop saying why it may not move."""

from __future__ import annotations

import time
from typing import Any

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.contract.config import RunConfig
from elastic_trainer.contract.endpoint import split_address
from elastic_trainer.supervisor.rendezvous import endpoint, failover, store_record
from elastic_trainer.supervisor.rendezvous import handler as rendezvous
from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch
from elastic_trainer.supervisor.rendezvous.signed_store import signed


class StoreFailover:
    """Carries out ``failover``'s election for one agent."""

    def __init__(self, *, cfg: RunConfig, membership: MembershipWatch, job_key: JobKey) -> None:
        self._cfg = cfg
        self._membership = membership
        self._job_key = job_key  # a moved store holds the job's values, signed as before
        self._host_of: tuple[Any, str] | None = None  # (a store, the node hosting it)

    def store_host(self, handler: Any) -> str | None:
        """The node hosting the handler's store (None: standalone, or the store gone), read
        once per store: it only changes when the store moves, to another store. Read after
        every round, it was two more round trips for every agent before its workers start."""
        store = getattr(handler, "store", None)
        if store is None:
            return None
        if self._host_of is not None and self._host_of[0] is store:
            return self._host_of[1]
        host = rendezvous.store_host(store, self._cfg.job_id)
        if host is not None:
            self._host_of = (store, host)
        return host

    def host_silent(self, host: str) -> None:
        """The member hosting the store stopped answering: gone (its closed connection) moves
        the store at the re-form; silent (no reset, e.g. a partition) it may still serve the
        others, and without a store this node cannot re-form: stop, saying why, rather than
        train on towards a collective timeout or start a second store for the job."""
        watch = self._membership
        election = failover.elect(
            members=watch.member_names(), store_host=host, gone=watch.gone(), static=False
        )
        if election.host is not None:  # it is gone after all: the loop re-forms without it
            return
        raise failover.not_moved(host, election.why)

    def move_if_host_gone(self, handler: Any, *, store_failed: bool = False) -> bool:
        """The agent hosting the rendezvous store is certainly gone (its connection closed,
        or it said it is leaving): elect a survivor to host it and rebind the handler to it
        before joining (``failover.py``). False when the store stays where it is; with
        ``store_failed`` (it no longer answers) an agent-hosted store that may not move is
        ``StoreMoveFailed``, saying why."""
        watch, cfg = self._membership, self._cfg
        leaving = handler.leaving_host() if watch.store_host is not None else None
        gone = (lambda: watch.gone() | {leaving}) if leaving else watch.gone
        old_host = watch.store_host
        election = failover.elect(
            members=watch.member_names(),
            store_host=old_host,
            gone=gone(),
            static=cfg.torchrun.node_rank is not None,
        )
        if election.host is None or old_host is None:
            if store_failed and old_host is not None:
                raise failover.not_moved(old_host, election.why)
            return False
        began = time.monotonic()
        read_timeout = cfg.rdzv.read_timeout
        key = self._job_key
        moved = failover.move_store(
            me=handler.member_name(),
            members=watch.member_names(),
            addresses=watch.addresses,
            store_host=old_host,
            gone=gone,
            port=cfg.rdzv_port,
            deadline_s=cfg.rdzv.join_timeout,
            serve=lambda host, port: signed(
                endpoint.serve(host, port, read_timeout_s=read_timeout), key
            ),
            connect=lambda host, port: signed(
                endpoint.try_job_store(host, port, read_timeout), key
            ),
            is_served_by=lambda store, member: rendezvous.hosted_by(store, cfg.job_id, member),
        )
        handler.rebind(moved.store, hosted=moved.hosted, node=cfg.node, endpoint=moved.endpoint)
        # the old host does not rejoin: a leaving one has not said goodbye on its presence
        # connection yet (it does as it exits), and the round must not wait for it
        handler.mark_dead(watch.members_named(gone()))
        if not moved.hosted:  # as run.py bounds the first store's connections
            host, port = split_address(moved.endpoint)
            endpoint.bound_silent_connections(host, port, timeout_s=endpoint.STORE_SILENCE_LIMIT_S)
        watch.store_moved(moved.host)
        if moved.hosted:  # how a node started later finds it (store_record.py)
            record = store_record.StoreRecord(
                job_id=cfg.job_id, endpoint=moved.endpoint, lineage=handler.lineage
            )
            store_record.write(cfg.worker.snapshot_dir, record, key)
        why = "leaving" if leaving else "lost"
        failover.report(
            old_host=old_host, moved=moved, why=why, began=began, label=watch.label_of_member
        )
        return True
