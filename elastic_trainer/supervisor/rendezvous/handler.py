"""torch's c10d dynamic rendezvous, with the knobs fast recovery needs.

We use torch's own ``C10dRendezvousBackend`` and ``DynamicRendezvousHandler``; the subclass
changes the following, each for the reason stated with it (what they add up to:
docs/how-it-works.md, "A dead node is known at once" and "No idle waits"; the defaults:
docs/command-line.md, "Recovery defaults"):

- the last-call wait is patient on the first round (nodes start seconds apart: a short wait
  splits the job in two) and short on later rounds (a failure or a membership change: every
  second waited is a second of downtime);
- heartbeats tick at half the keep-alive interval: torch only sends one when the previous is
  at least an interval old, so ticking at the interval itself spaces them up to 2 intervals
  apart and a live node can miss its expiry;
- ``leave()`` takes this node out of the round *without* closing the rendezvous (torch's
  ``shutdown()`` closes it for every node): a preempted node leaves, the others re-form;
- in torchrun's static mode (``--node-rank``) the node's group rank is its node rank, as in
  torch's static rendezvous: torch's c10d handler numbers nodes by sorting their
  descriptors (address, pid), which a fixed-size world then renumbers here. The agents'
  worker-rank assignment only needs the group ranks to be 0 .. nnodes-1 in some order. The
  workers' store (``MASTER_ADDR:MASTER_PORT``) is hosted by global rank 0, which is then on
  node rank 0, so node rank 0 publishes its own address for it (torch's published the address
  of the node *it* numbered 0: on separate machines the other workers would dial a host where
  no store runs). Each node publishes its declared node rank before it joins, and every node
  checks the closed round's ranks (``decisions.static_rank_conflict``): two nodes given one
  ``--node-rank`` end with ``ConfigError`` (exit 2) on each of them instead of a hang.
- no idle waits: a re-forming round closes as soon as every node still alive from the previous
  round (and every node already waiting) has joined (``decisions.close_round_now``); nodes the
  agent knows are gone (``mark_dead``: their connection closed, or confirmed silent) are expired
  in the shared state first, so nobody waits for their heartbeats to run out; and a node that
  waits for others polls the mark of the state's last write every 50 ms
  (``SignedStateBackend.version``) and reads the state when it moved, instead of torch's fixed
  1 s sleep.
- a re-form joins at once: torch sleeps a random 0-0.3 s before joining while the round is
  0, meant to spread a job's first joins, which its first re-form (the round is still 0 then)
  paid too;
- a failed keep-alive heartbeat is counted, not logged (torch logs a warning per tick: with
  the store gone that was two lines a second, for as long as the workers ran). The one
  ``store.unreachable`` event comes from the membership watch, which reads the same store on
  every monitor pass; the handler keeps the streak (``heartbeat_failures``) for it and tests.
- every node of one rendezvous store shares a lineage token (``share_lineage``), which the
  workers inherit (``ENV_RDZV_LINEAGE``): a snapshot folder's owner record carries it, so a
  later attempt of the same rendezvous takes the folder over at once while a run formed on
  another store (a restarted node that did not find the job's) is refused while the recorded
  run is alive (``snapshots.ownership``).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from types import MappingProxyType
from typing import Any

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic_trainer.contract import protocol
from elastic_trainer.contract.auth import JobKey
from elastic_trainer.contract.config import RunConfig
from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ConfigError, first_line
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.core import decisions
from elastic_trainer.supervisor.rendezvous import join_log, signed_store, static_host
from elastic_trainer.supervisor.rendezvous.membership import member_name, node_name
from elastic_trainer.supervisor.rendezvous.state_backend import SignedStateBackend


class FastRecoveryRendezvousHandler(DynamicRendezvousHandler):
    """A ``DynamicRendezvousHandler`` with per-round last-call and a non-closing leave."""

    _first_last_call = timedelta(seconds=15)
    _later_last_call = timedelta(seconds=2)
    _rounds_joined = 0
    _static_rank: int | None = None
    _known: frozenset[Any] = frozenset()  # the members of the last round this node formed
    _dead: frozenset[Any] = frozenset()  # nodes known gone, expired before the next join
    store: Any = None  # the c10d store (create_handler): state polls and presence addresses
    poll_s = 0.05  # while waiting for others to join: how often the state is read
    _joining = False  # inside torch's next_rendezvous
    _rejoin_round: int | None = None  # ... having announced a re-join from this round
    _announced = ""  # the key of our last announcement (deleted at the next)
    _state_cached = False  # ... made from torch's cached state (``_state_to_leave``)
    _mark_checked_at = -math.inf  # when num_nodes_waiting last read the round's mark
    _state_checked_at = -math.inf  # when a running member last asked if the state moved
    _state_read_at = -math.inf  # ... and last read it whole (``_running_state``)
    _beats_seen: Mapping[Any, int | None] = MappingProxyType({})  # stale_peers' last read
    _beats_seen_at_us = -math.inf  # ... and when (µs since the epoch)
    _mark_seen: tuple[int, int] = (-1, 0)  # ... of which round, and what it said
    _beating = False  # our heartbeat timer runs
    _lobby_round = -1  # the round whose join log we asked to be let in by (join_log)
    _lobby_since = -math.inf  # ... since when
    lobby_patience_s = 6.0  # then torch's own join (handler_on: twice the heartbeat expiry)
    _log_seen: tuple[int, int] = (-1, 0)  # the opener's last read of a join log: round, size
    _opened_round = -1  # the last round we let nodes into (we stay its opener: ``_opens``)
    _log_spoiled = -1  # a round whose join log was found oversized: not read again
    heartbeat_failures = 0  # consecutive failed keep-alive heartbeats (0 after a success)
    heartbeat_error = ""  # the first line of the streak's first failure
    lineage = ""  # this store's lineage token (share_lineage); "" for a bare handler
    # members found gone while we wait in a round (the agent's presence watch: a node's
    # worker can fail ours a moment before its agent's connection closes)
    dead_now: Callable[[], set[Any]] | None = None
    # members whose presence connection is open (the agent's watch): alive though not yet in
    # a failed-over store (``decisions.alive_members``)
    connected_now: Callable[[], set[Any]] | None = None
    presence_address = ""  # ours, as published (again into a failed-over store)
    state_backend: SignedStateBackend | None = None  # where the state is (create_handler)
    endpoint = ""  # the store's HOST:PORT now (after a failover, the new one)
    node_label = ""  # our --node name, as published (again into a failed-over store)

    @property
    def job_key(self) -> JobKey:
        """The job's secret, which signs every value in the store (``signed_store``)."""
        return self.store.key  # type: ignore[no-any-return]

    def tune(self, *, first_last_call_s: float, later_last_call_s: float) -> None:
        self._first_last_call = timedelta(seconds=first_last_call_s)
        self._later_last_call = timedelta(seconds=later_last_call_s)

    def use_static_rank(self, node_rank: int | None) -> None:
        """torchrun's static mode: this node is group rank ``node_rank`` in every round."""
        self._static_rank = node_rank

    def next_rendezvous(self) -> Any:
        last_call = self._first_last_call if self._rounds_joined == 0 else self._later_last_call
        torch_compat.set_last_call_timeout(self, last_call)
        torch_compat.install_join_hook(
            self,
            self._join_hook,
            self._dead_while_joining,
            self._hold_round_open,
            lambda: self._joining,
            self._leave_hook,
            self._lobby,
            self._fold,
        )
        self._rounds_joined += 1
        if self.state_backend is not None:  # our key exists before we are in the state
            self._keep_alive()
            self._start_heartbeats()  # ... and stays fresh through the join (_stop_heartbeats)
        closed = self._dead_while_joining()  # adds those found now to _dead: read it after
        if self._dead - closed:  # the join's first write expires the closed ones itself
            self._expire_dead()
        if self._static_rank is not None and self.store is not None:
            self._publish("node-rank", str(self._static_rank))  # before joining: see check
        self._rejoin_round = self._announce_rejoin()
        # the jitter that spreads a job's first joins, not its re-forms (torch_compat)
        jitter = self._rounds_joined == 1
        self._joining = True
        try:
            with contextlib.nullcontext() if jitter else torch_compat.no_join_jitter():
                info = super().next_rendezvous()
        except BaseException:
            self._joining = False
            self._stop_heartbeats()  # as torch leaves them after a failed join
            raise
        finally:
            self._joining, self._rejoin_round, self._state_cached = False, None, False
        if self.lineage:  # the workers of this round start after it: they inherit it
            os.environ[ENV_RDZV_LINEAGE] = self.lineage
        if self.endpoint:  # ... and where it is now (snapshots' owner record: run_liveness)
            os.environ[protocol.ENV_RDZV_ENDPOINT] = self.endpoint
        self._known, self._dead = frozenset(self.participants()), frozenset()
        # the join read the state whole: the first monitor pass after it need not again
        self._state_read_at = self._state_checked_at = time.monotonic()
        self._forget_join_log()
        if self._static_rank is not None and self.store is not None:
            self._check_static_ranks(info.world_size)
        return with_group_rank(info, self._static_rank, local_addr=self.this_node.addr)

    def _announce_rejoin(self) -> int | None:
        """A member of a complete round that joins the next: it says so in its own key (and
        sets the round's mark, which the running members' monitors read as nodes waiting)
        instead of leaving the round and joining the wait list by writes of the one shared
        state; the round's opener (``_leave_hook``) then opens the next round for every
        member that said so, in one write. The round it announced for; None where torch's own
        exit and join apply (a first join, a failed-over store, a round never completed)."""
        if self.state_backend is None or self.store is None or self._rounds_joined <= 1:
            return None
        try:
            state = self._state_to_leave()
            if not state.complete or state.closed or self.this_node not in state.participants:
                return None
            round_ = int(state.round)
            key = rejoin_key(self.get_run_id(), round_, self.this_node)
            if self._announced and self._announced != key:  # the store keeps no old rounds'
                self.store.delete_key(self._announced)
            self.store.set(key, "1")
            self.store.set(rejoin_mark_key(self.get_run_id(), round_), "1")
        except Exception:  # the store is failing: torch's own ops say how
            return None
        self._announced = key
        return round_

    def _state_to_leave(self) -> Any:
        """The state of the round this member re-joins from: torch's cached one when the
        store's version mark says it is unchanged (two small reads), which torch's exit op
        then takes too; else read. A read of the running round's state takes every member's
        heartbeat key (its times are the round's start): each survivor of a re-form read the
        state and N keys before its announcement. A cached state is never written
        (``_leave_hook`` reads it first): torch's expiry, run on a write's own copy, would
        find every member's time stale and drop them all. A mark that lags a write only
        delays the news: the exit op waits on the mark and then reads the state."""
        backend = self.state_backend
        if backend is not None and backend.unchanged():
            torch_compat.trust_cached_state(self)
            self._state_cached = True
            return torch_compat.rendezvous_state(self)
        return torch_compat.rendezvous_state(self, sync=True)

    def _leave_hook(self, ctx: Any) -> str | None:
        """torch's exit op, for a member that announced its re-join (``_announce_rejoin``):
        done once the round has moved on; where this node opens the next round (the first of
        the members not known dead, in torch's node order) and every one of them has
        announced, the next round with them (``torch_compat.open_next_round``); else wait
        for a change. None: torch's own exit (leaving for good, or no announcement)."""
        announced = self._rejoin_round
        if announced is None or not self._joining:
            return None
        state = ctx.state
        if state.round > announced:
            return torch_compat.LEFT
        member = self.this_node in state.participants
        if state.round < announced or not state.complete or not member:
            return None
        self._raise_if_static_conflict()
        self._newly_dead()
        members = set(state.participants) - self._dead
        opens = min(members) == self.this_node
        if opens and not self._state_cached:  # else it reads the state first (POLLED)
            if self._all_announced(announced, members):
                view = torch_compat.round_view(ctx)
                torch_compat.open_next_round(
                    ctx, members, close=lambda joined: self._closes_at_once(joined, view)
                )
                self._forget_mark(announced)
                return torch_compat.OPENED
            time.sleep(self.poll_s)  # a member's key may be on its way
        elif not opens:
            self._wait_for_change(torch_compat.round_view(ctx))
        self._state_cached = False  # POLLED: the executor reads the state at once
        return torch_compat.POLLED

    def _forget_mark(self, round_: int) -> None:
        """The mark of a round whose members have all re-joined: nobody reads it again (the
        store would keep one per round). Should this open lose its write, the next try needs
        only the members' own keys."""
        with contextlib.suppress(Exception):
            self.store.delete_key(rejoin_mark_key(self.get_run_id(), round_))

    def _forget_join_log(self) -> None:
        """The join log of the round that just closed, where we opened it: nobody reads it
        again (the store would keep one per round). A node that asks late only recreates it."""
        round_ = self.round
        if self._opened_round == round_ and self.store is not None:
            with contextlib.suppress(Exception):
                self.store.delete_key(join_log.log_key(self.get_run_id(), round_))

    def _closes_at_once(self, joined: set[Any], view: torch_compat.RoundView) -> bool:
        """The round about to open with ``joined`` closes at once where the join hook would
        close it (``decisions.close_round_now``): no member of the last round still alive is
        missing (one that left it, still on its way back, is waited for as before). A
        missing member that is not alive either (``_alive``: silent, and found so by its
        watchers, ``decisions.peers_to_watch``, not by us) is not waited for."""
        missing = (self._known - self._dead) - joined
        silent = missing - self._alive(missing) if missing else set()
        return decisions.close_round_now(
            me=self.this_node,
            complete=False,
            joined=joined,
            waiting=set(),
            known=self._known,
            dead=self._dead | silent,
            min_nodes=view.min_nodes,
            max_nodes=view.max_nodes,
        )

    def _all_announced(self, round_: int, members: set[Any]) -> bool:
        """Has every one of ``members`` announced its re-join from ``round_`` (signed)? One
        check for all, then one verified read."""
        keys = [rejoin_key(self.get_run_id(), round_, n) for n in sorted(members)]
        try:
            found = self.store.get_each_if_all(keys)
            return found is not None and None not in found
        except Exception:
            return False

    def num_nodes_waiting(self) -> int:
        """torch's count (the wait list), or 1 where a member of the current complete round
        announced its re-join (``_announce_rejoin``): the running members re-form with it.
        The mark is read at most once per ``MARK_CHECK_S``, as torch reads the wait list."""
        state = self._running_state()
        waiting = len(state.wait_list)
        if waiting or self.store is None or not state.complete:
            return waiting
        round_, now = int(state.round), time.monotonic()
        if self._mark_seen[0] == round_ and now < self._mark_checked_at + MARK_CHECK_S:
            return self._mark_seen[1]  # as read last, for this round
        self._mark_checked_at = now
        key = rejoin_mark_key(self.get_run_id(), round_)
        seen = 0
        with contextlib.suppress(signed_store.TamperedValue):
            seen = 1 if self.store.check([key]) and self.store.get(key) == b"1" else 0
        self._mark_seen = (round_, seen)
        return seen

    def _check_static_ranks(self, num_nodes: int) -> None:
        """Every member published its rank before it joined, so all are readable now."""
        published = self._published("node-rank", set(self._known))
        declared = {member_name(n): int(rank) for n, rank in published.items()}
        problem = decisions.static_rank_conflict(declared, num_nodes)
        if problem is not None:
            self._await_all_checked()
            raise ConfigError(problem)

    def _raise_if_static_conflict(self) -> None:
        """Static mode: a second node rank 0 on another host wrote what it found into our
        store while we wait for a round (``static_host``): exit 2 with that line."""
        if self._static_rank is None or self.store is None:
            return
        problem = static_host.conflict_in(self.store, self.get_run_id())
        if problem is not None:
            raise ConfigError(problem)

    def _await_all_checked(self) -> None:
        """Every member finds the same conflict; the one hosting the store must not exit (and
        take the store along) before the others have read the ranks, or they would report a
        lost store instead. Bounded: a member that never says so is not waited for long."""
        self._publish("node-rank-checked", "1")
        keys = [self._key("node-rank-checked", n) for n in self._known]
        with contextlib.suppress(Exception):  # timed out, or the store went: exit all the same
            self.store.wait(keys, timedelta(seconds=CHECKED_WAIT_S))

    def mark_dead(self, nodes: set[Any]) -> None:
        """Nodes known gone: expired in the shared state before our next join, and not waited
        for. Only for certain knowledge (a closed connection, a goodbye, a confirmed silence)."""
        self._dead = self._dead | frozenset(nodes)

    def _expire_dead(self) -> None:
        """Before the join: the nodes known gone that its own hook does not expire (a goodbye,
        a confirmed silence, the old store host). The closed connections the join expires in
        its own first write (``_dead_while_joining``): every survivor of a node loss expiring
        it first, each with a read of the whole state and most with a losing write, cost
        each of them about 130 ms of store round trips before its join at 64 nodes."""
        deadline = time.monotonic() + torch_compat.close_timeout_s(self)
        try:
            torch_compat.expire_nodes(self, set(self._dead), deadline)
        except Exception as exc:  # their heartbeats still expire: slower, not wrong
            emit(
                "rendezvous.expire_failed",
                level="warning",
                nodes=sorted(node_name(n) for n in self._dead),
                error=first_line(str(exc)) or type(exc).__name__,
                consequence="the next round waits for their heartbeats to expire",
            )

    def _dead_while_joining(self) -> set[Any]:
        """Members whose process is gone (``dead_now``: closed connections, certain), to expire
        in the shared state while we wait in a round. Not those merely confirmed silent: a
        thawed node may rejoin this round."""
        self._newly_dead()
        return set(self.dead_now()) if self.dead_now is not None else set()

    def _newly_dead(self) -> bool:
        """Add the members found gone since we joined to ``_dead``; whether there were any."""
        found = frozenset(self.dead_now()) - self._dead if self.dead_now is not None else None
        if found:
            self._dead = self._dead | found
        return bool(found)

    def _join_hook(self, view: torch_compat.RoundView, may_wait: bool) -> str | None:
        self._raise_if_static_conflict()
        self._newly_dead()
        close = decisions.close_round_now(
            me=view.me,
            complete=view.complete,
            joined=view.joined,
            waiting=view.waiting,
            known=self._known,
            dead=self._dead,
            min_nodes=view.min_nodes,
            max_nodes=view.max_nodes,
        )
        if close:
            return torch_compat.CLOSE
        if may_wait and self.store is not None:
            self._wait_for_change(view)
            return torch_compat.POLLED
        return None

    def _lobby(self, view: torch_compat.RoundView) -> str | None:
        """Not in round ``view`` yet, which is open and has members: ask its opener to let us
        in (one append to the round's log, ``join_log``) and wait, instead of adding ourselves
        by a compare-and-set of the whole state that every other arriving node races. Torch's
        own join (None) where there is no store to log in, or once we have waited
        ``lobby_patience_s`` for this round without being let in (an opener that died, or a
        log someone filled with junk)."""
        if self.store is None or self.state_backend is None:
            return None
        now = time.monotonic()
        if self._lobby_round != view.round:
            key = join_log.log_key(self.get_run_id(), view.round)
            node = [view.me.addr, view.me.pid, view.me.local_id]
            try:
                self.store.raw.append(key, join_log.line(self.job_key, key, node))
            except Exception:  # the store is failing: torch's own ops say how
                return None
            self._lobby_round, self._lobby_since = view.round, now
        elif now - self._lobby_since > self.lobby_patience_s:
            return None
        self._wait_for_change(view, bound_s=self.lobby_patience_s, lobby=True)
        return torch_compat.POLLED

    def _fold(self, view: torch_compat.RoundView, closing: bool) -> list[Any]:
        """The nodes to let into open round ``view`` now: where we open it (``_opens``) or
        close it, every node its log names that is not in it, not known dead and alive by
        its own heartbeat key, in the order they asked, up to max_nodes."""
        if self.store is None or not view.joined or view.complete:
            return []
        if not closing and not self._opens(view):
            return []
        self._opened_round = view.round
        room = view.max_nodes - len(view.joined)
        if room <= 0:
            return []
        asked = self._read_join_log(view)
        candidates = [n for n in asked if n not in view.joined and n not in self._dead]
        alive = self._alive(set(candidates))
        return [n for n in candidates if n in alive][:room]

    def _opens(self, view: torch_compat.RoundView) -> bool:
        """Do we let nodes into open round ``view``: as its first member in node order, or as
        the one that has been letting them in (a node let in may come first in that order,
        and it waits without reading the log until the round moves on: two openers cost a
        lost write now and then, none would leave the log unread)."""
        if view.complete or view.me not in view.joined:
            return False
        return self._opened_round == view.round or min(view.joined) == view.me

    def _read_join_log(self, view: torch_compat.RoundView) -> list[Any]:
        """The nodes round ``view``'s log names, in order (none: no log, unreadable, or
        longer than a round could hold)."""
        raw = self._join_log_bytes(view)
        if raw is None:
            return []
        self._log_seen = (view.round, len(raw))
        key = join_log.log_key(self.get_run_id(), view.round)
        entries, refused = join_log.parse(self.job_key, key, raw, max_nodes=view.max_nodes)
        if refused:
            self.store.log.refused(key, "bad_tag")
        return [torch_compat.node_of(e) for e in entries]

    def _log_grew(self, view: torch_compat.RoundView) -> bool:
        """Has round ``view``'s log grown since we last read it (the opener's wait)?"""
        raw = self._join_log_bytes(view)
        if raw is None:
            return False
        seen_round, seen_len = self._log_seen
        return len(raw) > (seen_len if seen_round == view.round else 0)

    def _join_log_bytes(self, view: torch_compat.RoundView) -> bytes | None:
        """Round ``view``'s log as stored (compare-and-set against "absent": the log, or an
        empty one made now); None where it is unreadable or was found longer than a round
        could hold: not read again this round (someone filled it to make every read costly;
        the nodes in it join by torch's own compare-and-set after their patience)."""
        if self._log_spoiled == view.round:
            return None
        key = join_log.log_key(self.get_run_id(), view.round)
        try:
            raw = bytes(self.store.raw.compare_set(key, b"", b""))
        except Exception:
            return None
        if len(raw) > join_log.max_log_bytes(view.max_nodes):
            self._log_spoiled = view.round
            self.store.log.refused(key, "oversized")
            return None
        return raw

    def _hold_round_open(self, view: torch_compat.RoundView) -> bool:
        """The last call ran out: members of the last round still on their way (alive by
        their own heartbeat key) keep the round open (``decisions.hold_round_open``)."""
        self._newly_dead()
        if view.last_call_ends is None or not self._known:
            return False
        missing = (self._known - self._dead) - view.joined
        held_s = (datetime.now(timezone.utc) - view.last_call_ends).total_seconds()
        return decisions.hold_round_open(
            complete=view.complete,
            joined=view.joined,
            known=self._known,
            dead=self._dead,
            alive=self._alive(missing),
            max_nodes=view.max_nodes,
            held_s=held_s,
        )

    def _alive(self, nodes: set[Any]) -> set[Any]:
        """Those of ``nodes`` alive by their own heartbeat key, or on their way to this store
        (``decisions.alive_members``); none when the store cannot be read, so that a round
        is never held on a guess."""
        if not nodes or self.state_backend is None:
            return set()
        try:
            beats = self.state_backend.beats(list(nodes))
        except Exception:
            return set()
        connected = set(self.connected_now()) if self.connected_now is not None else set()
        return decisions.alive_members(
            beats, connected, now_us=_us(datetime.now(timezone.utc)), expiry_us=self._expiry_us()
        )

    def _expiry_us(self) -> float:
        """How long a node's heartbeat stays fresh: keep-alive interval x attempts, in µs."""
        interval_s, attempts = torch_compat.keep_alive(self)
        return interval_s * attempts * 1e6

    def _wait_for_change(
        self, view: torch_compat.RoundView, *, bound_s: float | None = None, lobby: bool = False
    ) -> None:
        """Until round, completion, participants or wait list change (not mere heartbeats),
        at most half a keep-alive interval (``bound_s``: that long) and never past the
        round's last-call deadline (torch's op closes the round then). The round's opener
        also wakes when its join log grows; a node in the lobby (``lobby``) or a member that
        cannot close the round wakes only when the round moves on or closes, not at every
        node let in, and waits up to a heartbeat expiry."""
        interval_s, attempts = torch_compat.keep_alive(self)
        opener = not lobby and self._opens(view)
        # a member of a round it cannot close by itself (no last round's members to wait
        # for: only a full round or its last call closes it, and the opener closes a full
        # one) waits for the round to move on or close; it re-reads the state once per
        # heartbeat expiry, to take over from an opener that died
        quiet = lobby or (not opener and not self._known and not view.complete)
        if bound_s is None:
            bound_s = interval_s * attempts if quiet else interval_s / 2
        wait_s = bound_s
        if view.last_call_ends is not None:
            left_s = (view.last_call_ends - datetime.now(timezone.utc)).total_seconds()
            wait_s = min(wait_s, max(0.0, left_s))
        until = time.monotonic() + wait_s
        seen = None  # the state's write mark when last read: unchanged, not read again
        while time.monotonic() < until:
            time.sleep(self.poll_s)
            self._raise_if_static_conflict()
            if self._newly_dead():
                return
            if opener and self._log_grew(view):
                return
            try:
                version = self.state_backend.version() if self.state_backend is not None else None
                if version is not None and version == seen:
                    continue  # not written since: each waiter read N nodes' state 20 times a second
                seen = version
                named = SignedStateBackend.round_of(version) if version is not None else None
                if quiet and named == (view.round, view.complete):
                    continue  # another node let in: N waiters each read the state per join
                if named is not None and named != (view.round, view.complete):
                    return  # moved on or closed: torch's sync reads it (not twice: N each)
                state = self.state_backend.peek() if self.state_backend is not None else None
            except Exception:  # unreadable or refused now: torch's own sync deals with it
                return
            if state is None:
                return
            now = torch_compat.state_view(state, view)
            moved = (now.round, now.complete) != (view.round, view.complete)
            if lobby and not moved and view.me not in now.joined:
                continue  # another node let in: not what we wait for
            if now.key() != view.key():
                return

    def _start_heartbeats(self) -> None:
        if not self._beating:
            torch_compat.start_fast_heartbeats(self)
            self._beating = True

    def _stop_heartbeats(self) -> None:
        # torch stops them for a join because its heartbeats were writes of the state the
        # join writes too. Ours are our own key: they go on, or a join that lasts longer than
        # the expiry (many nodes re-forming at once) would drop us from the round we wait in.
        if self._joining and self.state_backend is not None:
            return
        super()._stop_heartbeats()
        self._beating = False

    def _keep_alive(self) -> None:
        """A heartbeat, in this node's own key (``SignedStateBackend.beat``: not a rewrite
        of the whole state), without torch's per-failure warning. Any error is caught: one
        raised on the timer thread would end the heartbeats for good."""
        try:
            if self.state_backend is not None:
                self.state_backend.beat(self.this_node, _us(datetime.now(timezone.utc)))
            else:
                torch_compat.send_heartbeat(self)
        except Exception as exc:
            if self.heartbeat_failures == 0:
                self.heartbeat_error = first_line(str(exc)) or type(exc).__name__
            self.heartbeat_failures += 1
            return
        self.heartbeat_failures, self.heartbeat_error = 0, ""

    @property
    def round(self) -> int:
        return int(torch_compat.rendezvous_state(self).round)

    def participants(self) -> set[Any]:
        return set(torch_compat.rendezvous_state(self).participants)

    def leave(self) -> bool:
        """Leave the current round without closing the rendezvous. Best effort."""
        deadline = time.monotonic() + torch_compat.close_timeout_s(self)
        try:
            torch_compat.exit_round(self, deadline)
            return True
        except Exception as exc:  # the store may be gone: our heartbeat then simply expires
            emit(
                "rendezvous.leave_failed",
                level="warning",
                error=first_line(str(exc)) or type(exc).__name__,
                consequence="the others drop this node once its heartbeats expire",
            )
            return False

    def _running_state(self) -> Any:
        """The rendezvous state as a running member needs it (nodes waiting, members still in
        the round): read whole only when its version mark moved, or every ``STATE_REREAD_S``;
        asked at most every ``STATE_CHECK_S`` (torch's own cache). Every member read the
        whole state and every node's heartbeat once a second: at 128 agents 4 MB/s through
        the store while nothing happened, growing with N². A whole read is torch's sync
        (its expiry removes nodes whose heartbeats ran out)."""
        now = time.monotonic()
        backend = self.state_backend
        if backend is None:
            super().num_nodes_waiting()  # torch's sync, cached
            return torch_compat.rendezvous_state(self)
        if now < self._state_checked_at + STATE_CHECK_S:
            return torch_compat.rendezvous_state(self)
        self._state_checked_at = now
        if now < self._state_read_at + STATE_REREAD_S and backend.unchanged():
            return torch_compat.rendezvous_state(self)
        state = torch_compat.rendezvous_state(self, sync=True)
        self._state_read_at = now
        return state

    def stale_peers(self, members: set[Any]) -> set[Any]:
        """Those of ``members`` (of our last round) that left it or stopped sending
        heartbeats: their own heartbeat keys are read, not everyone's. A heartbeat that
        changed since our last read, within the expiry, is a live node's however old its
        time: a beat stamped, then delivered late (a busy store, a loaded client) still
        moves the key. A frozen or cut-off node's beat does not change; nor does a live
        node's whose heartbeat thread gets no CPU for the expiry (docs/benchmarks.md: 128
        agents on two cores)."""
        state = self._running_state()
        others = members - {self.this_node}
        expiry_us, now_us = self._expiry_us(), _us(datetime.now(timezone.utc))
        beats = self.state_backend.beats(list(others)) if self.state_backend is not None else {}
        seen = self._beats_seen if now_us - self._beats_seen_at_us < expiry_us else {}
        self._beats_seen, self._beats_seen_at_us = dict(beats), now_us
        gone = set()
        for node in others:
            in_state = state.last_heartbeats.get(node)
            times = [_us(in_state)] if in_state else []
            times += [at] if (at := beats.get(node)) is not None else []
            moved = at is not None and seen.get(node, at) != at
            expired = not times or now_us - max(times) >= expiry_us
            if node not in state.participants or (expired and not moved):
                gone.add(node)
        return gone

    @property
    def this_node(self) -> Any:
        return torch_compat.this_node(self)

    # ---- what each node publishes about itself (presence address, static node rank) --------
    def _key(self, kind: str, node: Any) -> str:
        return f"elastic-train/{self.get_run_id()}/{kind}/{node!r}"

    def _publish(self, kind: str, value: str) -> None:
        self.store.set(self._key(kind, self.this_node), value)

    def _published(self, kind: str, nodes: set[Any]) -> dict[Any, str]:
        """node -> the value it published, for the nodes that published one. Two round trips
        when all have (every member reads every other's after each round: one read per key
        made the store's work per round grow with the square of the nodes); a node whose
        value is missing is found by one check per key, a forged one is left out."""
        keys = {node: self._key(kind, node) for node in nodes}
        if keys and not self.store.check(list(keys.values())):
            keys = {node: key for node, key in keys.items() if self.store.check([key])}
        if not keys:
            return {}
        values = self.store.get_each(list(keys.values()))
        return {node: v.decode() for node, v in zip(keys, values, strict=True) if v is not None}

    # ---- store failover (failover.py) --------------------------------------------------------
    def member_name(self) -> str:
        return member_name(self.this_node)

    def store_host_member(self) -> str | None:
        """The member whose agent hosts this store (None: a standalone store)."""
        key = store_host_member_key(self.get_run_id())
        with contextlib.suppress(signed_store.TamperedValue):  # forged: as if none were named
            return self.store.get(key).decode() if self.store.check([key]) else None
        return None

    def leaving_host(self) -> str | None:
        """The store host, if it said it is leaving (preempted); None otherwise or unreadable."""
        key = leaving_key(self.get_run_id())
        with contextlib.suppress(Exception):
            return self.store.get(key).decode() if self.store.check([key]) else None
        return None

    def say_leaving(self) -> None:
        """We host the store and stop now: the others move it before they re-form (best
        effort: without it they still move it once our connection closes)."""
        with contextlib.suppress(Exception):
            self.store.set(leaving_key(self.get_run_id()), self.member_name())

    def rebind(self, store: Any, *, hosted: bool, node: str, endpoint: str = "") -> None:
        """Use ``store`` from now on (the failed-over one): the same node, the same tuning and
        knowledge of the last round (so the survivors' first round closes as soon as they have
        all joined), the same lineage (set here unless a survivor set it first)."""
        run_id = self.get_run_id()
        store = signed_store.signed(store, self.store.key, self.store.log)
        old = self.state_backend
        self.state_backend = SignedStateBackend(store, run_id)
        if old is not None:
            self.state_backend.beats_reuse_s = old.beats_reuse_s
            self.state_backend.beats_fresh_s = old.beats_fresh_s
        torch_compat.rebind_store(self, store, self.state_backend)
        self.store = store
        self.endpoint = endpoint or self.endpoint
        # a new store's rounds start again: round r's join log there is not the old one's
        self._lobby_round, self._log_seen, self._opened_round = -1, (-1, 0), -1
        self._log_spoiled = -1
        if hosted:
            store.set(store_host_key(run_id), node)
            store.set(store_host_member_key(run_id), self.member_name())
        if self.presence_address:  # the next round's members find each other here now
            self.publish_presence(self.presence_address)
        if self.node_label:
            self.publish_node_label(self.node_label)
        # last: c10d's set has no reply, this answer orders the sets above before any read
        self.lineage = bytes(store.compare_set(lineage_key(run_id), "", self.lineage)).decode()

    def publish_node_label(self, label: str) -> None:
        """This node's ``--node`` name, which events name it by on every node (its member
        name, address and pid, tells nobody which machine it is)."""
        self._publish("node", label)
        self.node_label = label

    def node_labels(self, nodes: set[Any]) -> dict[Any, str]:
        """node -> its published ``--node`` name, for the nodes that published one."""
        return self._published("node", nodes)

    def publish_presence(self, address: str) -> None:
        self._publish("presence", address)
        self.presence_address = address

    def presence_addresses(self, nodes: set[Any]) -> dict[Any, str]:
        """node -> its published presence address (see presence.py)."""
        return self._published("presence", nodes)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _us(at: datetime) -> int:
    """``at`` in microseconds since the epoch (how heartbeat keys hold a time)."""
    return (at - _EPOCH) // timedelta(microseconds=1)


CHECKED_WAIT_S = 10.0  # how long a node waits for the others to see a --node-rank conflict

# Under the round's own store prefix, apart from the keys torch's rank 0 already wrote.
STATIC_MASTER_PREFIX = "elastic-train/static-master/"


def with_group_rank(info: RendezvousInfo, rank: int | None, *, local_addr: str) -> RendezvousInfo:
    """``info`` with this node's group rank set to ``rank`` (None: torch's rank, unchanged),
    and the workers' store on the node that is group rank 0 (it publishes ``local_addr`` and a
    free port; every other node blocks until it has)."""
    if rank is None:
        return info
    master = RendezvousStoreInfo.build(
        rank, PrefixStore(STATIC_MASTER_PREFIX, info.store), local_addr
    )
    return RendezvousInfo(info.store, rank, info.world_size, master)


def create_handler(
    cfg: RunConfig,
    *,
    key: JobKey,
    serve: bool,
    claimed: Any = None,
    store: Any = None,
    store_endpoint: str | None = None,
) -> FastRecoveryRendezvousHandler:
    """Host (``serve``) or connect to the c10d store and build the handler (on ``store``
    when given: one already connected, found through the snapshot folder's record). Every
    value in the store is signed with ``key`` (``signed_store``); ``ForeignSecret`` when the
    job's state is signed with another.

    The store comes from ``endpoint.open_store`` rather than torch's ``create_backend``:
    every connect and handshake is bounded, a store not up yet is waited for up to the join
    timeout, and bad input is told apart (``endpoint.EndpointError``, ``StoreUnreachable``).
    """
    from elastic_trainer.supervisor.rendezvous import endpoint

    tuning = cfg.rdzv
    hosted = False
    if store is None:
        store, hosted = endpoint.open_store_hosted(
            cfg.rdzv_host,
            cfg.rdzv_port,
            serve=serve,
            explicit=cfg.is_host is not None,
            deadline_s=tuning.join_timeout,
            read_timeout_s=tuning.read_timeout,
            claimed=claimed,
        )
    handler = handler_on(
        store,
        key,
        cfg.job_id,
        cfg.min_nodes,
        cfg.max_nodes,
        cfg.local_addr,
        RendezvousTimeout(
            join=timedelta(seconds=tuning.join_timeout),
            last_call=timedelta(seconds=tuning.first_last_call_timeout),
            close=timedelta(seconds=tuning.close_timeout),
            heartbeat=timedelta(seconds=tuning.heartbeat_timeout),
        ),
        keep_alive_interval=tuning.keep_alive_interval,
        keep_alive_max_attempt=tuning.keep_alive_max_attempt,
    )
    handler.tune(
        first_last_call_s=tuning.first_last_call_timeout,
        later_last_call_s=tuning.last_call_timeout,
    )
    handler.use_static_rank(cfg.torchrun.node_rank)
    handler.endpoint = store_endpoint or cfg.rdzv_endpoint
    handler.lineage = share_lineage(handler.store, cfg.job_id)
    if hosted:  # every agent's rendezvous.completed names it (``store_host``)
        handler.store.set(store_host_key(cfg.job_id), cfg.node)
        handler.store.set(store_host_member_key(cfg.job_id), handler.member_name())
    return handler


def handler_on(
    store: Any,
    key: JobKey,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str | None,
    timeout: RendezvousTimeout,
    *,
    keep_alive_interval: float,
    keep_alive_max_attempt: int,
) -> FastRecoveryRendezvousHandler:
    """The handler of ``run_id`` on a connected c10d ``store``, every value in it signed with
    ``key`` (``signed_store``) and the state kept as signed JSON (``state_backend``).
    ``ForeignSecret`` when the job's state there is signed with another key."""
    store = signed_store.signed(store, key)
    backend = SignedStateBackend(store, run_id)
    backend.get_state()  # ForeignSecret now, before anything of ours is written
    handler = FastRecoveryRendezvousHandler.from_backend(
        run_id,
        store,
        backend,
        min_nodes,
        max_nodes,
        local_addr,
        timeout,
        keep_alive_interval=keep_alive_interval,  # type: ignore[arg-type]  # float works
        keep_alive_max_attempt=keep_alive_max_attempt,
    )
    backend.beats_reuse_s = keep_alive_interval / 4  # expiry: keep_alive_max_attempt intervals
    backend.beats_fresh_s = keep_alive_interval / 2  # a heartbeat's tick: see there
    handler.lobby_patience_s = 2 * keep_alive_interval * keep_alive_max_attempt
    handler.store, handler.state_backend = store, backend
    return handler


# The workers' copy of the store's lineage token (worker/snapshotting.py reads it).
ENV_RDZV_LINEAGE = protocol.ENV_RDZV_LINEAGE


def share_lineage(store: Any, job_id: str) -> str:
    """The token every node of this rendezvous store agrees on: the first node to ask sets
    it (compare-and-set), every later one (and every later round) reads the same. A store
    that is gone and started again is another lineage, as its rendezvous state is new too."""
    return bytes(store.compare_set(lineage_key(job_id), "", uuid.uuid4().hex)).decode()


lineage_key = protocol.lineage_key


MARK_CHECK_S = 1.0  # how often a running member reads the round's re-join mark
STATE_CHECK_S = 1.0  # ... asks whether the rendezvous state moved (torch caches it this long)
# ... reads it whole even so: a mark lost with its writer, or replayed by someone reaching
# the store, hides a change for at most this long
STATE_REREAD_S = 10.0


def rejoin_key(job_id: str, round_: int, node: Any) -> str:
    """Where ``node`` announces that it leaves round ``round_`` to join the next."""
    return f"elastic-train/{job_id}/rejoin/{round_}/{node.addr}/{node.pid}/{node.local_id}"


def rejoin_mark_key(job_id: str, round_: int) -> str:
    """Set by every member that announced a re-join from ``round_``: one key for the
    running members to read."""
    return f"elastic-train/{job_id}/rejoin/{round_}"


def store_host_key(job_id: str) -> str:
    return f"elastic-train/{job_id}/store-host"


def store_host_member_key(job_id: str) -> str:
    """The hosting agent as a rendezvous member (``member_name``): failover needs to know
    which member's death takes the store along."""
    return f"elastic-train/{job_id}/store-host-member"


def leaving_key(job_id: str) -> str:
    return f"elastic-train/{job_id}/store-host-leaving"


def hosted_by(store: Any, job_id: str, member: str) -> bool:
    """Is ``store`` the one ``member``'s agent hosts (not an old one on the same address)?"""
    key = store_host_member_key(job_id)
    try:
        return store.check([key]) and store.get(key).decode() == member
    except Exception:
        return False


def store_host(store: Any, job_id: str) -> str | None:
    """The node whose agent hosts the rendezvous store; None for a standalone store."""
    key = store_host_key(job_id)
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # the store gone: the field says unknown, the agent finds out itself
        return None
