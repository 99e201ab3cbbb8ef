"""decisions.py: pure functions of (state, observation), tested in microseconds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastic_trainer.contract import protocol
from elastic_trainer.contract.events import FailureCause, MembershipReason
from elastic_trainer.supervisor.core import decisions
from elastic_trainer.supervisor.core.decisions import PeerStop, SupervisorState, Verdict
from elastic_trainer.supervisor.core.policy import PolicyState, RestartPolicy, WorkerExit

POLICY = RestartPolicy(max_restarts=2)


def exits(**codes: int) -> dict[int, WorkerExit]:
    return {
        int(r[1:]): WorkerExit(local_rank=int(r[1:]), rank=int(r[1:]), exit_code=c)
        for r, c in codes.items()
    }


def fail(state: SupervisorState, multi_node: bool = False, **codes: int) -> decisions.Outcome:
    return decisions.on_group_failure(
        POLICY, state, exits(**codes), oom_kills=0, ran_for_s=100.0, multi_node=multi_node
    )


def test_root_failures_leave_out_the_workers_we_killed() -> None:
    both = exits(r0=1, r1=-15)
    assert decisions.root_failures(both, killed_pids={11}, pids={0: 10, 1: 11}).keys() == {0}
    # every failure was our own kill: we cannot tell, so all are reported
    assert decisions.root_failures(both, killed_pids={10, 11}, pids={0: 10, 1: 11}) == both


def test_a_counted_failure_restarts_and_charges_the_budget() -> None:
    outcome = fail(SupervisorState(), r0=1)
    assert outcome.verdict == Verdict.RESTART and outcome.state.restarts == 1
    assert outcome.causes == {0: FailureCause.ERROR} and outcome.recovery_cause == "error"
    assert not outcome.state.refund_if_shrunk


def test_exit_2_is_a_configuration_error_whatever_the_budget() -> None:
    outcome = fail(SupervisorState(), r0=protocol.EXIT_CONFIG, r1=-9)
    assert outcome.verdict == Verdict.CONFIG_ERROR and outcome.state.restarts == 0
    assert outcome.causes[0] == FailureCause.CONFIG


def test_peer_preemption_is_free_and_labelled() -> None:
    outcome = fail(SupervisorState(), multi_node=True, r0=protocol.EXIT_PEER_PREEMPTED)
    assert outcome.verdict == Verdict.RESTART and outcome.state.restarts == 0
    assert outcome.state.membership_reason == MembershipReason.PEER_PREEMPTED
    assert outcome.recovery_cause == "preempted"


@pytest.mark.parametrize(
    ("multi_node", "verdict"), [(False, Verdict.GIVE_UP), (True, Verdict.CHECK_PEERS)]
)
def test_a_spent_budget_gives_up_unless_a_lost_node_may_explain_it(multi_node, verdict) -> None:
    spent = SupervisorState(policy=PolicyState(restarts=2))
    assert fail(spent, multi_node=multi_node, r0=1).verdict == verdict


def test_after_the_peer_check() -> None:
    spent = SupervisorState(policy=PolicyState(restarts=2))
    checked = fail(spent, multi_node=True, r0=-9)
    lost = decisions.after_peer_check(POLICY, checked, peer_lost=True)
    assert lost.verdict == Verdict.RESTART and lost.state.restarts == 2
    assert lost.recovery_cause == "node_lost"
    assert decisions.after_peer_check(POLICY, checked, peer_lost=False).verdict == Verdict.GIVE_UP


def test_a_smaller_world_after_a_multi_node_failure_refunds_it() -> None:
    running = SupervisorState(world_size=4)
    failed = fail(running, multi_node=True, r0=-9)
    assert failed.state.restarts == 1 and failed.state.refund_if_shrunk
    world = decisions.on_new_world(failed.state, 2)
    assert world.state.restarts == 0 and world.relabel_node_lost
    assert (world.old_world_size, world.changed_reason) == (4, MembershipReason.NODE_LOST)
    assert world.state == SupervisorState(world_size=2)  # pending reason and refund cleared


def test_the_same_world_keeps_the_charge_and_reports_no_change() -> None:
    failed = fail(SupervisorState(world_size=4), multi_node=True, r0=-9)
    world = decisions.on_new_world(failed.state, 4)
    assert world.state.restarts == 1 and world.changed_reason is None


def test_a_bigger_world_is_a_node_joining() -> None:
    joining = decisions.on_nodes_waiting(POLICY, SupervisorState(world_size=1))
    assert joining.verdict == Verdict.RESTART and joining.state.restarts == 0
    world = decisions.on_new_world(joining.state, 2)
    assert world.changed_reason == MembershipReason.NODE_JOINED


def test_a_smaller_world_after_a_node_waiting_is_a_node_lost() -> None:
    """Regression: of two survivors of a partition, the one that had not noticed the silent
    node yet saw the other waiting in a new round and restarted for a "joining" node; the
    round closed at 2 of 3, and it reported membership.changed 3 -> 2 as node_joined."""
    waiting = decisions.on_nodes_waiting(POLICY, SupervisorState(world_size=3))
    world = decisions.on_new_world(waiting.state, 2)
    assert (world.old_world_size, world.changed_reason) == (3, MembershipReason.NODE_LOST)
    assert world.relabel_node_lost  # its recovery is a lost node's too


def test_hangs_count_and_eventually_give_up() -> None:
    outcome = decisions.on_hang(POLICY, SupervisorState(), ran_for_s=500.0)
    assert outcome.verdict == Verdict.RESTART and outcome.decision.reason == "hang"
    spent = replace(outcome.state, policy=PolicyState(restarts=2))
    assert decisions.on_hang(POLICY, spent, ran_for_s=500.0).verdict == Verdict.GIVE_UP


@pytest.mark.parametrize(
    ("codes", "seen", "now", "expected"),
    [
        ({0: None, 1: None}, None, 5.0, (PeerStop.NONE, None)),
        ({0: 0, 1: 1}, None, 5.0, (PeerStop.NONE, None)),  # nothing left running
        ({0: 75, 1: None}, None, 5.0, (PeerStop.WAIT, 5.0)),  # peers finish the final step
        ({0: 75, 1: None}, 1.0, 5.0, (PeerStop.WAIT, 1.0)),
        ({0: 75, 1: None}, 1.0, 12.0, (PeerStop.KILL_REST, 1.0)),  # grace (10 s) is over
        ({0: 1, 1: None}, None, 5.0, (PeerStop.KILL_REST, None)),  # a real failure
    ],
)
def test_partial_exits(codes, seen, now, expected) -> None:
    assert decisions.on_partial_exit(codes, peer_stop_seen=seen, now=now, grace_s=10.0) == expected


@pytest.mark.parametrize(("grace", "kill_at"), [(25.0, 123.0), (5.0, 104.0), (0.0, 100.0)])
def test_preemption_kill_leaves_a_margin_inside_the_grace_period(grace, kill_at) -> None:
    assert decisions.preemption_kill_at(100.0, grace) == kill_at


def close(**kw: object) -> bool:
    base: dict = dict(
        me="a", complete=False, joined={"a"}, waiting=set(), known={"a", "b"}, dead=set()
    )
    return decisions.close_round_now(**{**base, **kw}, min_nodes=1, max_nodes=4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "kw", "closes"),
    [
        ("the lost node is known dead: no wait", dict(dead={"b"}), True),
        ("a live peer has not rejoined yet: wait for it", {}, False),
        ("every member rejoined", dict(joined={"a", "b"}), True),
        ("a node waits to join: wait for it", dict(known={"a"}, waiting={"c"}), False),
        ("the waiting node joined", dict(known={"a"}, joined={"a", "c"}), True),
        ("first round: the patient last call", dict(known=set()), False),
        ("not a participant: may not close", dict(joined={"b"}, dead={"a"}), False),
        ("already complete", dict(complete=True, dead={"b"}), False),
    ],
)
def test_a_reforming_round_closes_once_every_live_node_is_in(case, kw, closes) -> None:
    assert close(**kw) is closes, case


def test_a_round_below_min_nodes_never_closes_early() -> None:
    assert not decisions.close_round_now(
        me="a",
        complete=False,
        joined={"a"},
        waiting=set(),
        known={"a", "b"},
        dead={"b"},
        min_nodes=2,
        max_nodes=2,
    )


def test_gone_peers_are_a_free_node_lost_membership_change() -> None:
    policy = RestartPolicy(max_restarts=0)
    out = decisions.on_peers_gone(policy, SupervisorState(world_size=2))
    assert out.verdict == Verdict.RESTART
    assert out.state.membership_reason == MembershipReason.NODE_LOST
    assert out.state.restarts == 0 and out.recovery_cause == "node_lost"


# ---- static mode: one --node-rank per node ------------------------------------------------
def test_distinct_static_node_ranks_are_fine() -> None:
    declared = {"127.0.0.1:10": 1, "127.0.0.2:20": 0, "127.0.0.3:30": 2}
    assert decisions.static_rank_conflict(declared, 3) is None


def test_two_nodes_with_one_node_rank_are_named_with_the_fix() -> None:
    declared = {"127.0.0.2:20": 1, "127.0.0.1:10": 1}
    line = decisions.static_rank_conflict(declared, 2)
    assert line == (
        "--node-rank=1 is given to 2 nodes (127.0.0.1:10, 127.0.0.2:20): give each of the 2 "
        "nodes its own --node-rank, 0 .. 1 (unused: 0)"
    )


def test_the_lowest_duplicate_rank_is_reported_first() -> None:
    declared = {"a:1": 2, "b:2": 2, "c:3": 0, "d:4": 0}
    line = decisions.static_rank_conflict(declared, 4)
    assert line is not None and line.startswith("--node-rank=0 is given to 2 nodes (c:3, d:4)")
    assert line.endswith("(unused: 1, 3)")


def test_a_node_joining_a_running_job_waits_for_its_warm_pool_first():
    join = decisions.join_after_warm_pool
    assert join(first_join=True, round_running=True, pool_ready=False)
    assert not join(first_join=True, round_running=True, pool_ready=True)
    assert not join(first_join=True, round_running=False, pool_ready=False)  # the job's start
    assert not join(first_join=False, round_running=True, pool_ready=False)  # a re-formation


def test_at_a_preemption_only_workers_outside_a_session_get_sigterm_at_once() -> None:
    assert decisions.signal_at_once(range(4), in_session={0: "p", 2: "p"}) == [1, 3]
    assert decisions.signal_at_once(range(2), in_session=()) == [0, 1]


def test_only_a_join_forms_the_round_before_the_workers_stop() -> None:
    state = SupervisorState()
    assert decisions.round_before_stop(decisions.on_nodes_waiting(POLICY, state))
    # the group is broken after a loss or a failure: stop first, as nodes rejoin at once
    assert not decisions.round_before_stop(decisions.on_peers_gone(POLICY, state))
    assert not decisions.round_before_stop(fail(state, r0=1))


@pytest.mark.parametrize(
    ("aware", "accelerator", "alongside"),
    [
        ({0, 1}, False, True),
        ({0}, False, False),  # rank 1 runs a script that would not wait for the handoff
        (set(), False, False),  # a plain script (even one that publishes progress)
        ({0, 1}, True, False),  # GPUs: the new processes would need a second copy of the model
    ],
)
def test_new_workers_start_alongside_only_where_they_wait_and_fit(aware, accelerator, alongside):
    got = decisions.start_alongside(range(2), aware=aware, accelerator=accelerator)
    assert got is alongside


WAIT, READY, ABANDON, GIVE_UP = (
    decisions.Handoff.WAIT,
    decisions.Handoff.READY,
    decisions.Handoff.ABANDON,
    decisions.Handoff.GIVE_UP,
)


@pytest.mark.parametrize(
    ("codes", "ready", "moved_on", "interrupted", "step"),
    [
        ({0: None, 1: None}, set(), False, False, WAIT),
        ({0: None, 1: None}, {0}, False, False, WAIT),
        ({0: None, 1: None}, {0, 1}, False, False, READY),  # every new worker has its group
        ({0: None, 1: 1}, {0}, False, False, GIVE_UP),  # one died: the loop sees it
        ({0: 0, 1: None}, set(), False, False, GIVE_UP),
        # a member of the new round left it (its worker died, it re-joins): the old group,
        # still whole, trains on; the new one could never form
        ({0: None, 1: None}, {0}, True, False, ABANDON),
        ({0: None, 1: None}, {0, 1}, True, False, READY),  # formed: what comes next, next
        ({0: None, 1: 1}, set(), True, False, GIVE_UP),  # ours failed: not the round's doing
        ({0: None, 1: None}, {1}, False, True, GIVE_UP),  # stop, lost peer, deadline
        ({0: None, 1: None}, set(), True, True, ABANDON),
    ],
)
def test_the_old_workers_train_until_the_new_ones_are_ready_or_the_wait_ends(
    codes, ready, moved_on, interrupted, step
):
    got = decisions.handoff_step(
        codes, ready=ready, round_moved_on=moved_on, interrupted=interrupted
    )
    assert got is step


@pytest.mark.parametrize(
    ("codes", "done", "handed"),
    [
        ({0: None, 1: None}, set(), False),
        ({0: None, 1: None}, {0}, False),
        ({0: None, 1: None}, {0, 1}, True),  # only their interpreters' exit is left
        ({0: 0, 1: None}, {1}, True),
        ({0: -9, 1: 75}, set(), True),  # exited, however
    ],
)
def test_the_new_workers_go_on_once_each_old_one_has_exited_or_let_go(codes, done, handed):
    assert decisions.handed_off(codes, done=done) is handed


def test_our_workers_ending_after_a_peer_said_goodbye_is_a_free_preemption() -> None:
    state = SupervisorState(world_size=2)
    out = decisions.on_peers_left(POLICY, state, {})
    assert out.verdict == Verdict.RESTART and out.state.membership_reason.value == "peer_preempted"
    assert out.recovery_cause == "preempted"
    assert out.state.policy == decisions.on_peers_gone(POLICY, state).state.policy  # not charged


def test_a_straggler_leaving_is_said_so_and_is_as_free_as_a_preemption() -> None:
    state = SupervisorState(world_size=3)
    reason = decisions.leaving_reason({"b"}, {"b"})
    assert reason == MembershipReason.STRAGGLER_EVICTED
    out = decisions.on_peers_left(POLICY, state, {}, reason)
    assert out.state.membership_reason == MembershipReason.STRAGGLER_EVICTED
    assert out.recovery_cause == "straggler_evicted"
    assert out.state.policy == decisions.on_peers_left(POLICY, state, {}).state.policy
    # a session's workers exit 75 for it: the same reason through on_group_failure
    out = decisions.on_group_failure(
        POLICY,
        state,
        exits(r0=protocol.EXIT_PEER_PREEMPTED),
        oom_kills=0,
        ran_for_s=100.0,
        multi_node=True,
        peers_leaving=reason,
    )
    assert out.state.membership_reason == MembershipReason.STRAGGLER_EVICTED


@pytest.mark.parametrize(
    ("left", "stragglers", "reason"),
    [
        ({"b"}, {"b"}, "straggler_evicted"),
        ({"b", "c"}, {"b"}, "peer_preempted"),  # a preemption among them is the news
        ({"b"}, set(), "peer_preempted"),
        (set(), set(), "peer_preempted"),
    ],
)
def test_why_members_leave(left, stragglers, reason) -> None:
    assert decisions.leaving_reason(left, stragglers).value == reason


def hold(**kw: object) -> bool:
    base: dict = dict(
        complete=False, joined={"a", "b"}, known={"a", "b", "c"}, dead=set(), alive={"c"}
    )
    held_s = kw.pop("held_s", 1.0)
    return decisions.hold_round_open(**{**base, **kw}, max_nodes=4, held_s=held_s)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "kw", "holds"),
    [
        ("a live member of the last round is still on its way: wait for it", {}, True),
        ("its heartbeat is stale (frozen, cut off): close without it", dict(alive=set()), False),
        ("it is known gone: close", dict(dead={"c"}), False),
        ("it has joined: nothing to hold for", dict(joined={"a", "b", "c"}), False),
        ("first round: its own last call is the patient one", dict(known=set()), False),
        ("already complete", dict(complete=True), False),
        ("held long enough: a hung agent does not hold the others for good",
         dict(held_s=decisions.MAX_HOLD_S), False),
        ("a live node that was never a member does not hold it", dict(alive={"z"}), False),
    ],
)  # fmt: skip
def test_a_round_whose_last_call_ran_out_is_held_for_live_members_still_rejoining(
    case, kw, holds
) -> None:
    assert hold(**kw) is holds, case


EXPIRY_US = 3_000_000
NOW_US = 100 * EXPIRY_US


@pytest.mark.parametrize(
    ("case", "beat_us", "connected", "alive"),
    [
        ("its heartbeat is fresh", NOW_US - EXPIRY_US // 2, True, True),
        ("fresh though its connection is gone (the watch decides that)",
         NOW_US - EXPIRY_US // 2, False, True),
        ("its heartbeat is stale: frozen where it stood", NOW_US - 2 * EXPIRY_US, True, False),
        ("no heartbeat in this store, connected: on its way to a moved store", None, True, True),
        ("no heartbeat in this store and no connection", None, False, False),
    ],
)  # fmt: skip
def test_a_member_is_alive_by_its_heartbeat_or_on_its_way_to_a_moved_store(
    case, beat_us, connected, alive
) -> None:
    found = decisions.alive_members(
        {"b": beat_us},
        {"b"} if connected else set(),
        now_us=NOW_US,
        expiry_us=EXPIRY_US,
    )
    assert (found == {"b"}) is alive, case


@pytest.mark.parametrize("size", [2, 3, 4, 7, 64])
def test_every_member_s_heartbeats_are_checked_by_two_others(size: int) -> None:
    members = {f"n{i:02d}" for i in range(size)}
    watched = {m: decisions.peers_to_watch(m, members, 2) for m in members}
    assert all(m not in peers and len(peers) == min(2, size - 1) for m, peers in watched.items())
    watchers = {m: {w for w, peers in watched.items() if m in peers} for m in members}
    assert all(len(by) == min(2, size - 1) for by in watchers.values())


def test_the_watched_are_the_next_in_node_order_round_the_ring() -> None:
    members = {"a", "b", "c", "d", "e"}
    assert decisions.peers_to_watch("a", members, 2) == {"b", "c"}
    assert decisions.peers_to_watch("e", members, 2) == {"a", "b"}
    assert decisions.peers_to_watch("z", members, 2) == members  # not a member: all


def test_a_full_round_is_never_held() -> None:
    assert not decisions.hold_round_open(
        complete=False,
        joined={"a", "b"},
        known={"a", "b", "c"},
        dead=set(),
        alive={"c"},
        max_nodes=2,
        held_s=0.0,
    )
