"""Re-forming rounds on torch's real c10d rendezvous (in-process nodes, a loopback TCPStore).

The waits that would make these tests hang without the change are set long (30 s last call,
30 s heartbeat expiry); the bounds below only say "did not hang", they are no timing targets.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from structlog.testing import capture_logs
from torch.distributed import HashStore, TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

from elastic_trainer.contract import protocol
from elastic_trainer.contract.auth import JobKey
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.rendezvous import handler as rendezvous
from elastic_trainer.supervisor.rendezvous import state_backend
from elastic_trainer.supervisor.rendezvous.handler import (
    FastRecoveryRendezvousHandler,
    share_lineage,
)

HANG_S = 20.0  # far below the 30 s waits a missing early close would cost
KEY = JobKey.generate()


@pytest.fixture
def server():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


@pytest.fixture
def nodes(server, monkeypatch):
    # as run.py sets it: torch's shared bootstrap store would make a newcomer that is not
    # rank 0 wait for an address the old rank 0 never republishes
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    made: list[FastRecoveryRendezvousHandler] = []

    def make(
        *, max_nodes: int, first_last_call_s: float = 30.0, keep_alive_s: float = 10.0
    ) -> FastRecoveryRendezvousHandler:
        store = TCPStore("127.0.0.1", server, is_master=False, timeout=timedelta(seconds=30))
        handler = rendezvous.handler_on(
            store,
            KEY,
            "job",
            1,
            max_nodes,
            "127.0.0.1",
            RendezvousTimeout(join=timedelta(seconds=60), close=timedelta(seconds=5)),
            keep_alive_interval=keep_alive_s,  # expiry after 30 s: never reached here
            keep_alive_max_attempt=int(30 / keep_alive_s),
        )
        handler.tune(first_last_call_s=first_last_call_s, later_last_call_s=30.0)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        handler.leave()


class Joining:
    """``next_rendezvous`` on a thread: (world size) once it returns."""

    def __init__(self, handler: FastRecoveryRendezvousHandler) -> None:
        self.world_size: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(handler,), daemon=True)
        self._thread.start()

    def _run(self, handler: FastRecoveryRendezvousHandler) -> None:
        try:
            self.world_size = int(handler.next_rendezvous().world_size)
        except BaseException as exc:  # reported by result()
            self.error = exc

    def result(self) -> int | None:
        self._thread.join(HANG_S)
        assert self.error is None, self.error
        return self.world_size


def shared_state(handler: FastRecoveryRendezvousHandler) -> Any:
    return handler.state_backend.peek()


def joined(handler: FastRecoveryRendezvousHandler) -> set[Any]:
    """The participants of the stored state (none before the first write)."""
    state = shared_state(handler)
    return set() if state is None else set(state.participants)


def wait_for(predicate: Any) -> None:
    deadline = time.monotonic() + HANG_S
    while not predicate():
        assert time.monotonic() < deadline, "the state never got there"
        time.sleep(0.02)


def form(*handlers: FastRecoveryRendezvousHandler) -> None:
    joins = [Joining(h) for h in handlers]
    assert [j.result() for j in joins] == [len(handlers)] * len(handlers)


def test_a_node_known_dead_is_neither_waited_for_nor_for_its_heartbeats(nodes) -> None:
    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    form(a, b)
    # b's process died: its connection closed, but its heartbeats would last 30 s more (here
    # they even go on: only what the agent knows decides) and the last call is 30 s
    a.mark_dead({b.this_node})
    assert Joining(a).result() == 1
    assert b.this_node not in shared_state(a).participants


def expire_calls(monkeypatch) -> list[set[Any]]:
    """The nodes of each separate expire op (``torch_compat.expire_nodes``) from now on."""
    calls: list[set[Any]] = []
    real = torch_compat.expire_nodes

    def expire(handler: Any, gone: set[Any], deadline: float) -> None:
        calls.append(set(gone))
        real(handler, gone, deadline)

    monkeypatch.setattr(torch_compat, "expire_nodes", expire)
    return calls


def test_a_node_whose_connection_closed_is_expired_by_the_join_itself(nodes, monkeypatch):
    """Every survivor of a node loss knows it at once; each expiring it in an op of its own
    before joining (a read of the whole state, most with a losing write) cost each about
    130 ms of store round trips at 64 nodes. The join's first write expires it instead."""
    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    form(a, b)
    calls = expire_calls(monkeypatch)
    a.dead_now = lambda: {b.this_node}  # its presence connection closed
    a.mark_dead({b.this_node})
    assert Joining(a).result() == 1
    assert b.this_node not in shared_state(a).participants
    assert calls == []


def test_a_node_gone_silent_is_expired_before_the_join(nodes, monkeypatch) -> None:
    """A confirmed silence is not a closed connection: the join's hook leaves it alone (a
    thawed node may rejoin the round), so it is expired before the join."""
    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    form(a, b)
    calls = expire_calls(monkeypatch)
    a.dead_now = set
    a.mark_dead({b.this_node})
    assert Joining(a).result() == 1
    assert calls == [{b.this_node}]


def test_only_the_first_join_sleeps_torchs_random_jitter(nodes, monkeypatch) -> None:
    """torch sleeps 0-0.3 s before a join while the round is 0, to spread a job's first
    joins; the first re-form (round 0 still) must not pay it: it is recovery time."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    jitters: list[Any] = []

    def delay(seconds: Any) -> None:
        if isinstance(seconds, tuple):
            jitters.append(seconds)  # recorded, not slept
        else:
            time.sleep(seconds)

    monkeypatch.setattr(dynamic_rendezvous, "_delay", delay)
    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    form(a, b)
    assert len(jitters) == 2  # each node's first join, round 0
    assert shared_state(a).round == 0
    a.mark_dead({b.this_node})
    assert Joining(a).result() == 1  # a re-form of round 0
    assert len(jitters) == 2, jitters


def test_nodes_joining_an_open_round_write_nothing_its_opener_lets_them_in(
    nodes, monkeypatch
) -> None:
    """A node that arrives while a round is open asks its opener to let it in (one append to
    the round's log) and writes nothing; the opener adds it in one write of its own. Every
    arriving node used to add itself by a compare-and-set of the whole state, racing every
    other arriving node (the first round of 128 agents never closed), and every waiter
    wrote its heartbeat into the state after each join (N² colliding writes)."""
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    writes = {h: _count_writes(h, monkeypatch) for h in (a, b, c)}
    first = Joining(a)  # the round stays open until all three are in (30 s last call)
    wait_for(lambda: a.this_node in joined(b))
    second = Joining(b)
    wait_for(lambda: b.this_node in joined(a))
    third = Joining(c)
    assert (first.result(), second.result(), third.result()) == (3, 3, 3)
    # a: its own join, then b let in, then c let in (the round full: closed in that write)
    assert [writes[h] for h in (a, b, c)] == [[True, True, True], [], []]
    assert shared_state(a).complete
    from elastic_trainer.supervisor.rendezvous import join_log

    assert not a.store.check([join_log.log_key("job", 0)])  # its opener removed the log


def _count_writes(handler: FastRecoveryRendezvousHandler, monkeypatch: Any) -> list[bool]:
    """Each write of the shared state ``handler`` attempts from now on: whether it won."""
    writes: list[bool] = []
    set_state = handler.state_backend.set_state

    def counted(state: bytes, token: Any = None) -> Any:
        result = set_state(state, token)
        writes.append(result is not None and result[2])
        return result

    monkeypatch.setattr(handler.state_backend, "set_state", counted)
    return writes


def _count_state_reads(handler: FastRecoveryRendezvousHandler, monkeypatch: Any) -> list[str]:
    """The store keys ``handler``'s state backend reads whole from now on (the state, the
    heartbeats); small reads (``check``, a mark) are not counted."""
    reads: list[str] = []
    call = handler.state_backend._call

    def counted(op: str, *args: Any) -> Any:
        if op == "compare_set":
            reads.append("state")
        elif op == "multi_get":
            reads.extend(args[0])
        return call(op, *args)

    monkeypatch.setattr(handler.state_backend, "_call", counted)
    return reads


def test_a_running_member_reads_the_state_only_when_it_moved(nodes, monkeypatch) -> None:
    """At 128 agents every member read the whole state and every node's heartbeat once a
    second, 4 MB/s through the store while nothing happened. A running member asks the
    state's version mark; it reads the state when a node changed it."""
    monkeypatch.setattr(rendezvous, "STATE_CHECK_S", 0.0, raising=False)
    a, b = nodes(max_nodes=3), nodes(max_nodes=3)
    form_with_last_call(a, b)
    # torch's holder keeps a read for 1 s: the checks below stand for checks seconds apart
    monkeypatch.setattr(a._state_holder, "_cache_duration", 0)
    reads = _count_state_reads(a, monkeypatch)  # the join read it whole: not again now
    for _ in range(5):
        assert a.num_nodes_waiting() == 0
        assert a.stale_peers({b.this_node}) == set()
    assert "state" not in reads
    newcomer = nodes(max_nodes=3)
    Joining(newcomer)  # a third node: the round is complete, it joins the wait list
    wait_for(lambda: a.num_nodes_waiting() == 1)
    assert "state" in reads


def test_a_member_reads_the_heartbeats_of_the_peers_it_watches_only(nodes, monkeypatch) -> None:
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    form(a, b, c)
    a.num_nodes_waiting()
    reads = _count_state_reads(a, monkeypatch)
    assert a.stale_peers({b.this_node}) == set()
    beat_keys = [k for k in reads if "/heartbeat/" in k]
    assert beat_keys == [state_backend.beat_key("job", state_backend.node_entry(b.this_node))]
    a.state_backend.beat(b.this_node, 1_000_000)  # b's last heartbeat: long ago
    assert a.stale_peers({b.this_node, c.this_node}) == set()  # b's in the state is newer
    assert a.stale_peers({b.this_node}) == set()


def test_a_heartbeat_that_moved_since_the_last_check_is_a_live_node_s(nodes, monkeypatch) -> None:
    """On a machine starved of CPU, beats are stamped, then sent or served seconds late: a
    live node's newest beat can be older than the expiry. One that changed since our last
    read is alive; one that did not change is silent (frozen, cut off)."""
    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    form(a, b)
    b._stop_heartbeats()
    monkeypatch.setattr(rendezvous.torch_compat, "keep_alive", lambda handler: (0.5, 2))
    wait_for(lambda: a.stale_peers({b.this_node}) == {b.this_node})  # its join: > 1 s ago
    assert a.stale_peers({b.this_node}) == {b.this_node}  # nothing since: silent
    a.state_backend.beat(b.this_node, 1_000_000)  # a beat arrives, stamped long ago
    assert a.stale_peers({b.this_node}) == set()  # it moved: b lives
    assert a.stale_peers({b.this_node}) == {b.this_node}  # and then nothing more


def test_a_re_form_waits_for_no_missing_member_whose_heartbeat_ran_out(nodes) -> None:
    """Members watch only two others for silence; the round's opener may not be one of a
    silent member's watchers. Opening the next round, it does not wait for a missing
    member whose own heartbeat ran out, and waits for one whose heartbeat is fresh."""
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    form(a, b, c)
    view = torch_compat.RoundView(
        me=a.this_node, round=1, complete=False, joined=frozenset(), waiting=frozenset(),
        min_nodes=1, max_nodes=3,
    )  # fmt: skip
    joined = {a.this_node, b.this_node}
    assert not a._closes_at_once(joined, view)  # c beats: it is on its way
    c._stop_heartbeats()
    a.state_backend.beat(c.this_node, 1_000_000)  # its last, long ago
    assert a._closes_at_once(joined, view)


def test_a_re_form_is_each_members_announcement_and_one_write(nodes, monkeypatch) -> None:
    """Every member of a complete round re-joins (a worker crash, a node lost): each says so
    in its own key, and the first of them opens the next round with all in one write. Each
    used to leave the round and join its wait list by writes of the one state, then add
    itself to the next round: N writers colliding, O(N²) attempts of O(N) bytes."""
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    form(a, b, c)
    writes = {h: _count_writes(h, monkeypatch) for h in (a, b, c)}
    first, second = Joining(b), Joining(c)
    wait_for(lambda: a.num_nodes_waiting() == 1)  # the running member sees them
    assert a.num_nodes_waiting() == 1  # and until it reads the mark again, says so still
    third = Joining(a)
    assert (first.result(), second.result(), third.result()) == (3, 3, 3)
    assert [writes[h] for h in (a, b, c)] == [[True], [], []]  # a opened the round
    assert shared_state(a).round == 1
    assert a.num_nodes_waiting() == 0
    # each announced a moment ago: stamped at the open, their readers need none of their keys
    beats = shared_state(a).last_heartbeats
    assert beats[b.this_node] == beats[c.this_node] <= beats[a.this_node]


def test_a_member_re_joins_an_unchanged_round_without_reading_it_whole(nodes, monkeypatch):
    """Its holder's state is the stored one (the version mark says so): the announcement and
    torch's exit op take it, and the member reads the state whole once, when the next round
    opens. Each survivor of a re-form read the running round's state (and every member's
    heartbeat key, its times being the round's start) before it announced."""
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    form(a, b, c)
    b._state_holder._last_sync_time = -1.0  # its last read seconds ago: not torch's cache
    reads = _count_state_reads(b, monkeypatch)
    first = Joining(b)
    wait_for(lambda: a.num_nodes_waiting() == 1)  # b announced, and waits
    assert reads == []
    second, third = Joining(c), Joining(a)
    assert (first.result(), second.result(), third.result()) == (3, 3, 3)
    assert reads == ["state"]  # the next round, as a opened it
    assert shared_state(b).round == 1


def test_an_opener_reads_the_round_it_leaves_before_it_writes_the_next(nodes) -> None:
    """Its cached state's times are those of its last read: torch's expiry, run on the copy
    it writes, dropped every node there whose time was stale (at 64 agents, before members
    were stamped at the open, a round of 1). An opener that announced from the cache reads
    the state, with the nodes' heartbeats, before it opens the next round: here a node
    waiting to join, which the re-form admits."""
    a, b, c, d = (nodes(max_nodes=4) for _ in range(4))
    form_with_last_call_of(a, b, c)
    newcomer = Joining(d)  # the round is complete: d waits, and the members re-form for it
    wait_for(lambda: a.num_nodes_waiting() == 1)
    held = a._state_holder.state  # a opens: as if read long ago, beyond the expiry
    assert d.this_node in held.wait_list
    long_ago = datetime.now(timezone.utc) - timedelta(minutes=5)
    held.last_heartbeats = dict.fromkeys(held.last_heartbeats, long_ago)
    a._state_holder._last_sync_time = -1.0
    first, second, third = Joining(b), Joining(c), Joining(a)
    assert (newcomer.result(), first.result(), second.result(), third.result()) == (4,) * 4
    assert joined(a) == {a.this_node, b.this_node, c.this_node, d.this_node}


def test_a_re_formed_round_s_mark_is_removed_from_the_store(nodes) -> None:
    """Once the next round is open nobody reads the last one's re-join mark: the store kept
    one per round for the life of the job."""
    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    form(a, b)
    round_ = shared_state(a).round
    first = Joining(b)
    wait_for(lambda: a.num_nodes_waiting() == 1)
    assert a.store.check([rendezvous.rejoin_mark_key("job", round_)])
    second = Joining(a)
    assert (first.result(), second.result()) == (2, 2)
    assert shared_state(a).round == round_ + 1
    assert not a.store.check([rendezvous.rejoin_mark_key("job", round_)])


def test_forged_re_join_keys_neither_count_as_waiting_nor_open_a_round(nodes) -> None:
    """Anyone who reaches the store can write the re-join mark and keys; unsigned ones are
    refused: no node counts as waiting, and a round is not opened for a member that did not
    announce itself."""
    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    form(a, b)
    round_ = shared_state(a).round
    raw = a.store.raw
    raw.set(rendezvous.rejoin_mark_key("job", round_), "1")
    raw.set(rendezvous.rejoin_key("job", round_, b.this_node), "1")
    with capture_logs():
        assert a.num_nodes_waiting() == 0
        assert not a._all_announced(round_, {b.this_node})
    b.store.set(rendezvous.rejoin_key("job", round_, b.this_node), "1")  # b's own, signed
    assert a._all_announced(round_, {b.this_node})


def test_a_member_known_dead_is_not_waited_for_by_the_announced_re_form(nodes) -> None:
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    form(a, b, c)
    c._stop_heartbeats()  # c's process died: its heartbeats would last 30 s more
    a.mark_dead({c.this_node})
    b.mark_dead({c.this_node})
    first, second = Joining(a), Joining(b)
    assert (first.result(), second.result()) == (2, 2)
    assert set(shared_state(a).participants) == {a.this_node, b.this_node}


def test_the_last_node_out_of_a_round_joins_the_waiting_ones_to_the_next(nodes, monkeypatch):
    """A node leaves for good the round it was the last member of (preempted) while two
    newcomers wait for the next: it opens the next round and, in that same write, joins them
    to it. Each used to add itself, both at once, colliding on the one state."""
    a = nodes(max_nodes=3, first_last_call_s=0.2)
    assert Joining(a).result() == 1
    b, c = nodes(max_nodes=3, first_last_call_s=0.2), nodes(max_nodes=3, first_last_call_s=0.2)
    added: list[Any] = []
    for handler in (b, c):  # torch's own "add myself to the round" (a write of the state)
        executor = handler._op_executor
        add = executor._add_to_participants
        monkeypatch.setattr(executor, "_add_to_participants", lambda add=add: added.append(add()))
    first, second = Joining(b), Joining(c)
    wait_for(lambda: {b.this_node, c.this_node} <= set(shared_state(a).wait_list))
    assert a.leave()
    assert (first.result(), second.result()) == (2, 2)
    assert added == []


def test_a_joining_node_keeps_its_heartbeat_fresh_while_it_waits(nodes) -> None:
    """Heartbeats are each node's own key: they go on through a join (torch stops its timer
    for one), or a node waiting longer than the expiry would be dropped from its round."""
    a = nodes(max_nodes=2, keep_alive_s=0.1)
    joining = Joining(a)  # waits for a second node up to the 30 s last call
    wait_for(lambda: a.this_node in joined(a))
    (first,) = a.state_backend.beats([a.this_node]).values()
    assert first is not None
    wait_for(lambda: (a.state_backend.beats([a.this_node])[a.this_node] or 0) > first)
    second = Joining(nodes(max_nodes=2, keep_alive_s=0.1))
    assert (joining.result(), second.result()) == (2, 2)


def test_a_live_peer_that_rejoins_late_is_waited_for_not_dropped(nodes) -> None:
    """A worker crash: both agents re-join, one late (its workers took long to fail). The
    round must hold both (closing without the late one would split the job), and must close
    as soon as both are in, not at the 30 s last call (max_nodes 3: torch would wait)."""
    a, b = nodes(max_nodes=3), nodes(max_nodes=3)
    form_with_last_call(a, b)
    first = Joining(a)
    wait_for(lambda: b.num_nodes_waiting() == 1)  # a waits, b still running
    second = Joining(b)
    assert (first.result(), second.result()) == (2, 2)


def test_a_node_waiting_to_join_is_admitted_by_the_next_round(nodes) -> None:
    a = nodes(max_nodes=3, first_last_call_s=0.2)
    assert Joining(a).result() == 1
    c = nodes(max_nodes=3)
    newcomer = Joining(c)
    wait_for(lambda: c.this_node in shared_state(a).wait_list)
    assert (Joining(a).result(), newcomer.result()) == (2, 2)


def form_with_last_call(a: FastRecoveryRendezvousHandler, b: FastRecoveryRendezvousHandler):
    """The first round of two nodes when max_nodes is 3: both in, then the first last call
    (made short here) closes it."""
    a.tune(first_last_call_s=3.0, later_last_call_s=30.0)
    b.tune(first_last_call_s=3.0, later_last_call_s=30.0)
    form(a, b)


def test_a_lost_store_fails_heartbeats_quietly_and_counts_them(monkeypatch, caplog) -> None:
    """The store's host was preempted: torch logged a RendezvousConnectionError warning on
    every heartbeat tick (376 lines in 3 minutes). Now: no line per attempt, a streak count
    (the one store.unreachable comes from the membership watch), reset by a success."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=5))
    handler = rendezvous.handler_on(
        store,
        KEY,
        "job",
        1,
        1,
        "127.0.0.1",
        RendezvousTimeout(join=timedelta(seconds=60), heartbeat=timedelta(seconds=10)),
        keep_alive_interval=0.01,  # every beat below is due (the timer is stopped)
        keep_alive_max_attempt=1000,  # but the node expires only after 10 s
    )
    assert Joining(handler).result() == 1
    handler._stop_heartbeats()  # the test sends the beats
    del master  # the store is gone
    with capture_logs() as events, caplog.at_level(logging.DEBUG):
        for _ in range(5):
            time.sleep(0.02)  # not a sync: makes the beat due
            handler._keep_alive()
    # a beat is a set, which c10d does not answer: the first may still fill the socket buffer
    assert handler.heartbeat_failures in (4, 5) and handler.heartbeat_error
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert events == []
    monkeypatch.setattr(handler.state_backend, "beat", lambda node, at_us: None)  # back again
    handler._keep_alive()
    assert (handler.heartbeat_failures, handler.heartbeat_error) == (0, "")


def test_every_node_of_one_store_shares_one_lineage() -> None:
    store, other = HashStore(), HashStore()
    first = share_lineage(store, "job")
    assert first and share_lineage(store, "job") == first  # a later node, a later round
    assert share_lineage(other, "job") != first  # a store started again: another lineage


def test_the_workers_read_the_lineage_the_supervisor_exports() -> None:
    from elastic_trainer.worker import snapshotting

    assert snapshotting.ENV_RDZV_LINEAGE == rendezvous.ENV_RDZV_LINEAGE == protocol.ENV_RDZV_LINEAGE


def test_survivors_rebound_to_a_new_store_form_their_next_round_there_at_once(nodes) -> None:
    """Store failover (failover.py): the old store is gone; each survivor rebinds its handler
    to the new one. They are still the same members (the same node descriptors), so their
    first round there closes as soon as both joined, not at the 30 s last call; the lineage
    and the presence addresses carry over; the hosting member is named in the new store."""
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    for handler, port in ((a, 1), (b, 2), (c, 3)):
        handler.lineage = share_lineage(handler.store, "job")
        handler.publish_presence(f"127.0.0.1:{port}")
    form_with_last_call_of(a, b, c)
    lineage = a.lineage
    moved = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", moved.port, is_master=False, timeout=timedelta(seconds=30))
    a.mark_dead({c.this_node})  # c hosted the old store and is gone
    b.mark_dead({c.this_node})
    c._stop_heartbeats()
    a.rebind(moved, hosted=True, node="a")
    b.rebind(client, hosted=False, node="b")
    assert rendezvous.hosted_by(b.store, "job", a.member_name())
    assert not rendezvous.hosted_by(b.store, "job", b.member_name())
    assert rendezvous.store_host(b.store, "job") == "a"
    assert not rendezvous.hosted_by(client, "job", a.member_name())  # unsigned: not trusted
    assert a.lineage == b.lineage == lineage
    assert b.presence_addresses({a.this_node, b.this_node}) == {
        a.this_node: "127.0.0.1:1",
        b.this_node: "127.0.0.1:2",
    }
    began = time.monotonic()
    form(a, b)
    assert time.monotonic() - began < HANG_S
    assert a.store.raw is moved and shared_state(b).participants.keys() == {
        a.this_node,
        b.this_node,
    }


def test_a_survivor_still_moving_to_a_failed_over_store_is_waited_for(nodes) -> None:
    """Survivors of a store host's loss reach the new store seconds apart (64 agents here:
    over 13 s). One not there yet has no heartbeat in it, but its presence connection is
    open: the first round there is held past its last call until it joins, instead of
    closing short of it (a group it would restart at once by joining)."""
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    form_with_last_call_of(a, b, c)
    moved = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", moved.port, is_master=False, timeout=timedelta(seconds=30))
    for survivor in (a, b):
        survivor.mark_dead({c.this_node})  # c hosted the old store and is gone
        survivor.tune(first_last_call_s=3.0, later_last_call_s=0.2)
    c._stop_heartbeats()
    a.connected_now = lambda: {b.this_node, c.this_node}
    a.rebind(moved, hosted=True, node="a")
    first = Joining(a)

    def held_past_its_last_call() -> bool:
        state = shared_state(a)  # None until a's first write to the new store
        if state is None:
            return False
        ran_out = state.deadline is not None and state.deadline < datetime.now(timezone.utc)
        return set(state.participants) == {a.this_node} and ran_out and not state.complete

    wait_for(held_past_its_last_call)
    b.rebind(client, hosted=False, node="b")
    second = Joining(b)
    assert (first.result(), second.result()) == (2, 2)


def test_a_member_neither_in_a_failed_over_store_nor_connected_is_not_waited_for(nodes) -> None:
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    form_with_last_call_of(a, b, c)
    moved = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    a.mark_dead({c.this_node})
    a.tune(first_last_call_s=3.0, later_last_call_s=0.2)
    a.connected_now = set  # b's connection is gone too (it is lost, not yet marked dead)
    a.rebind(moved, hosted=True, node="a")
    began = time.monotonic()
    assert Joining(a).result() == 1
    assert time.monotonic() - began < HANG_S


def form_with_last_call_of(*handlers: FastRecoveryRendezvousHandler) -> None:
    for handler in handlers:
        handler.tune(first_last_call_s=3.0, later_last_call_s=30.0)
    form(*handlers)


def test_a_preempted_store_host_says_so_in_its_store(nodes) -> None:
    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    assert b.leaving_host() is None
    a.say_leaving()
    a.store.get(rendezvous.leaving_key("job"))  # c10d's set has no reply: this orders it
    assert b.leaving_host() == a.member_name()


def test_a_member_found_gone_while_we_wait_in_the_round_is_not_waited_for(nodes) -> None:
    """Our worker failed on a peer's dead worker a moment before that peer's agent connection
    closed: we joined without knowing it dead. Once the agent's presence watch knows, the
    round closes without it, not after its heartbeats expire (30 s here) or the last call."""
    a, b = nodes(max_nodes=3), nodes(max_nodes=3)
    form_with_last_call(a, b)
    known: set[Any] = set()
    a.dead_now = lambda: set(known)
    joining = Joining(a)
    wait_for(lambda: b.num_nodes_waiting() == 1)  # a waits for b to rejoin
    began = time.monotonic()
    known.add(b.this_node)  # its connection closed
    assert joining.result() == 1
    assert time.monotonic() - began < HANG_S


def test_a_round_whose_last_call_runs_out_waits_for_a_live_member_still_rejoining(nodes) -> None:
    """Many survivors of a node loss rejoin seconds apart (each stops its workers first, on a
    busy store): a round closed at its short last call would start without the late ones,
    which join at once, a restart for everyone, over and over. A member of the last round
    whose own heartbeat is fresh keeps the round open past its last call."""
    a, b = nodes(max_nodes=3), nodes(max_nodes=3)
    form_with_last_call(a, b)
    a.tune(first_last_call_s=3.0, later_last_call_s=0.2)
    b.leave()  # b's agent is still stopping its workers: out of the round, beating
    first = Joining(a)

    def held_past_its_last_call() -> bool:
        state = shared_state(a)
        ran_out = state.deadline is not None and state.deadline < datetime.now(timezone.utc)
        return set(state.participants) == {a.this_node} and ran_out and not state.complete

    wait_for(held_past_its_last_call)
    second = Joining(b)
    assert (first.result(), second.result()) == (2, 2)


def test_the_opener_lets_in_no_node_the_job_did_not_sign_nor_one_without_a_heartbeat(
    nodes,
) -> None:
    """Anyone who reaches the store can append to a round's join log: a line signed with
    another key is refused, and a signed line of a node whose heartbeat key is not fresh
    (it asked, then died) does not make it a member either. Both are logged before the one
    real newcomer: let in, either would fill the round of two in its place."""
    from elastic_trainer.supervisor.rendezvous import join_log

    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    first = Joining(a)
    wait_for(lambda: a.this_node in joined(b))
    key = join_log.log_key("job", 0)
    forged = join_log.line(JobKey.generate(), key, ["evil", 666, 0])
    gone = join_log.line(KEY, key, ["gone", 667, 0])  # signed, but no heartbeat key
    a.store.raw.append(key, b"junk" + forged + gone)
    second = Joining(b)
    assert (first.result(), second.result()) == (2, 2)
    assert joined(a) == {a.this_node, b.this_node}


def test_a_node_its_opener_never_lets_in_joins_by_itself_after_its_patience(
    nodes, monkeypatch
) -> None:
    """An opener that never reads the log (frozen, or the log stuffed with junk): a node
    waiting in its lobby joins by torch's own compare-and-set once its patience runs out."""
    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    monkeypatch.setattr(a, "_fold", lambda view, closing: [])
    b.lobby_patience_s = 0.5
    first = Joining(a)
    wait_for(lambda: a.this_node in joined(b))
    second = Joining(b)
    assert (first.result(), second.result()) == (2, 2)
    assert b._lobby_round == 0  # it did ask first


def test_a_node_let_in_by_the_old_store_s_log_asks_again_in_the_failed_over_one(nodes) -> None:
    """Round numbers start again in a failed-over store: a survivor that asked to join round
    0 of the old store asks again in the new store's round-0 log (it used to take its old
    request for a new one and wait out its patience, unseen by the opener)."""
    a, b, c = nodes(max_nodes=3), nodes(max_nodes=3), nodes(max_nodes=3)
    first = Joining(a)
    wait_for(lambda: a.this_node in joined(b))
    second = Joining(b)  # b asks a to let it in: round 0's log
    wait_for(lambda: b.this_node in joined(a))
    assert (Joining(c).result(), first.result(), second.result()) == (3, 3, 3)
    moved = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", moved.port, is_master=False, timeout=timedelta(seconds=30))
    for handler in (a, b):
        handler.mark_dead({c.this_node})
    c._stop_heartbeats()
    a.rebind(moved, hosted=True, node="a")
    b.rebind(client, hosted=False, node="b")
    first = Joining(a)
    wait_for(lambda: a.this_node in joined(b))
    second = Joining(b)  # b finds round 0 open with a in it: its log, in this store
    assert (first.result(), second.result()) == (2, 2)


def test_a_node_waiting_in_a_first_round_reads_the_state_when_it_closes_not_per_join(
    nodes, monkeypatch
) -> None:
    """Members of a first round that they cannot close themselves (only the opener closes a
    full one) wait for the round to move on or close: the state's write mark names its round
    and completion, and they read the whole state only when those change. Each used to read
    it after every other node let in: N waiters, N joins, O(N) bytes each."""
    a, b, c, d = (nodes(max_nodes=4) for _ in range(4))
    first = Joining(a)
    wait_for(lambda: a.this_node in joined(b))
    second = Joining(b)
    wait_for(lambda: b.this_node in joined(a))
    peeks: list[int] = []
    peek = b.state_backend.peek
    monkeypatch.setattr(b.state_backend, "peek", lambda: peeks.append(1) or peek())
    third = Joining(c)
    wait_for(lambda: c.this_node in joined(a))
    assert peeks == []  # c let in: not b's business
    assert (Joining(d).result(), first.result(), second.result(), third.result()) == (4,) * 4
    assert peeks == []  # the mark said it closed: torch's sync reads it (a peek read it twice)


def test_the_state_s_write_mark_names_its_round_and_completion() -> None:
    from elastic_trainer.supervisor.rendezvous.state_backend import SignedStateBackend

    assert SignedStateBackend.round_of("12.1.00ff") == (12, True)
    assert SignedStateBackend.round_of("0.0.abc") == (0, False)
    for other in ("00ff00ff", "x.1.a", "1.2.a", "", "1", "9" * 20 + ".0.a"):
        assert SignedStateBackend.round_of(other) is None


def test_a_join_log_filled_with_junk_is_read_once_and_its_nodes_join_by_themselves(
    nodes, monkeypatch
) -> None:
    """Anyone who reaches the store can append megabytes to a round's join log, which the
    opener polls: it reads an oversized log once, never again that round, and says so; the
    node waiting in it joins by torch's own compare-and-set after its patience."""
    from elastic_trainer.supervisor.rendezvous import join_log

    a, b = nodes(max_nodes=2), nodes(max_nodes=2)
    b.lobby_patience_s = 0.5
    first = Joining(a)
    wait_for(lambda: a.this_node in joined(b))
    key = join_log.log_key("job", 0)
    a.store.raw.append(key, b"x" * (join_log.max_log_bytes(2) + 1))
    reads: list[str] = []

    class Counted:  # a's connection to the store, counting its reads of the log
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def compare_set(self, k: str, expected: Any, desired: Any) -> Any:
            if k == key:
                reads.append(k)
            return self.inner.compare_set(k, expected, desired)

    monkeypatch.setattr(a.store, "raw", Counted(a.store.raw))
    with capture_logs() as logs:
        second = Joining(b)
        assert (first.result(), second.result()) == (2, 2)
    assert len(reads) == 1
    assert [e["reason"] for e in logs if e["event"] == "store.tampered"] == ["oversized"]
