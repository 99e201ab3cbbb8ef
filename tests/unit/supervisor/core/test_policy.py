"""Pure restart policy, watchdog verdicts and recovery/goodput bookkeeping."""

from __future__ import annotations

import signal

import pytest

from elastic_trainer.contract import protocol
from elastic_trainer.contract.config import RestartTuning
from elastic_trainer.supervisor.core.ledger import Ledger
from elastic_trainer.supervisor.core.policy import (
    Action,
    Cause,
    PolicyState,
    RestartPolicy,
    WorkerExit,
    classify_exit,
    goodput,
    is_membership_change,
    signal_name,
)
from elastic_trainer.supervisor.core.watchdog import HangWatchdog, Progress, parse_progress

KILL = -int(signal.SIGKILL)


@pytest.mark.parametrize(
    ("code", "ooms", "cause"),
    [
        (1, 0, Cause.ERROR),
        (protocol.EXIT_PEER_PREEMPTED, 0, Cause.PREEMPTED),
        (-int(signal.SIGSEGV), 0, Cause.SIGNAL),
        (KILL, 0, Cause.SIGNAL),
        (KILL, 1, Cause.OOM),
        (128 + int(signal.SIGKILL), 2, Cause.OOM),
        (-int(signal.SIGTERM), 3, Cause.SIGNAL),
    ],
)
def test_classify_exit(code: int, ooms: int, cause: Cause) -> None:
    assert classify_exit(code, oom_kills=ooms) is cause


def test_signal_name() -> None:
    assert signal_name(KILL) == "SIGKILL"
    assert signal_name(1) is None


def test_membership_change_only_when_every_failure_is_peer_preempted() -> None:
    peer = WorkerExit(local_rank=0, rank=0, exit_code=protocol.EXIT_PEER_PREEMPTED)
    crash = WorkerExit(local_rank=1, rank=1, exit_code=1)
    assert is_membership_change({0: peer})
    assert not is_membership_change({0: peer, 1: crash})
    assert not is_membership_change({})


def test_budget_gives_up_after_exactly_max_restarts() -> None:
    policy = RestartPolicy(max_restarts=2, tuning=RestartTuning(crash_loop_window_s=0))
    state = PolicyState()
    actions = []
    for _ in range(3):
        decision = policy.on_failure(state, ran_for_s=100)
        actions.append(decision.action)
        state = decision.state
    assert actions == [Action.RESTART, Action.RESTART, Action.GIVE_UP]
    assert state.restarts == 2


def test_zero_budget_gives_up_at_once() -> None:
    decision = RestartPolicy(max_restarts=0).on_failure(PolicyState(), ran_for_s=1)
    assert decision.action is Action.GIVE_UP and decision.restarts_left == 0


def test_membership_changes_are_free() -> None:
    policy = RestartPolicy(max_restarts=1)
    state = PolicyState()
    for _ in range(5):
        decision = policy.on_membership(state)
        assert decision.action is Action.RESTART and not decision.counts
        state = decision.state
    assert state.restarts == 0 and state.membership_restarts == 5
    assert policy.on_failure(state, ran_for_s=100).action is Action.RESTART


def test_crash_loop_backs_off_exponentially_and_caps() -> None:
    tuning = RestartTuning(crash_loop_window_s=30, backoff_base_s=1, backoff_max_s=5)
    policy = RestartPolicy(max_restarts=10, tuning=tuning)
    state, backoffs = PolicyState(), []
    for _ in range(6):
        decision = policy.on_failure(state, ran_for_s=2)
        backoffs.append(decision.backoff_s)
        state = decision.state
    assert backoffs == [0, 1, 2, 4, 5, 5]


def test_a_long_run_resets_the_crash_streak() -> None:
    policy = RestartPolicy(max_restarts=10, tuning=RestartTuning(crash_loop_window_s=30))
    state = policy.on_failure(PolicyState(), ran_for_s=1).state
    state = policy.on_failure(state, ran_for_s=1).state
    decision = policy.on_failure(state, ran_for_s=300)
    assert decision.backoff_s == 0 and decision.state.crash_streak == 0


def test_hang_is_a_counted_failure() -> None:
    decision = RestartPolicy(max_restarts=3).on_failure(PolicyState(), ran_for_s=99, hang=True)
    assert decision.reason == "hang" and decision.counts and decision.restarts_left == 2


def test_goodput() -> None:
    assert goodput([], wall_s=10) is None
    assert goodput([(5.0, 10, 10)], wall_s=10) == 0.5
    assert goodput([(4.0, 10, 5), (4.0, 10, 10)], wall_s=10) == pytest.approx(0.6)


# ---- watchdog -----------------------------------------------------------------------------
def p(step: int) -> Progress:
    return Progress(step=step, time=float(step))


def test_watchdog_is_not_armed_before_any_report() -> None:
    dog = HangWatchdog(timeout_s=5)
    assert dog.observe({}, now=0) is None
    assert dog.observe({}, now=1000) is None  # a plain torchrun script: never a hang


def test_watchdog_fires_when_no_rank_progresses() -> None:
    dog = HangWatchdog(timeout_s=5)
    dog.observe({0: p(1), 1: p(1)}, now=0)
    assert dog.observe({0: p(1), 1: p(1)}, now=4.9) is None
    verdict = dog.observe({0: p(1), 1: p(1)}, now=5.1)
    assert (
        verdict is not None and verdict.last_step == 1 and verdict.stalled_s == pytest.approx(5.1)
    )


def test_watchdog_any_rank_progressing_keeps_it_quiet() -> None:
    dog = HangWatchdog(timeout_s=5)
    dog.observe({0: p(1), 1: p(1)}, now=0)
    dog.observe({0: p(2), 1: p(1)}, now=4)
    assert dog.observe({0: p(2), 1: p(1)}, now=8) is None
    verdict = dog.observe({0: p(2), 1: p(1)}, now=9.5)
    assert verdict is not None and verdict.local_rank == 1  # the one that stalled first


def test_watchdog_reset_disarms_and_zero_timeout_is_off() -> None:
    dog = HangWatchdog(timeout_s=5)
    dog.observe({0: p(1)}, now=0)
    dog.reset()
    assert dog.observe({}, now=100) is None
    off = HangWatchdog(timeout_s=0)
    off.observe({0: p(1)}, now=0)
    assert off.observe({0: p(1)}, now=1e6) is None


def test_a_progress_record_read_while_it_is_rewritten_is_refused_not_misread() -> None:
    """Workers write the record in place; a read that catches the write half done mixes the
    new record's start with the old one's end, which could parse as a step that never was."""
    old = protocol.progress_record({"step": 199, "epoch": 0, "restored_step": None, "time": 9})
    new = protocol.progress_record({"step": 200, "epoch": 0, "restored_step": None, "time": 9})
    assert len(old) == len(new) == protocol.PROGRESS_RECORD_BYTES
    assert parse_progress(new.decode()) == Progress(step=200, epoch=0, restored_step=None, time=9)
    torn = (new[:18] + old[18:]).decode()  # 199 -> 200 half done: reads "step":299
    assert torn != new.decode() and parse_progress(torn) is None
    assert parse_progress(new.decode()[:40]) is None


def test_parse_progress_tolerates_partial_files() -> None:
    assert parse_progress('{"step": 3, "epoch": 1, "restored_step": 2, "time": 5}') == Progress(
        step=3, epoch=1, restored_step=2, time=5.0
    )
    assert parse_progress('{"step": ') is None
    assert parse_progress("[]") is None
    assert parse_progress('{"epoch": 1}') is None


# ---- ledger -------------------------------------------------------------------------------
def test_ledger_recovery_figures() -> None:
    ledger = Ledger()
    ledger.start_attempt()
    ledger.observe({0: Progress(step=7, restored_step=0, time=100.0)}, world_size=2)
    ledger.failed(cause="signal", now=101.0, world_size=2)
    ledger.failed(cause="error", now=101.5, world_size=2)  # the cascade keeps the first cause
    ledger.start_attempt()
    assert ledger.observe({}, world_size=1) is None
    fields = ledger.observe({0: Progress(step=6, restored_step=5, time=104.5)}, world_size=1)
    assert fields == {
        "cause": "signal",
        "downtime_s": 3.5,
        "steps_lost": 2,
        "world_size_before": 2,
        "world_size_after": 1,
        "snapshot_step": 5,
    }
    assert ledger.pending is None


def test_ledger_relabel_and_goodput_counts_only_kept_steps() -> None:
    ledger = Ledger()
    ledger.start_attempt()
    ledger.observe({0: Progress(step=1, restored_step=None, time=0.0)}, world_size=1)
    ledger.observe({0: Progress(step=10, restored_step=None, time=9.0)}, world_size=1)
    ledger.failed(cause="error", now=9.5, world_size=2)
    ledger.relabel("node_lost")
    assert ledger.pending is not None and ledger.pending.cause == "node_lost"
    ledger.start_attempt()
    ledger.observe({0: Progress(step=6, restored_step=5, time=12.0)}, world_size=1)
    ledger.observe({0: Progress(step=10, restored_step=5, time=16.0)}, world_size=1)
    # attempt 1: 10 steps in 10 s, 5 kept -> 5 s; attempt 2: 5 steps in 5 s, all kept
    assert ledger.goodput(20.0) == pytest.approx(0.5)
