"""Every use of torch's private internals, in one place, each with why and where checked.

torch.distributed.elastic gives us the engine (c10d rendezvous, the elastic agent) but not
every knob fast recovery needs. What we need beyond its public API is reached only through this
module; ``tests/unit/supervisor/test_torch_compat.py`` asserts that each name still exists with
the shape we use, so a torch release that moves one fails a millisecond test, not a job.

Checked against torch 2.14.1 and 2.15.0 (``TESTED_TORCH``; pyproject pins the same range).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _PeriodicTimer,
    _RendezvousExitOp,
    _RendezvousJoinOp,
    _RendezvousKeepAliveOp,
)

# The oldest and newest torch release this module was checked against (pyproject's range).
TESTED_TORCH = ("2.14", "2.15")


def untested_torch(version: str) -> str | None:
    """One line when torch ``version`` (``torch.__version__``) is outside ``TESTED_TORCH``:
    GPU images often carry an older torch than pip would install, and a user who keeps it
    should know before a failure that may be the release's; None inside the range."""
    low, high = TESTED_TORCH
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if _release(low) <= release <= _release(high):
        return None
    major, minor = _release(high)[:2]
    return (
        f"torch {version} is outside the range elastic-train is tested with ({low} to "
        f"{high}); a failure may be the release's: pip install 'torch>={low},<{major}.{minor + 1}'"
    )


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


# --- torch/distributed/elastic/rendezvous/dynamic_rendezvous.py --------------------------
# _PeriodicTimer: the handler's own heartbeat timer class. We restart heartbeats at half the
#   keep-alive interval (torch ticks at the interval and skips a beat that is not yet due, so
#   beats can be two intervals apart and a live node can expire).
# _BackendRendezvousStateHolder, _DistributedRendezvousOpExecutor: what from_backend builds
#   a handler from; rebuilt on another store when the store host is gone (rebind_store).
# _RendezvousExitOp: the op torch's shutdown() runs minus the close: a preempted node leaves
#   the round without closing the rendezvous for every other node.

# Private attributes of DynamicRendezvousHandler instances that the functions below read.
HANDLER_ATTRIBUTES = (
    "_store",  # the c10d store each round's RendezvousInfo is built on (rebind_store)
    "_shared_tcp_store_server",  # torch's cached workers' store, if it shares one
    "_bootstrap_store_info",  # ... and where it is
    "_settings",  # RendezvousSettings: timeout, keep_alive_interval, keep_alive_max_attempt
    "_state_holder",  # .state (round, participants, last_heartbeats) and .sync()
    "_this_node",  # our _NodeDesc
    "_heartbeat_lock",  # serialises store writes with the heartbeat thread
    "_op_executor",  # .run(op, deadline)
    "_keep_alive_timer",  # replaced by ours in start_fast_heartbeats
)
HANDLER_METHODS = (
    "_keep_alive",  # overridden by ours: torch logs a warning for every failed heartbeat
    "_keep_alive_weak",
    "_get_deadline",
    "_start_heartbeats",
    "_stop_heartbeats",
)


# --- DynamicRendezvousHandler.next_rendezvous: the join's jitter ---------------------------
# Before it joins, next_rendezvous sleeps a random 0-0.3 s (``_delay(seconds=(0, 0.3))``,
# imported into dynamic_rendezvous from its utils) while the state's round is 0: it spreads
# the first joins of many nodes. The round is still 0 at the first *re-form* (the first
# round is round 0), so every job's first recovery paid up to 0.3 s for a spread that only
# the first join needs. The op executor's own waits (``_delay(seconds=1)`` for SYNC; a CAS
# backoff in newer torch) are not next_rendezvous' and stay.
@contextlib.contextmanager
def no_join_jitter() -> Iterator[None]:
    """Inside, on this thread: ``next_rendezvous`` joins without its random sleep. Where
    torch has no ``_delay`` to call, nothing changes."""
    _install_delay()
    _told.no_jitter = True
    try:
        yield
    finally:
        _told.no_jitter = False


def set_last_call_timeout(handler: DynamicRendezvousHandler, last_call: timedelta) -> None:
    """RendezvousTimeout has no setter; the handler reads ``_last_call`` when it opens the last
    call of a round it joins (a patient first round, short later ones)."""
    handler._settings.timeout._last_call = last_call


def keep_alive(handler: DynamicRendezvousHandler) -> tuple[float, int]:
    """(keep_alive_interval seconds, keep_alive_max_attempt) of the handler's settings."""
    interval = handler._settings.keep_alive_interval
    seconds = interval.total_seconds() if isinstance(interval, timedelta) else float(interval)
    return seconds, int(handler._settings.keep_alive_max_attempt)


def close_timeout_s(handler: DynamicRendezvousHandler) -> float:
    return float(handler._settings.timeout.close.total_seconds())


def start_fast_heartbeats(handler: DynamicRendezvousHandler) -> None:
    """Heartbeats every half keep-alive interval, on torch's own timer and callback."""
    interval = handler._settings.keep_alive_interval
    timer = _PeriodicTimer(interval / 2, handler._keep_alive_weak, weakref.ref(handler))
    timer.set_name(f"RendezvousKeepAliveTimer_{handler._this_node.local_id}")
    timer.start()
    handler._keep_alive_timer = timer


def send_heartbeat(handler: DynamicRendezvousHandler) -> None:
    """One keep-alive heartbeat, as torch's ``_keep_alive`` sends it, but raising instead of
    logging a warning: with the store gone torch's logged one line per tick (every half
    interval), so the caller decides what a failure is worth saying."""
    with handler._heartbeat_lock:
        deadline = handler._get_deadline(handler._settings.timeout.heartbeat)
        handler._op_executor.run(_RendezvousKeepAliveOp(), deadline)


def rendezvous_state(handler: DynamicRendezvousHandler, *, sync: bool = False) -> Any:
    """The handler's view of the rendezvous state (round, participants, last_heartbeats);
    ``sync`` re-reads it from the store first."""
    if sync:
        with handler._heartbeat_lock:
            handler._state_holder.sync()
    return handler._state_holder.state


def this_node(handler: DynamicRendezvousHandler) -> Any:
    return handler._this_node


def exit_round(handler: DynamicRendezvousHandler, deadline: float) -> None:
    """Stop heartbeats and leave the current round without closing the rendezvous."""
    handler._stop_heartbeats()
    with handler._heartbeat_lock:
        handler._op_executor.run(_RendezvousExitOp(), deadline)


def rebind_store(handler: DynamicRendezvousHandler, store: Any, backend: Any) -> None:
    """Point ``handler`` at another c10d store (store failover): a new state holder and op
    executor on ``backend``, the same node descriptor and settings. torch builds those once
    in ``from_backend`` and has no way to change the store; a new handler would draw a new
    node descriptor (its ``local_id`` counts handlers), and the survivors would no longer
    recognise each other as the members of their last round."""
    handler._stop_heartbeats()  # they would go to the old store
    holder = _BackendRendezvousStateHolder(backend, handler._settings)
    handler._state_holder = holder
    handler._op_executor = _DistributedRendezvousOpExecutor(
        handler._this_node, holder, handler._settings
    )
    handler._store = store
    handler._shared_tcp_store_server = None
    handler._bootstrap_store_info = None


# --- rendezvous ops: the join hook and dead-node expiry ------------------------------------
# torch's rendezvous is a loop of ops: a callable (context, deadline) -> _Action that reads the
# shared state, and one executor (handler._op_executor.run) that carries the action out and
# writes the state back with compare-and-set. We add two things through that same seam:
# - a hook around the join op (_RendezvousJoinOp): close a re-forming round as soon as every
#   node still alive has joined (MARK_RENDEZVOUS_COMPLETE, the action torch's own op returns
#   at the last-call deadline), and wait for a state change by polling the store key instead
#   of torch's fixed 1 s SYNC sleep (then a SYNC that reads the store at once, writing
#   nothing: _resync_now);
# - an op that expires the heartbeats of nodes known dead, so torch's own state sanitiser
#   removes them at once (as it does after interval x attempts) with its own bookkeeping.
# _RendezvousContext: .node, .state (participants, wait_list, complete, round,
#   last_heartbeats), .settings (min_nodes, max_nodes).
JOIN_ACTIONS = (
    "SYNC",
    "KEEP_ALIVE",
    "MARK_RENDEZVOUS_COMPLETE",
    "FINISH",
    "ERROR_TIMEOUT",
    "ADD_TO_PARTICIPANTS",
)
STATE_FIELDS = (
    "round",
    "complete",
    "deadline",
    "closed",
    "participants",
    "wait_list",
    "redundancy_list",
    "last_heartbeats",
)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True, kw_only=True)
class RoundView:
    """What the join hook sees of the round this node is joining."""

    me: Any
    round: int
    complete: bool
    joined: frozenset[Any]
    waiting: frozenset[Any]
    min_nodes: int
    max_nodes: int
    last_call_ends: datetime | None = None  # the round's last-call deadline (UTC), if open

    def key(self) -> tuple[Any, ...]:
        """What a wake-up is about: anything but heartbeats."""
        return (self.round, self.complete, self.joined, self.waiting)


CLOSE, POLLED = "close", "polled"  # the join hook's answers (None: torch's own action)
LEFT, OPENED = "left", "opened"  # the exit hook's (and POLLED)
LeaveHook = Callable[[Any], str | None]  # (torch's op context) -> answer
JoinHook = Callable[[RoundView, bool], str | None]  # (view, may wait) -> answer
HoldHook = Callable[[RoundView], bool]  # the last call ran out: keep the round open?
# not in an open round that has members: POLLED (asked its opener to be let in, and waited)
# or None (torch's own join: add itself to the state)
LobbyHook = Callable[[RoundView], str | None]
# in an open round, about to wait (closing: or to close it): the nodes to add to it now
FoldHook = Callable[[RoundView, bool], list[Any]]


def install_join_hook(
    handler: DynamicRendezvousHandler,
    hook: JoinHook,
    dead: Callable[[], set[Any]] = set,
    hold: HoldHook = lambda view: False,
    rejoining: Callable[[], bool] = lambda: False,
    leaving: LeaveHook = lambda ctx: None,
    lobby: LobbyHook = lambda view: None,
    fold: FoldHook = lambda view, closing: [],
) -> None:
    """Route every join op of ``handler`` through ``hook`` (idempotent). The hook is asked
    only where torch's own op would wait (SYNC / KEEP_ALIVE; ``may_wait`` only for SYNC, a due
    heartbeat is not delayed): it answers CLOSE (mark the round complete now), POLLED (it
    waited for a state change itself: resync at once) or None (torch's own action).
    ``dead``: nodes found gone while we wait; their heartbeats are expired in the shared
    state then and there (as ``expire_nodes`` does before a join). ``hold``: asked where
    torch would close the round because its last call ran out; True keeps it open (a sync,
    torch's one-second poll) for now. ``rejoining``: whether a removal from the round is
    this node's own re-join (``_admitting_waiters``), not its leaving. ``leaving``: asked
    before torch's exit op decides (the op every join starts with, and ``exit_round``): it
    answers LEFT (this node is out of the round already: the op is done), OPENED (it
    changed the state: write it), POLLED (it waited itself: resync at once) or None
    (torch's own op). ``lobby``: asked where torch's op would add this node to an open
    round with members; POLLED where it asked to be let in instead (``join_log``). ``fold``:
    asked where a participant of an open round would wait or close it: nodes it adds to the
    round in the same write (the opener letting the logged nodes in)."""
    executor = handler._op_executor
    if getattr(executor, "elastic_train_hooked", False):
        return
    run = executor.run
    _install_delay()
    _install_cheap_method_name()

    def resync() -> None:
        _resync_now(executor._state_holder)

    def hooked_run(op: Any, deadline: float, update_deadline: Any = None) -> None:
        if isinstance(op, _RendezvousJoinOp):
            op = _hooked_join(op, hook, dead, hold, resync, lobby, fold)
        elif isinstance(op, _RendezvousExitOp):
            op = _hooked_exit(op, leaving, resync)
        run(op, deadline, update_deadline)

    executor.run = hooked_run
    executor._remove_from_participants = _admitting_waiters(executor, rejoining)
    executor.elastic_train_hooked = True


def _admitting_waiters(executor: Any, rejoining: Callable[[], bool]) -> Callable[[], None]:
    """torch's ``_remove_from_participants``, and in the same write: where this node leaves a
    round that others still run in order to re-join (``rejoining``), it goes on the wait list
    for the next (torch's join op adds it there with a write of its own next); where the
    removal ends the round (the last member left: the next one opens), every node on the
    wait list joins the new round, as each would join it itself a moment later.

    A member of a complete round re-joins without this op (the handler's announcement: one
    write for the whole re-form); this serves the removals that remain, a node leaving for
    good and re-joins where no announcement applies. Each of those writes is a
    compare-and-set of the one state, and every node the write spares is one fewer writer
    colliding with the others (each retry a read and a write of the whole state)."""
    remove = executor._remove_from_participants

    def remove_and_admit() -> None:
        state = executor._state
        before = state.round
        remove()
        if state.round == before:
            room = len(state.participants) < executor._settings.max_nodes
            if rejoining() and state.complete and room:
                executor._add_to_wait_list()  # what the join op's next write would do
            return
        settings = executor._settings
        waiting = len(state.wait_list)
        # with a place to spare, for the node that opened the round (it joins next, unless
        # it is leaving): where they would not all fit, torch's race decides who is in
        if not waiting or waiting >= settings.max_nodes:
            return
        for node in state.wait_list:  # as _add_to_participants does for one
            state.participants[node] = 0
        state.wait_list.clear()
        if len(state.participants) >= settings.min_nodes:
            state.deadline = datetime.now(timezone.utc) + settings.timeout.last_call

    return remove_and_admit


def _hooked_join(
    op: Any,
    hook: JoinHook,
    dead: Callable[[], set[Any]],
    hold: HoldHook,
    resync: Callable[[], None],
    lobby: LobbyHook,
    fold: FoldHook,
) -> Callable[[Any, float], Any]:
    def join(ctx: Any, deadline: float) -> Any:
        if _expire_in(ctx, dead()):
            return _Action.KEEP_ALIVE  # a write action: the executor writes the state back
        action = op(ctx, deadline)
        state = ctx.state
        if action == _Action.ADD_TO_PARTICIPANTS and state.participants:
            if lobby(round_view(ctx)) == POLLED:
                resync()
                return _Action.SYNC
            return action
        closing = action == _Action.MARK_RENDEZVOUS_COMPLETE
        waits = action in (_Action.SYNC, _Action.KEEP_ALIVE)
        if (closing or waits) and not state.complete and ctx.node in state.participants:
            newcomers = fold(round_view(ctx), closing)
            if newcomers:
                add_participants(ctx, newcomers)
                if len(state.participants) >= ctx.settings.max_nodes:
                    return _Action.MARK_RENDEZVOUS_COMPLETE  # as torch's add does when full
                if closing and not hold(round_view(ctx)):
                    return _Action.MARK_RENDEZVOUS_COMPLETE
                return _Action.KEEP_ALIVE  # a write action: the executor writes the state
        # the op closes a round only when its last call has run out (a full round is closed
        # by the executor as the last node joins)
        if action == _Action.MARK_RENDEZVOUS_COMPLETE and hold(round_view(ctx)):
            return _Action.SYNC
        if action not in (_Action.SYNC, _Action.KEEP_ALIVE):
            return action
        answer = hook(round_view(ctx), action == _Action.SYNC)
        if answer == CLOSE:
            return _Action.MARK_RENDEZVOUS_COMPLETE
        if answer == POLLED:
            resync()
            return _Action.SYNC
        return action

    return join


# The hook has waited for a change itself: the executor's next sync must read the store at
# once. torch's SYNC sleeps 1 s first (``_delay(seconds=1)``) and its state holder then serves
# a state read within the last second from its cache (``_last_sync_time``). A KEEP_ALIVE
# instead (what was used) resyncs at once but writes the whole state with our heartbeat: every
# waiter did so after every join, each write colliding with the others' (compare-and-set on
# one key), so a round of N joins cost N² writes of O(N) bytes, and a waiter whose writes kept
# colliding kept no heartbeat and was dropped from the round (seen at 32 nodes).
def _resync_now(holder: Any) -> None:
    holder._last_sync_time = -1.0  # older than any cache duration
    _told.skip_sync_delay = True


def trust_cached_state(handler: DynamicRendezvousHandler) -> None:
    """The handler's state is the stored one (its write mark is unchanged): the holder's next
    syncs, within its cache duration, serve it without a read (nor torch's expiry)."""
    handler._state_holder._last_sync_time = time.monotonic()


# What this thread's joins told dynamic_rendezvous' ``_delay`` to skip: .no_jitter (the
# jitter of next_rendezvous, no_join_jitter), .skip_sync_delay (the next SYNC sleep, once).
# Thread-local flags read by one wrapper installed once, not a function swapped in and out
# around each join: two handlers joining at once on two threads (tests; an agent's failover
# probe) would restore each other's swaps.
_told = threading.local()


def _install_delay() -> None:
    """Replace dynamic_rendezvous' ``_delay`` (once) by one that skips what this thread was
    told to (``_told``); every other delay is torch's."""
    import sys

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = getattr(dynamic_rendezvous, "_delay", None)
    if original is None or getattr(original, "elastic_train_told", False):
        return

    def delay(seconds: Any) -> None:
        if isinstance(seconds, tuple):
            told = getattr(_told, "no_jitter", False)
            if told and sys._getframe(1).f_code.co_name == "next_rendezvous":
                return  # not torch 2.15's compare-and-set backoff, also a range
        elif getattr(_told, "skip_sync_delay", False):
            _told.skip_sync_delay = False
            return
        original(seconds=seconds)

    delay.elastic_train_told = True  # type: ignore[attr-defined]
    dynamic_rendezvous._delay = delay  # type: ignore[attr-defined]


def _install_cheap_method_name() -> None:
    """Replace dynamic_rendezvous' ``get_method_name`` (once) by one that reads the caller's
    frame, not ``inspect.stack()``: torch calls it for the name in each rendezvous event it
    records (``_record``, several per join and per state write), and ``inspect.stack()``
    builds every frame's record with source lines read from disk, twice. At 128 agents on
    this 2-core machine one call took 0.34 s (a stack of ~35 frames, load 134) and an agent
    was seen in it, inside its join's state write, 4 minutes into a first round that never
    closed (docs/benchmarks.md, control plane). The name is the same: that of the function
    ``depth`` frames up."""
    import sys

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = getattr(dynamic_rendezvous, "get_method_name", None)
    if original is None or getattr(original, "elastic_train_cheap", False):
        return

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # 0: this frame, as stack()[0]
        except ValueError:  # a stack shallower than depth
            return "no_method_name"

    get_method_name.elastic_train_cheap = True  # type: ignore[attr-defined]
    dynamic_rendezvous.get_method_name = get_method_name  # type: ignore[attr-defined]


def _hooked_exit(
    op: Any, leaving: LeaveHook, resync: Callable[[], None]
) -> Callable[[Any, float], Any]:
    def exit_round(ctx: Any, deadline: float) -> Any:
        if time.monotonic() <= deadline:  # past it: torch's op rolls back or times out
            answer = leaving(ctx)
            if answer == LEFT:
                return _Action.FINISH
            if answer == OPENED:
                return _Action.KEEP_ALIVE  # a write action: the executor writes ctx.state
            if answer == POLLED:
                resync()
                return _Action.SYNC
        return op(ctx, deadline)

    return exit_round


def open_next_round(ctx: Any, members: set[Any], *, close: Callable[[set[Any]], bool]) -> None:
    """Round r+1 of ``ctx.state`` (a complete round r), with ``members`` (of round r, each
    said it joins the next) and the nodes on the wait list, up to max_nodes: complete at once,
    ranks assigned as torch's ``_mark_rendezvous_complete`` does, where ``close`` says so of
    the nodes in it; else open, its last call running from now as torch's join starts it.
    ``members`` each said so a moment ago, in their own signed keys: a heartbeat's worth of
    news, stamped now (the members reading the round at once then read no one's heartbeat
    key, ``SignedStateBackend.beats_fresh_s``)."""
    state, settings = ctx.state, ctx.settings
    joining = [*sorted(members), *sorted(state.wait_list - set(members))][: settings.max_nodes]
    now = datetime.now(timezone.utc)
    for node in set(members) & set(joining):
        state.last_heartbeats[node] = now
    state.round += 1
    state.participants = dict.fromkeys(joining, 0)
    state.wait_list = state.wait_list - set(joining)
    state.complete = close(set(joining))
    state.deadline = None
    if state.complete:
        for rank, node in enumerate(sorted(state.participants)):
            state.participants[node] = rank
    elif len(joining) >= settings.min_nodes:
        state.deadline = datetime.now(timezone.utc) + settings.timeout.last_call


def add_participants(ctx: Any, nodes: list[Any]) -> None:
    """``nodes`` into the open round of ``ctx.state``, as torch's ``_add_to_participants``
    adds one (off the wait list, a fresh heartbeat, the last call started once the round
    has its minimum), up to max_nodes."""
    state, settings = ctx.state, ctx.settings
    now = datetime.now(timezone.utc)
    for node in nodes:
        if len(state.participants) >= settings.max_nodes:
            break
        state.wait_list.discard(node)
        state.participants[node] = 0
        state.last_heartbeats[node] = now
    if state.deadline is None and len(state.participants) >= settings.min_nodes:
        state.deadline = now + settings.timeout.last_call


def node_of(entry: list[Any]) -> Any:
    """torch's node descriptor for a checked ``[addr, pid, local_id]`` entry."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    return _NodeDesc(entry[0], entry[1], entry[2])


def _expire_in(ctx: Any, nodes: set[Any]) -> bool:
    """Set the heartbeats of ``nodes`` in ``ctx``'s state to the epoch (torch's sanitiser
    removes them at the next sync); whether any was due."""
    beats = ctx.state.last_heartbeats
    due = [n for n in nodes if n in beats and beats[n] != _EPOCH]
    for node in due:
        beats[node] = _EPOCH
    return bool(due)


def round_view(ctx: Any) -> RoundView:
    settings = ctx.settings
    return _view(ctx.state, ctx.node, int(settings.min_nodes), int(settings.max_nodes))


def state_view(state: Any, view: RoundView) -> RoundView:
    """``view`` updated from a decoded store state (``decode_rendezvous_state``)."""
    return _view(state, view.me, view.min_nodes, view.max_nodes)


def _view(state: Any, me: Any, min_nodes: int, max_nodes: int) -> RoundView:
    return RoundView(
        me=me,
        round=int(state.round),
        complete=bool(state.complete),
        joined=frozenset(state.participants),
        waiting=frozenset(state.wait_list),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        last_call_ends=state.deadline,
    )


def expire_nodes(handler: DynamicRendezvousHandler, nodes: set[Any], deadline: float) -> None:
    """Set the heartbeats of ``nodes`` to the epoch in the shared state; torch's sanitiser
    then removes them (participants, wait list) at the next sync, everywhere."""

    def expire(ctx: Any, op_deadline: float) -> Any:
        beats = ctx.state.last_heartbeats
        if not any(n in beats and beats[n] != _EPOCH for n in nodes):
            return _Action.FINISH
        if time.monotonic() > op_deadline:
            return _Action.ERROR_TIMEOUT
        _expire_in(ctx, nodes)
        return _Action.KEEP_ALIVE  # any write action: the executor marks the state dirty

    with handler._heartbeat_lock:
        handler._op_executor.run(expire, deadline)


# --- torch/distributed/elastic/agent/server ---------------------------------------------
# SimpleElasticAgent is a template method: these protected hooks are meant to be overridden
# (its docstring says so), but they are underscore names all the same, so they are checked.
AGENT_HOOKS = (
    "_rendezvous",
    "_start_workers",
    "_stop_workers",
    "_monitor_workers",
    "_initialize_workers",
    "_exit_barrier",
    "_shutdown",
)
# _remaining_restarts: torch's own restart counter, read when it builds the workers' env
#   (TORCHELASTIC_RESTART_COUNT = max_restarts - remaining): we keep it equal to ours.
# _pcontext: LocalElasticAgent's process context, whose subprocess handlers hold the
#   workers' Popen objects (we track and kill their whole process trees ourselves).
# local_elastic_agent.start_processes: the module-level name _start_workers calls
#   (processes_started_by swaps it for the warm pool's while we start workers).
# SubprocessContext._start: PContext's hook that creates the processes; the warm pool's
#   context overrides it (see _subprocess_context_check).
AGENT_ATTRIBUTES = ("_remaining_restarts", "_pcontext", "_worker_group")


def agent_shutdown_timeout(seconds: int) -> dict[str, int]:
    """``LocalElasticAgent``'s keyword for its SIGTERM -> SIGKILL grace when it shuts its
    workers down, where its ``__init__`` takes one (2.14 and 2.15 do; older releases, such as
    the 2.11 that GPU images carry, wait a fixed 30 s and would refuse the keyword)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    accepted = inspect.signature(LocalElasticAgent.__init__).parameters
    return {"shutdown_timeout": seconds} if "shutdown_timeout" in accepted else {}


def shut_down(agent: Any, timeout_s: int) -> None:
    """``LocalElasticAgent._shutdown``: stop the workers, close the rendezvous handler's
    side, with ``timeout_s`` from SIGTERM to SIGKILL where torch takes one (2.14, 2.15)."""
    if "timeout" in inspect.signature(agent._shutdown).parameters:
        agent._shutdown(timeout=timeout_s)
    else:
        agent._shutdown()


def set_remaining_restarts(agent: Any, remaining: int) -> None:
    agent._remaining_restarts = remaining


@contextlib.contextmanager
def processes_started_by(factory: Callable[..., Any]) -> Iterator[None]:
    """Within this block, ``LocalElasticAgent._start_workers`` starts its workers through
    ``factory(original_start_processes, **its_keyword_arguments)``.

    torch builds each worker's environment, arguments and log destinations and passes them
    to ``start_processes``, which it calls by its module-level name: this is the one place
    where the warm pool (``supervisor/warm/client.py``) can take over creating the processes
    without rebuilding torch's worker environment. Restored on exit; the agent starts workers
    from its main thread only, so nothing else sees the swap.
    """
    from torch.distributed.elastic.agent.server import local_elastic_agent

    original = local_elastic_agent.start_processes
    local_elastic_agent.start_processes = functools.partial(factory, original)
    try:
        yield
    finally:
        local_elastic_agent.start_processes = original


def take_processes(agent: Any) -> Any:
    """The agent's process context of its running workers, which it then forgets: its next
    ``_start_workers`` starts another while these still run, and ``_shutdown`` stops only
    the new one. The caller closes the one taken (``PContext.close``)."""
    pcontext, agent._pcontext = agent._pcontext, None
    return pcontext


def give_processes(agent: Any, pcontext: Any) -> None:
    """Make ``pcontext`` (one ``take_processes`` took) the agent's running workers again."""
    agent._pcontext = pcontext


def worker_popens(agent: Any) -> dict[int, subprocess.Popen]:
    """local rank -> Popen of the agent's current workers (empty before the first start)."""
    pcontext = agent._pcontext
    if pcontext is None:
        return {}
    return {lr: handler.proc for lr, handler in pcontext.subprocess_handlers.items()}


# --- the rendezvous state's classes (dynamic_rendezvous._RendezvousState, _NodeDesc) -------
# torch's state holder pickles its state for the backend; the backend (ours:
# supervisor/rendezvous/state_backend.py) stores it as signed JSON instead, so these two
# functions turn a state into plain data and back. Nothing read from a store is unpickled:
# only a state built here from checked plain data is pickled and handed to the holder.
RENDEZVOUS_KEY_PREFIX = "torch.rendezvous."
NODE_FIELDS = ("addr", "pid", "local_id")


def rendezvous_key(run_id: str) -> str:
    """The store key of a job's rendezvous state (torch's c10d backend used the same one)."""
    return RENDEZVOUS_KEY_PREFIX + run_id


def state_to_plain(state: Any) -> dict[str, Any]:
    """A ``_RendezvousState`` as JSON-ready data: nodes as ``[addr, pid, local_id]``, times
    as whole microseconds since the epoch (exact both ways)."""

    def node(n: Any) -> list[Any]:
        return [n.addr, n.pid, n.local_id]

    def micros(t: datetime | None) -> int | None:
        return None if t is None else (t - _EPOCH) // timedelta(microseconds=1)

    return {
        "round": state.round,
        "complete": state.complete,
        "deadline": micros(state.deadline),
        "closed": state.closed,
        "participants": sorted([*node(n), rank] for n, rank in state.participants.items()),
        "wait_list": sorted(node(n) for n in state.wait_list),
        "redundancy_list": sorted(node(n) for n in state.redundancy_list),
        "last_heartbeats": sorted([*node(n), micros(t)] for n, t in state.last_heartbeats.items()),
    }


def state_from_plain(plain: dict[str, Any]) -> Any:
    """The ``_RendezvousState`` that ``state_to_plain`` made ``plain`` from (checked data:
    ``state_codec.decode``)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )

    nodes: dict[tuple[Any, ...], Any] = {}  # one object per node, as torch's own state has

    def node(entry: list[Any]) -> Any:
        key = (entry[0], entry[1], entry[2])
        found = nodes.get(key)
        if found is None:
            found = nodes[key] = _NodeDesc(*key)
        return found

    def when(us: int | None) -> datetime | None:
        return None if us is None else _EPOCH + timedelta(microseconds=us)

    state = _RendezvousState()
    state.round = plain["round"]
    state.complete = plain["complete"]
    state.deadline = when(plain["deadline"])
    state.closed = plain["closed"]
    state.participants = {node(e): e[3] for e in plain["participants"]}
    state.wait_list = {node(e) for e in plain["wait_list"]}
    state.redundancy_list = {node(e) for e in plain["redundancy_list"]}
    state.last_heartbeats = {node(e): when(e[3]) for e in plain["last_heartbeats"]}
    return state


# --- torch/distributed/elastic/multiprocessing/api.py -------------------------------------
# Its logger says "failed (exitcode: N) local_rank: ..." at error level for every worker that
# ends badly; the agent demotes it where that end is a peer's leaving (``PeerLeaving``).
WORKER_FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"
WORKER_FAILURE_MESSAGE = "failed (exitcode"


# --- torch/distributed/elastic/rendezvous/utils.py --------------------------------------
def matches_machine_hostname(host: str) -> bool:
    """torch's own test of whether HOST is this machine (it decides who hosts the store)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


# --- torch/distributed/elastic/multiprocessing/api.py -------------------------------------
# DefaultLogsSpecs.reify marks a stream it leaves on the agent's own console with "" (a local
#   SYS_STREAM there, no public name): supervisor/processes/console.py relays exactly those streams.
LOGS_DEST_CONSOLE = ""


def _console_marker() -> bool:
    import tempfile

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    with tempfile.TemporaryDirectory() as folder:
        dest = DefaultLogsSpecs(log_dir=folder, redirects={1: Std.ALL}).reify({0: {}, 1: {}})
    return dest.stdouts[0] == dest.stderrs[0] == LOGS_DEST_CONSOLE != dest.stdouts[1]


# --- torch/distributed/distributed_c10d.py: aborting the communicators --------------------
# NCCL kernels do not notice a dead peer: a survivor already inside a collective waits until
# the group's timeout (the watchdog's abort). Aborting the communicators ends that wait now.
# _abort_process_group (private; its docstring: "experimental, only works with NCCL") aborts
# every group of the world inside one coalescing region (ncclGroupStart/End, so the aborts
# of several communicators cannot deadlock each other, pytorch#119797) and clears torch's
# registry of groups, so the same process may create a new group afterwards. gloo needs no
# abort: a gloo collective fails at once on a peer's closed socket, and destroy_process_group
# is its normal end. Checked in torch 2.14.1 (signature ``(group=None)``; calling it on a gloo
# world of one also clears the registry). torch 2.15 was not installed where this was written.
ABORT_BACKENDS = frozenset({"nccl"})


def abort_call(backend: str) -> str | None:
    """Which abort a group of ``backend`` needs when a peer is lost (None: none)."""
    return "_abort_process_group" if backend in ABORT_BACKENDS else None


def abort_communicators(
    backend: str | None = None, *, abort: Callable[[], None] | None = None
) -> bool:
    """Abort every communicator of this process's world if its backend needs it (NCCL);
    True if aborted. ``backend`` defaults to the default group's; ``abort`` replaces torch's
    call (the seam CPU tests use). No group, or gloo: nothing is done, False."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    if abort_call(backend or str(dist.get_backend())) is None:
        return False
    (abort or abort_world)()
    return True


def abort_world() -> None:
    """torch's own abort of every group of the world (the default group included)."""
    from torch.distributed import distributed_c10d

    distributed_c10d._abort_process_group(None)


def _abort_process_group_shape() -> bool:
    from torch.distributed import ProcessGroup, distributed_c10d

    fn = getattr(distributed_c10d, "_abort_process_group", None)
    if not callable(fn) or not callable(getattr(ProcessGroup, "abort", None)):
        return False
    return list(inspect.signature(fn).parameters) == ["group"]


def checks() -> dict[str, Callable[[], bool]]:
    """Name -> a check that the private piece is still there with the shape we use."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous import utils

    handler_init = DynamicRendezvousHandler.__init__.__code__.co_names
    return {
        "_PeriodicTimer(interval, fn, *args).set_name/start": lambda: all(
            hasattr(_PeriodicTimer, m) for m in ("set_name", "start", "cancel")
        ),
        "_RendezvousExitOp()": lambda: callable(_RendezvousExitOp()),
        "_BackendRendezvousStateHolder(backend, settings)": lambda: (
            list(inspect.signature(_BackendRendezvousStateHolder).parameters)[:2]
            == ["backend", "settings"]
        ),
        "_DistributedRendezvousOpExecutor(node, state_holder, settings)": lambda: (
            list(inspect.signature(_DistributedRendezvousOpExecutor).parameters)
            == ["node", "state_holder", "settings"]
        ),
        "_RendezvousJoinOp()": lambda: callable(_RendezvousJoinOp()),
        "_DistributedRendezvousOpExecutor._remove_from_participants(), _add_to_wait_list(), "
        "._state, ._settings": _executor_removal_shape,
        "_BackendRendezvousStateHolder._last_sync_time (its cache)": lambda: (
            "_last_sync_time" in _BackendRendezvousStateHolder.sync.__code__.co_names
        ),
        "dynamic_rendezvous._delay(seconds)": _delay_shape,
        "dynamic_rendezvous.get_method_name(depth=2)": _method_name_shape,
        **{f"_Action.{a}": _has_action(a) for a in JOIN_ACTIONS},
        "DynamicRendezvousHandler._op_executor.run(op, deadline, update_deadline)": _run_shape,
        "_RendezvousState fields": _state_fields,
        "RendezvousTimeout._last_call": lambda: "_last_call" in _timeout_slots(),
        **{
            f"DynamicRendezvousHandler.{a}": _attr_check(a, handler_init)
            for a in HANDLER_ATTRIBUTES
        },
        **{
            f"DynamicRendezvousHandler.{m}()": _has(DynamicRendezvousHandler, m)
            for m in HANDLER_METHODS
        },
        **{f"LocalElasticAgent.{h}()": _has(LocalElasticAgent, h) for h in AGENT_HOOKS},
        **{f"LocalElasticAgent.{a}": _agent_attr(a) for a in AGENT_ATTRIBUTES},
        "_NodeDesc(addr, pid, local_id)": _node_fields,
        "local_elastic_agent.start_processes called by _start_workers": _start_processes_check,
        "SubprocessContext._start() fills subprocess_handlers[lr].proc": _subprocess_context_check,
        "rendezvous.utils._matches_machine_hostname": lambda: callable(
            getattr(utils, "_matches_machine_hostname", None)
        ),
        "DefaultLogsSpecs.reify: a console stream is ''": _console_marker,
        "distributed_c10d._abort_process_group(group=None), ProcessGroup.abort()": (
            _abort_process_group_shape
        ),
    }


def _executor_removal_shape() -> bool:
    code = _DistributedRendezvousOpExecutor._remove_from_participants.__code__
    add = getattr(_DistributedRendezvousOpExecutor, "_add_to_wait_list", None)
    return (
        "_state" in code.co_names
        and "_settings" in _DistributedRendezvousOpExecutor.__init__.__code__.co_names
        and callable(add)
        and not list(inspect.signature(add).parameters)[1:]
    )


def _delay_shape() -> bool:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    return callable(delay) and "seconds" in inspect.signature(delay).parameters


def _method_name_shape() -> bool:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    named = getattr(dynamic_rendezvous, "get_method_name", None)
    if not callable(named):
        return False
    depth = inspect.signature(named).parameters.get("depth")
    return depth is not None and depth.default == 2


def _has_action(name: str) -> Callable[[], bool]:
    return lambda: name in _Action.__members__


def _run_shape() -> bool:
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    params = list(inspect.signature(dr._DistributedRendezvousOpExecutor.run).parameters)
    return params[:4] == ["self", "state_handler", "deadline", "update_deadline"]


def _state_fields() -> bool:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    state = dr._RendezvousState()
    ctx_init = dr._RendezvousContext.__init__.__code__.co_varnames
    return all(hasattr(state, f) for f in STATE_FIELDS) and {"node", "state", "settings"} <= set(
        ctx_init
    )


def _node_fields() -> bool:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    fields = getattr(_NodeDesc, "__dataclass_fields__", {})
    return tuple(fields) == NODE_FIELDS


def _start_processes_check() -> bool:
    from torch.distributed.elastic.agent.server import local_elastic_agent

    start = inspect.unwrap(local_elastic_agent.LocalElasticAgent._start_workers)
    return callable(getattr(local_elastic_agent, "start_processes", None)) and (
        "start_processes" in start.__code__.co_names
    )


def _subprocess_context_check() -> bool:
    """warm_workers.WarmContext overrides PContext's ``_start`` hook and fills the handlers
    that SubprocessContext's polling, pids and close read (each handler's ``proc``)."""
    from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext

    readers = (
        SubprocessContext._capture_process_failures,
        SubprocessContext.pids,
        SubprocessContext._close,
    )
    return "_start" in getattr(PContext, "__abstractmethods__", ()) and all(
        "subprocess_handlers" in fn.__code__.co_names for fn in readers
    )


def _timeout_slots() -> set[str]:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    return set(getattr(RendezvousTimeout, "__annotations__", {})) | set(vars(RendezvousTimeout))


def _attr_check(name: str, init_names: tuple[str, ...]) -> Callable[[], bool]:
    # _keep_alive_timer is created in _start_heartbeats, the others in __init__
    source = DynamicRendezvousHandler._start_heartbeats.__code__.co_names
    return lambda: name in init_names or name in source


def _has(cls: type, name: str) -> Callable[[], bool]:
    return lambda: callable(getattr(cls, name, None))


def _agent_attr(name: str) -> Callable[[], bool]:
    def check() -> bool:
        from torch.distributed.elastic.agent.server import api, local_elastic_agent

        names = set()
        for cls in (api.SimpleElasticAgent, local_elastic_agent.LocalElasticAgent):
            for member in vars(cls).values():
                code = getattr(member, "__code__", None)
                if code is not None:
                    names.update(code.co_names)
        return name in names

    return check
