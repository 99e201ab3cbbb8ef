"""Pure supervisor decisions: (state, observation) -> decision. No I/O, no clocks.

``supervisor/agent`` observes (worker exit codes, hang verdicts, rendezvous results, waiting nodes),
asks these functions what it means, and carries the answer out. The model is torch's own
rendezvous ops, which read state and return an action enum for one executor to run.

What stays between observations is one ``SupervisorState`` value: the restart policy's
counters, the world size of the current group, why the next re-formation happens, and
whether a counted failure may still turn out to be a node loss (then it is refunded).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field, replace
from typing import Any

from elastic_trainer.contract import protocol
from elastic_trainer.contract.events import FailureCause, MembershipReason
from elastic_trainer.supervisor.core.policy import (
    Action,
    Decision,
    PolicyState,
    RestartPolicy,
    WorkerExit,
    classify_exit,
    is_membership_change,
)


class Verdict(str, enum.Enum):
    RESTART = "restart"  # re-rendezvous and start the workers again (see Outcome.decision)
    GIVE_UP = "give_up"  # the restart budget is spent: the job failed
    CHECK_PEERS = "check_peers"  # would give up, but a lost node would explain the failure
    CONFIG_ERROR = "config_error"  # a worker refused its configuration: restarting cannot help


@dataclass(frozen=True, kw_only=True)
class SupervisorState:
    policy: PolicyState = field(default_factory=PolicyState)
    world_size: int | None = None  # of the group now running
    membership_reason: MembershipReason | None = None  # why the next re-formation happens
    refund_if_shrunk: bool = False  # a counted failure that a node loss would explain

    @property
    def restarts(self) -> int:
        return self.policy.restarts


@dataclass(frozen=True, kw_only=True)
class Outcome:
    verdict: Verdict
    state: SupervisorState
    decision: Decision | None = None  # the restart policy's answer, for RESTART / GIVE_UP
    causes: Mapping[int, FailureCause] = field(default_factory=dict)  # rank -> cause
    recovery_cause: str | None = None  # what recovery.completed will name

    @property
    def restart_decision(self) -> Decision:
        """The policy's decision of a RESTART verdict (back-off, budget left)."""
        if self.verdict != Verdict.RESTART or self.decision is None:
            raise ValueError(f"a {self.verdict.value} outcome has no restart decision")
        return self.decision


def root_failures(
    exits: Mapping[int, WorkerExit], killed_pids: Iterable[int], pids: Mapping[int, int]
) -> dict[int, WorkerExit]:
    """Failures not caused by our own kill of the rest of the group (all of them if every
    failed worker was one we killed: then we cannot tell, and report everything)."""
    killed = set(killed_pids)
    own = {rank: e for rank, e in exits.items() if pids.get(rank) not in killed}
    return own or dict(exits)


def on_group_failure(
    policy: RestartPolicy,
    state: SupervisorState,
    exits: Mapping[int, WorkerExit],
    *,
    oom_kills: int,
    ran_for_s: float,
    multi_node: bool,
    peers_leaving: MembershipReason = MembershipReason.PEER_PREEMPTED,
) -> Outcome:
    """Workers of this node failed (``exits``: rank -> how, root failures only);
    ``peers_leaving``: why, if they stopped for a peer's leaving (``leaving_reason``)."""
    causes = {rank: classify_exit(e.exit_code, oom_kills=oom_kills) for rank, e in exits.items()}
    kinds = set(causes.values())
    if FailureCause.CONFIG in kinds:
        return Outcome(
            verdict=Verdict.CONFIG_ERROR,
            state=state,
            causes=causes,
            recovery_cause=FailureCause.CONFIG.value,
        )
    if is_membership_change(exits):
        return _membership(policy, state, peers_leaving, causes)
    decision = policy.on_failure(state.policy, ran_for_s=ran_for_s)
    cause = sorted(c.value for c in kinds)[0]
    if decision.action == Action.GIVE_UP:
        verdict = Verdict.CHECK_PEERS if multi_node else Verdict.GIVE_UP
        return Outcome(
            verdict=verdict, state=state, decision=decision, causes=causes, recovery_cause=cause
        )
    new = replace(state, policy=decision.state, refund_if_shrunk=multi_node)
    return Outcome(
        verdict=Verdict.RESTART, state=new, decision=decision, causes=causes, recovery_cause=cause
    )


def after_peer_check(policy: RestartPolicy, failed: Outcome, *, peer_lost: bool) -> Outcome:
    """A multi-node failure with the budget spent: a vanished peer node makes it a membership
    change (never charged); otherwise the job has failed."""
    if peer_lost:
        return _membership(
            policy, failed.state, MembershipReason.NODE_LOST, failed.causes, relabel=True
        )
    return replace(failed, verdict=Verdict.GIVE_UP)


def on_hang(policy: RestartPolicy, state: SupervisorState, *, ran_for_s: float) -> Outcome:
    decision = policy.on_failure(state.policy, ran_for_s=ran_for_s, hang=True)
    if decision.action == Action.GIVE_UP:
        return Outcome(
            verdict=Verdict.GIVE_UP, state=state, decision=decision, recovery_cause="hang"
        )
    new = replace(state, policy=decision.state)
    return Outcome(verdict=Verdict.RESTART, state=new, decision=decision, recovery_cause="hang")


def on_nodes_waiting(policy: RestartPolicy, state: SupervisorState) -> Outcome:
    """A node waits in the rendezvous: re-form to admit it."""
    return _membership(policy, state, MembershipReason.NODE_JOINED, {})


def on_peers_left(
    policy: RestartPolicy,
    state: SupervisorState,
    causes: Mapping[int, FailureCause],
    reason: MembershipReason = MembershipReason.PEER_PREEMPTED,
) -> Outcome:
    """Workers of this node ended after a member said it leaves on purpose (preempted, or a
    straggler: its goodbye came before its workers stopped): their failure is its leaving, a
    membership change, never charged, whatever the exit code (a plain script dies in its
    collective). ``reason``: ``leaving_reason``."""
    return _membership(policy, state, reason, causes)


def leaving_reason(left: Set[Any], stragglers: Set[Any]) -> MembershipReason:
    """Why members that said goodbye (``left``) leave: as stragglers when every one of them
    said so (``stragglers``), else preempted (a preemption among them is the news)."""
    if left and left <= stragglers:
        return MembershipReason.STRAGGLER_EVICTED
    return MembershipReason.PEER_PREEMPTED


def on_peers_gone(policy: RestartPolicy, state: SupervisorState) -> Outcome:
    """Members of our round are gone: lost (their agent's connection closed without a goodbye)
    or silent (no heartbeat, no reset: frozen or cut off). Re-form without them at once, free
    of charge, instead of waiting for their heartbeats to expire or a collective to time out."""
    return _membership(policy, state, MembershipReason.NODE_LOST, {}, relabel=True)


def close_round_now(
    *,
    me: object,
    complete: bool,
    joined: Set[object],
    waiting: Set[object],
    known: Set[object],
    dead: Set[object],
    min_nodes: int,
    max_nodes: int,
) -> bool:
    """May this node close the re-forming round it has joined, without the last-call wait?

    Yes once every node still alive from the previous round (``known`` minus ``dead``) and every
    node already waiting to join has joined, within [min_nodes, max_nodes]. The last call is for
    nodes nobody knows about yet; one starting now is admitted by the next round. The first round
    (nothing ``known``) keeps its patient last call: nodes start seconds apart.
    """
    if complete or me not in joined or not known:
        return False
    expected = (set(known) - set(dead)) | set(waiting)
    return min_nodes <= len(joined) <= max_nodes and expected <= set(joined)


# How long past its last call a re-forming round waits for members of the previous round that
# are alive but have not joined yet (a survivor still stopping its workers, or waiting for
# their just-in-time copies, up to 10 s): a hung agent whose heartbeat thread still beats must
# not hold the others for good.
MAX_HOLD_S = 60.0


def hold_round_open(
    *,
    complete: bool,
    joined: Set[object],
    known: Set[object],
    dead: Set[object],
    alive: Set[object],
    max_nodes: int,
    held_s: float,
) -> bool:
    """The last call of the re-forming round this node joined has run out: keep it open
    instead of closing it?

    Yes while a member of the previous round (``known``), not known gone (``dead``), is alive
    (``alive``: its heartbeat is fresh) and has not joined, for up to ``MAX_HOLD_S`` past the
    last call. Closed without it, the round would start a group the latecomer then joins at
    once: another restart for everyone, and with many nodes rejoining (each seconds apart on
    a loaded store) rounds kept closing short of them, one restart after another. The first
    round (nothing ``known``) is not held: its own last call is the patient one.
    """
    if complete or not known or len(joined) >= max_nodes or held_s >= MAX_HOLD_S:
        return False
    missing = (set(known) - set(dead)) - set(joined)
    return bool(missing & set(alive))


def alive_members(
    beats: Mapping[Any, int | None], connected: Set[object], *, now_us: int, expiry_us: float
) -> set[Any]:
    """Which of the members in ``beats`` (their own heartbeat key in this store: µs since the
    epoch, None where there is none) are alive, for ``hold_round_open``?

    A member whose heartbeat is fresher than the expiry. Also one with no heartbeat in this
    store at all whose presence connection is open (``connected``): after a store failover
    the survivors reach the new store seconds apart (each notices, elects and dials on its
    own), and one not there yet has never beaten in it; closed short of it, the round starts
    a group every latecomer then restarts by joining (64 agents: five rounds of 4, 9, 18,
    58 and 63 nodes for one lost store host). A member frozen where it stood has a stale
    beat in the store it shared with us and is not waited for; one frozen as the store moved
    keeps its connection open and holds the round up to ``MAX_HOLD_S``.
    """
    fresh = {n for n, at in beats.items() if at is not None and now_us - at < expiry_us}
    on_their_way = {n for n, at in beats.items() if at is None and n in connected}
    return fresh | on_their_way


def peers_to_watch(me: Any, members: Set[Any], watchers: int) -> set[Any]:
    """The members whose heartbeats ``me`` checks for silence: the next ``watchers`` after
    it in node order, round the ring (every other one in a round that small).

    Each member is checked by ``watchers`` others; one that finds it silent re-forms, and
    its re-join mark brings every other member along (a member still checked by nobody
    would need every one of its watchers silent too, and they are checked in turn). Every
    member used to read every member's heartbeat each second: N² reads through the store
    (at 128 agents most of its 4 MB/s while nothing happened); now N x ``watchers``.
    """
    ordered = sorted(members)
    if me not in members:
        return set(ordered)
    at = ordered.index(me)
    count = min(watchers, len(ordered) - 1)
    return {ordered[(at + step) % len(ordered)] for step in range(1, count + 1)}


def join_after_warm_pool(*, first_join: bool, round_running: bool, pool_ready: bool) -> bool:
    """Should this node wait for its warm pool before it joins the rendezvous?

    Yes when it is about to join a job that is already running (the current round is complete,
    with participants) for the first time and its pool is still warming up: the running group
    stops the moment it sees a node waiting and stays paused until the new node's workers
    train, so joining first would pause it for the pool's start (torch's imports and a first
    optimizer step, seconds). At a job's start nothing runs yet, so the pool's start overlaps
    the first rendezvous instead; later rounds find the pool ready.
    """
    return first_join and round_running and not pool_ready


def _membership(
    policy: RestartPolicy,
    state: SupervisorState,
    reason: MembershipReason,
    causes: Mapping[int, FailureCause],
    *,
    relabel: bool = False,
) -> Outcome:
    decision = policy.on_membership(state.policy)
    new = replace(state, policy=decision.state, membership_reason=reason)
    recovery = reason.value if relabel else _recovery_cause(reason, causes)
    return Outcome(
        verdict=Verdict.RESTART,
        state=new,
        decision=decision,
        causes=causes,
        recovery_cause=recovery,
    )


def _recovery_cause(reason: MembershipReason, causes: Mapping[int, FailureCause]) -> str | None:
    if reason == MembershipReason.PEER_PREEMPTED:
        return FailureCause.PREEMPTED.value
    if reason == MembershipReason.STRAGGLER_EVICTED:
        return reason.value
    return None  # a node joining is no failure: nothing to recover from


@dataclass(frozen=True, kw_only=True)
class NewWorld:
    state: SupervisorState
    changed_reason: MembershipReason | None  # None: same world size as before (or the first)
    old_world_size: int | None
    relabel_node_lost: bool  # the pending recovery's cause is really a lost node


def on_new_world(state: SupervisorState, world_size: int) -> NewWorld:
    """A rendezvous round completed with ``world_size`` workers in all."""
    old = state.world_size
    reason: MembershipReason | None = None
    policy_state = state.policy
    relabel = False
    if old is not None and old != world_size:
        shrunk = world_size < old
        reason = state.membership_reason or (
            MembershipReason.NODE_LOST if shrunk else MembershipReason.NODE_JOINED
        )
        if shrunk and reason == MembershipReason.NODE_JOINED:
            # What this node saw waiting was a survivor re-forming without a node it had not
            # missed yet (another survivor noticed first): the world shrank, a node was lost.
            reason, relabel = MembershipReason.NODE_LOST, True
        if shrunk and state.refund_if_shrunk and policy_state.restarts > 0:
            # the counted failure was a node vanishing: a membership change, not charged
            policy_state = replace(policy_state, restarts=policy_state.restarts - 1)
            reason, relabel = MembershipReason.NODE_LOST, True
    new = SupervisorState(policy=policy_state, world_size=world_size)
    return NewWorld(state=new, changed_reason=reason, old_world_size=old, relabel_node_lost=relabel)


class PeerStop(str, enum.Enum):
    NONE = "none"  # nothing failed, or nothing is still running
    WAIT = "wait"  # peers are finishing their final step: give them the grace period
    KILL_REST = "kill_rest"  # kill the still-running workers now (torch would wait 30 s)


def on_partial_exit(
    codes: Mapping[int, int | None], *, peer_stop_seen: float | None, now: float, grace_s: float
) -> tuple[PeerStop, float | None]:
    """Some workers exited non-zero while others still run. Workers that left because a peer
    node is stopping (EXIT_PEER_PREEMPTED) get the grace period for the others to finish their
    final step; any other failure: kill the rest. Returns (what to do, when first seen)."""
    failed = [c for c in codes.values() if c not in (None, 0)]
    running = any(c is None for c in codes.values())
    if not (failed and running):
        return PeerStop.NONE, peer_stop_seen
    if all(c == protocol.EXIT_PEER_PREEMPTED for c in failed):
        first = peer_stop_seen if peer_stop_seen is not None else now
        if now - first < grace_s:
            return PeerStop.WAIT, first
        return PeerStop.KILL_REST, first
    return PeerStop.KILL_REST, peer_stop_seen


def signal_at_once(local_ranks: Iterable[int], in_session: Iterable[int]) -> list[int]:
    """At a preemption, the workers to SIGTERM at once, as torchrun does: those that have not
    published progress (``protocol.progress_file``: a ``TrainingSession`` writes it when it
    starts), so do not read the stop file. An unmodified script's own SIGTERM handler (its
    checkpoint) then has the whole grace period, not its last 2 s. A session is not signalled:
    the stop file reaches it at its next step boundary, and a SIGTERM to its process group
    would kill its DataLoader workers before the final snapshot."""
    speaking = set(in_session)
    return [rank for rank in local_ranks if rank not in speaking]


def preemption_kill_at(received_at: float, grace_s: float) -> float:
    """When to stop waiting for workers to finish their final snapshot and kill them: the
    grace period minus a margin (at most 2 s) so the kill itself fits inside it."""
    return received_at + max(0.0, grace_s - min(2.0, grace_s * 0.2))


def static_rank_conflict(declared: Mapping[str, int], num_nodes: int) -> str | None:
    """torchrun's static mode: the one-line error when nodes of a round declared the same
    ``--node-rank`` (node name -> its declared rank), else None.

    Node rank N is group rank N, so two nodes with one rank would both host (or both wait for)
    the workers' store and hand out the same worker ranks: a hang, never an error, in torch."""
    by_rank: dict[int, list[str]] = {}
    for node, rank in sorted(declared.items()):
        by_rank.setdefault(rank, []).append(node)
    duplicates = {rank: nodes for rank, nodes in sorted(by_rank.items()) if len(nodes) > 1}
    if not duplicates:
        return None
    rank, nodes = next(iter(duplicates.items()))
    unused = sorted(set(range(num_nodes)) - set(by_rank))
    hint = f" (unused: {', '.join(map(str, unused))})" if unused else ""
    return (
        f"--node-rank={rank} is given to {len(nodes)} nodes ({', '.join(nodes)}): give each "
        f"of the {num_nodes} nodes its own --node-rank, 0 .. {num_nodes - 1}{hint}"
    )


def copies_pending(
    codes: Mapping[int, int | None], *, copiers: Set[int], answered: Set[int]
) -> set[int]:
    """The local ranks a re-form still waits for: alive (no exit code), able to answer the
    request for their just-in-time copy (a ``TrainingSession`` with the tier), and no answer
    yet. A plain script is never waited for."""
    return {
        rank
        for rank, code in codes.items()
        if code is None and rank in copiers and rank not in answered
    }


def start_alongside(local_ranks: Iterable[int], *, aware: Set[int], accelerator: bool) -> bool:
    """A node joins: may the new workers start alongside the old ones, which stop only once
    the new ones are ready (``worker.handoff``), with the new round formed while they train?
    Only when every old worker said its successor waits for the handoff
    (``protocol.handoff_aware_file``: a ``TrainingSession``; any other script would train
    alongside the old group and write its own snapshots), and on a node without GPUs: the
    new processes would hold a second copy of the model in device memory while the old ones
    still hold theirs."""
    return not accelerator and all(rank in aware for rank in local_ranks)


class Handoff(str, enum.Enum):
    """What a node does next while its old workers train and its new ones start (a join)."""

    WAIT = "wait"  # the new workers are still starting: the old ones train on
    READY = "ready"  # every new worker has its process group: the old ones stop, they go on
    ABANDON = "abandon"  # the round moved on first: the new ones go, the old ones train on
    GIVE_UP = "give_up"  # waiting cannot help: the old ones stop, the loop sees what failed


def handoff_step(
    codes: Mapping[int, int | None],
    *,
    ready: Set[int],
    round_moved_on: bool,
    interrupted: bool,
) -> Handoff:
    """The hand-over wait of a join, decided (``codes``: the new workers' local rank -> exit
    code; ``ready``: those with their process group; ``round_moved_on``: a node waits for the
    next round, so some member of the round just formed left it -- its new group can never
    form; ``interrupted``: a stop, a lost peer, or the wait's deadline).

    A new worker that exited ends the wait as before (the loop that follows sees the exit). A
    round that moved on before the new group formed abandons it: the old group never stopped
    and is still whole, so it trains on while the next round forms, instead of stopping for a
    group that would wait in ``init_process_group`` for a member that is not coming."""
    if any(code is not None for code in codes.values()):
        return Handoff.GIVE_UP
    if all(rank in ready for rank in codes):
        return Handoff.READY
    if round_moved_on:
        return Handoff.ABANDON
    if interrupted:
        return Handoff.GIVE_UP
    return Handoff.WAIT


def round_before_stop(outcome: Outcome) -> bool:
    """Does this re-form join the new round while the workers train on, and stop them only
    once it has formed? For a node joining: nothing is wrong with the running group, so it
    trains while the round forms (0.4-0.8 s in docs/benchmarks.md's join). After a failure the
    workers are stopped first: the group is broken, and a node that rejoins at once is what
    closes the round."""
    return (
        outcome.state.membership_reason == MembershipReason.NODE_JOINED
        and outcome.decision is not None
        and outcome.decision.backoff_s == 0
    )


def handed_off(codes: Mapping[int, int | None], *, done: Set[int]) -> bool:
    """Have the old workers (``codes``: local rank -> exit code) let go of the state? Each
    has exited or said it is done (``protocol.handed_off_file``: only its interpreter's exit
    is left, which the new workers need not wait for)."""
    return all(code is not None or rank in done for rank, code in codes.items())
