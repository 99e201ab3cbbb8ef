"""``--evict-stragglers`` in the agent, driven by scripted observations (test_agent.py's
harness): a straggler.detected of this node's rank, then what the agent does with it."""

from __future__ import annotations

import os
from typing import Any

from structlog.testing import capture_logs

from elastic_trainer.contract import protocol
from elastic_trainer.contract.config import RestartTuning, RunConfig
from elastic_trainer.supervisor.agent import STATUS_PREEMPTED, STATUS_SUCCEEDED
from elastic_trainer.supervisor.core import eviction
from tests.process.supervisor.test_agent import OK, RUNNING, Round, Script, ScriptedAgent, named

DETECTED = {"event": "straggler.detected", "node": "node0", "rank": 0, "slowdown": 2.0,
            "median_ms": 100.0, "steps_left": 100_000, "slowest": True}  # fmt: skip


def run_with(
    tmp_path: Any,
    rounds: list[Round],
    *,
    min_nodes: int = 2,
    stop_in_cooldown=False,
    probes=(1.0, 1.0),
):
    """``probes``: the node probe's figures, the first at the supervisor's start."""
    cfg = RunConfig(
        min_nodes=min_nodes,
        max_nodes=3,
        monitor_interval=0.01,
        restart=RestartTuning(backoff_base_s=1.0, backoff_max_s=8.0),
        evict_stragglers=1.3,
        evict_cooldown=7.0,
    )
    agent = ScriptedAgent(Script(rounds), cfg, tmp_path)
    agent._node_probe = iter(probes).__next__
    reports = iter([[], [DETECTED]])  # the rank is named at the second tick
    agent._observer.take_stragglers = lambda: next(reports, [])
    seen: dict[str, Any] = {}

    def on_wait(seconds: float) -> None:
        if seconds == cfg.evict_cooldown:
            seen["cooldowns"] = seen.get("cooldowns", 0) + 1
        if seconds == cfg.evict_cooldown and "left" not in seen:  # out: what the workers were told
            control = os.path.join(str(tmp_path), "attempt-1")
            seen["stop_file"] = os.path.exists(os.path.join(control, protocol.STOP_FILE))
            seen["left"] = agent.script.index == 0 and agent._worker_group.spec.rdzv_handler.left
            agent.stop.requested = stop_in_cooldown

    agent.stop.on_wait = on_wait
    with capture_logs() as logs:
        outcome = agent.supervise()
    return outcome, logs, seen


def test_a_slow_node_leaves_cools_down_and_joins_again(tmp_path):
    rounds = [Round(3, [{0: RUNNING}] * 4), Round(3, [{0: RUNNING}, {0: OK}])]
    outcome, logs, seen = run_with(tmp_path, rounds)
    assert outcome.status == STATUS_SUCCEEDED
    (evicted,) = named(logs, "straggler.evicted")
    assert evicted["slowdown"] == 2.0 and evicted["projected_gain_s"] > 0
    assert evicted["rejoin_after_s"] == 7.0 and evicted["evictions"] == 1
    # the group's sessions stop at a step's end; the round is left before the cool-down
    assert seen == {"stop_file": True, "left": True, "cooldowns": 1}
    (rejoining,) = named(logs, "straggler.rejoining")
    assert rejoining["evictions"] == 1
    assert rejoining["probe_ratio"] == 1.0 and rejoining["cooldowns"] == 1
    assert not named(logs, "straggler.still_slow")
    events = [e["event"] for e in logs]
    assert events.index("straggler.evicted") < events.index("straggler.rejoining")
    assert len(named(logs, "rendezvous.completed")) == 2  # the second: joining again


def test_a_slow_node_the_group_cannot_spare_stays_and_says_why(tmp_path):
    rounds = [Round(3, [{0: RUNNING}] * 4 + [{0: OK}])]
    outcome, logs, seen = run_with(tmp_path, rounds, min_nodes=3)
    assert outcome.status == STATUS_SUCCEEDED and seen == {}
    (kept,) = named(logs, "straggler.kept")
    assert "--min-nodes 3" in kept["reason"] and kept["rank"] == 0
    assert not named(logs, "straggler.evicted")


def test_a_stop_during_the_cool_down_ends_the_supervisor_as_preempted(tmp_path):
    rounds = [Round(3, [{0: RUNNING}] * 4), Round(3, [{0: OK}])]
    outcome, logs, _ = run_with(tmp_path, rounds, stop_in_cooldown=True)
    assert outcome.status == STATUS_PREEMPTED
    assert named(logs, "straggler.evicted") and not named(logs, "straggler.rejoining")
    assert len(named(logs, "rendezvous.completed")) == 1


def test_a_node_its_own_probe_still_finds_slow_cools_down_again(tmp_path):
    rounds = [Round(3, [{0: RUNNING}] * 4), Round(3, [{0: RUNNING}, {0: OK}])]
    outcome, logs, seen = run_with(tmp_path, rounds, probes=(0.01, 0.02, 0.0105))
    assert outcome.status == STATUS_SUCCEEDED and seen["cooldowns"] == 2
    (still,) = named(logs, "straggler.still_slow")
    assert still["probe_ratio"] == 2.0 and still["cooldowns"] == 1
    (rejoining,) = named(logs, "straggler.rejoining")
    assert rejoining["probe_ratio"] == 1.05 and rejoining["cooldowns"] == 2


def test_a_node_its_probe_keeps_finding_slow_joins_after_the_last_cool_down(tmp_path):
    rounds = [Round(3, [{0: RUNNING}] * 4), Round(3, [{0: RUNNING}, {0: OK}])]
    probes = (0.01, *[0.03] * eviction.MAX_COOLDOWNS)
    outcome, logs, seen = run_with(tmp_path, rounds, probes=probes)
    assert outcome.status == STATUS_SUCCEEDED and seen["cooldowns"] == eviction.MAX_COOLDOWNS
    assert len(named(logs, "straggler.still_slow")) == eviction.MAX_COOLDOWNS - 1
    (rejoining,) = named(logs, "straggler.rejoining")  # the group's verdict judges it again
    assert rejoining["probe_ratio"] == 3.0
