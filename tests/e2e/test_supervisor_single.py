"""One node: restart after a kill, crash-loop budget, watchdog, plain torchrun scripts, logs."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from tests.e2e.workers.harness import (
    EXIT_RACE,
    PLAIN_DDP,
    PROTO,
    REQUIRED,
    descendants_alive,
    env_with,
    free_port,
    kill_once_argv,
    read_audit,
    start_agent,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_worker_killed_once_restarts_from_snapshot_and_succeeds(tmp_path, worker_env, agents):
    audit = tmp_path / "audit"
    # the steps since the storage snapshot are lost (the memory tier would keep them)
    argv = kill_once_argv(tmp_path, "--no-memory-tier")
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(150) == 0
    failed = agent.events("worker.failed")
    assert [e["cause"] for e in failed if e["rank"] == 1] == ["signal"]
    assert any(e["signal"] == "SIGKILL" for e in failed)
    restarts = agent.events("group.restarting")
    assert len(restarts) == 1 and restarts[0]["reason"] == "failure"
    recovery = agent.events("recovery.completed")
    assert len(recovery) == 1
    assert recovery[0]["snapshot_step"] == 5 and recovery[0]["steps_lost"] == 2
    assert recovery[0]["downtime_s"] > 0
    finished = agent.events("job.finished")[-1]
    assert (finished["status"], finished["exit_code"], finished["restarts"]) == ("succeeded", 0, 1)
    assert 0 < finished["goodput"] <= 1
    # the second attempt resumed at step 5 and ran to the end on both ranks
    rows = read_audit(audit)
    assert {(s, r) for s, r, _ in rows if s > 5} == {(s, r) for s in range(6, 21) for r in (0, 1)}
    # every line of the log file is a JSON object with the fixed fields
    lines = agent.log_file.read_text().splitlines()
    assert lines
    for line in lines:
        event = json.loads(line)
        assert all(key in event for key in REQUIRED), event
        assert event["job_id"] == "e2e" and event["node"] == "n0"


def test_clean_run_writes_only_json_to_stderr(tmp_path, worker_env, agents):
    argv = ["--nproc-per-node", "1", PROTO, "--steps", "3"]
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(120) == 0
    lines = agent.stderr_file.read_text().splitlines()
    names = set()
    for line in lines:
        event = json.loads(line)
        assert all(key in event for key in REQUIRED), event
        names.add(event["event"])
    assert {
        "supervisor.started",
        "rendezvous.completed",
        "workers.started",
        "job.finished",
    } <= names


def test_crash_loop_exits_after_exactly_the_budget_without_orphans(tmp_path, worker_env, agents):
    children = tmp_path / "children"
    argv = [
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        PROTO,
        "--fail-always",
        "--spawn-child",
        str(children),
    ]
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(150) == 1
    assert len(agent.events("workers.started")) == 3  # first run + exactly 2 restarts
    restarting = agent.events("group.restarting")
    assert [e["restarts_left"] for e in restarting] == [1, 0]
    assert restarting[1]["backoff_s"] > 0  # failing again at once is a crash loop
    finished = agent.events("job.finished")[-1]
    assert (finished["status"], finished["exit_code"], finished["restarts"]) == ("failed", 1, 2)
    # A worker can be killed (its peer failed first) before it spawns its grandchild, so the
    # count per attempt is 1 or 2; what must hold: every attempt left one, none survives.
    rows = [line.split() for line in children.read_text().splitlines()]
    grandchildren = [int(pid) for pid, _ in rows]
    assert {attempt for _, attempt in rows} == {"0", "1", "2"}
    assert 3 <= len(grandchildren) <= 6
    assert descendants_alive(grandchildren) == []
    assert not psutil.pid_exists(agent.proc.pid) or agent.proc.returncode is not None


def test_stopped_worker_is_caught_by_the_watchdog(tmp_path, worker_env, agents):
    snap, audit = tmp_path / "snap", tmp_path / "audit"
    argv = [
        "--nproc-per-node",
        "2",
        "--hang-timeout",
        "3",
        "--snapshot-dir",
        str(snap),
        "--snapshot-every",
        "5",
        PROTO,
        "--steps",
        "40",
        "--step-time",
        "0.05",
        "--audit",
        str(audit),
    ]
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    started = agent.wait_event("workers.started", 60)
    wait_for(lambda: any(s >= 6 for s, _, _ in read_audit(audit)), 60, "steps before the stop")
    victim = started["pids"][1]
    os.kill(victim, signal.SIGSTOP)
    hung = agent.wait_event("worker.hung", 30)
    assert hung["stalled_s"] >= 3
    assert agent.wait(120) == 0
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    assert [e["cause"] for e in agent.events("worker.failed")] == ["hang"]
    assert agent.events("group.restarting")[0]["reason"] == "hang"
    assert max(s for s, _, _ in read_audit(audit)) == 40


def test_unmodified_torchrun_ddp_script_runs_and_restarts(tmp_path, worker_env, agents):
    out = tmp_path / "env.json"
    argv = ["--nproc-per-node", "2", "--max-restarts", "1", PLAIN_DDP, str(out)]
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(150) == 0
    seen = json.loads(out.read_text())
    assert seen["WORLD_SIZE"] == "2" and seen["LOCAL_WORLD_SIZE"] == "2"
    assert seen["TORCHELASTIC_RESTART_COUNT"] == "1" and seen["TORCHELASTIC_MAX_RESTARTS"] == "1"
    assert seen["TORCHELASTIC_RUN_ID"] == "e2e" and seen["MASTER_ADDR"] and seen["MASTER_PORT"]
    assert agent.events("worker.failed")[0]["exit_code"] == 1
    assert agent.events("job.finished")[-1]["restarts"] == 1


def test_every_attempt_of_a_plain_script_exits_cleanly(tmp_path, worker_env, agents):
    # Regression: a plain gloo script's exit raced gloo's threads against interpreter shutdown
    # and died by SIGABRT after training had succeeded (1 run in 4 failed under load). Three
    # attempts, six racing exits: every failure must be the deliberate one, none a signal.
    argv = ["--nproc-per-node", "2", "--max-restarts", "2", EXIT_RACE, "--fail-attempts", "2"]
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(150) == 0, agent.stderr_file.read_text()[-3000:]
    failed = [(e["rank"], e["exit_code"], e["signal"]) for e in agent.events("worker.failed")]
    assert failed == [(1, 3, None), (1, 3, None)]
    assert "terminate called" not in agent.stderr_file.read_text()
    finished = agent.events("job.finished")[-1]
    assert (finished["status"], finished["restarts"]) == ("succeeded", 2)


def test_raw_stderr_of_a_failing_worker_arrives_as_json_events(tmp_path, worker_env, agents):
    argv = ["--max-restarts", "0", PROTO, "--fail-always"]
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(120) == 1
    events = [json.loads(line) for line in agent.stderr_file.read_text().splitlines()]
    raw = [e for e in events if e["event"] == "output.stderr"]
    assert "failing on purpose" in [e["text"] for e in raw]
    assert all(set(REQUIRED) <= e.keys() for e in events)


def test_a_worker_exiting_2_ends_the_job_at_once_with_exit_2(tmp_path, worker_env, agents):
    argv = ["--max-restarts", "3", PROTO, "--fail-always", "--exit-code", "2"]
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(120) == 2
    events = [json.loads(line) for line in agent.stderr_file.read_text().splitlines()]
    names = [e["event"] for e in events]
    assert "group.restarting" not in names and names.count("workers.started") == 1
    (finished,) = [e for e in events if e["event"] == "job.finished"]
    assert finished["status"] == "config_error" and finished["exit_code"] == 2
    assert finished["error"].startswith("worker rank 0 refused its configuration (exit 2)")
