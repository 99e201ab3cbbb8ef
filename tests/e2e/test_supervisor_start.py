"""Start-up against every kind of rendezvous endpoint, and stop signals during start-up.

A store that is not up yet is transient (wait, one warning, exit 1 only after the join
timeout); a name that does not resolve or a port that is not a c10d store is bad input (one
line, exit 2, bounded); SIGTERM always ends the supervisor with 143, whatever it waits on.
"""

from __future__ import annotations

import signal

import pytest

from tests.e2e.workers.harness import (
    FAST_RDZV,
    env_with,
    free_port,
    not_a_store,
    sigcaught,
    start_agent,
    start_store,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

NOT_HOST = FAST_RDZV + ",is_host=false"
# "did not hang" bounds, far above what is measured (a handshake 5 s; a silent listener is
# tried again for 10 s: 20-27 s in all)
BOUNDED_S = 60


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "ok.py"
    path.write_text("print('trained')\n")
    return str(path)


@pytest.fixture
def silent_listener():
    with not_a_store("silent") as held:
        yield held


def _error_lines(agent) -> list[str]:
    """The one-line reason: printed before the supervisor runs, else (JSON mode, where every
    stderr line is JSON) job.finished's error field."""
    raw = [
        line
        for line in agent.stderr_file.read_text().splitlines()
        if line.startswith("elastic-train: error:")
    ]
    finished = [e["error"] for e in agent.events("job.finished") if e.get("error")]
    return raw + [f"elastic-train: error: {error}" for error in finished]


def _start(tmp_path, worker_env, port, script, *, conf=NOT_HOST, host=None):
    # a later --rdzv-endpoint overrides the harness's 127.0.0.1 one
    argv = ["--rdzv-endpoint", f"{host}:{port}", script] if host else [script]
    return start_agent(tmp_path, "n0", argv, env_with(worker_env), port=port, rdzv_conf=conf)


@pytest.mark.parametrize(
    ("kind", "conf"),
    [("http", NOT_HOST), ("http", FAST_RDZV), ("silent", NOT_HOST)],
    ids=["http-client", "http-inferred-host", "silent-listener"],
)
def test_a_port_that_is_not_a_store_is_one_line_and_exit_2_within_a_bound(
    tmp_path, worker_env, agents, script, kind, conf
):
    with not_a_store(kind) as (port, _):
        agent = _start(tmp_path, worker_env, port, script, conf=conf)
        agents.append(agent)
        assert agent.wait(BOUNDED_S) == 2
    [line] = _error_lines(agent)
    assert f"127.0.0.1:{port}" in line and "not a c10d store" in line


def test_sigterm_during_a_blocked_store_connect_exits_143(
    tmp_path, worker_env, agents, script, silent_listener
):
    port, accepted = silent_listener
    agent = _start(tmp_path, worker_env, port, script)
    agents.append(agent)
    wait_for(lambda: len(accepted) >= 2, 60, "the c10d handshake to be under way", step=0.01)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(BOUNDED_S) == 143


def test_sigterm_right_after_start_exits_143_before_anything_starts(
    tmp_path, worker_env, agents, script
):
    agent = _start(tmp_path, worker_env, free_port(), script, conf=FAST_RDZV)
    agents.append(agent)
    wait_for(lambda: sigcaught(agent.proc.pid, signal.SIGTERM), 60, "a SIGTERM handler", 0.001)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(BOUNDED_S) == 143
    # the handler was in place before the supervisor got going (logging, checks, torch)
    assert not agent.events("supervisor.started")


def test_a_name_that_cannot_resolve_exits_2_at_once(tmp_path, worker_env, agents, script):
    agent = _start(tmp_path, worker_env, free_port(), script, host="no-such-store.invalid")
    agents.append(agent)
    assert agent.wait(BOUNDED_S) == 2
    [line] = _error_lines(agent)
    assert "no-such-store.invalid" in line and "does not resolve" in line
    assert not agent.events("supervisor.started")


def test_a_refused_port_is_waited_for_then_exit_1_with_one_warning(
    tmp_path, worker_env, agents, script
):
    conf = NOT_HOST.replace("join_timeout=90", "join_timeout=8")
    agent = _start(tmp_path, worker_env, free_port(), script, conf=conf)
    agents.append(agent)
    assert agent.wait(BOUNDED_S + 8) == 1
    [warning] = agent.events("store.unreachable")
    assert (warning["level"], warning["retrying"], warning["deadline_s"]) == ("warning", True, 8)
    assert agent.events("job.finished")[-1]["status"] == "rendezvous_timeout"
    [line] = _error_lines(agent)
    assert "no store answered within 8s" in line


def test_a_store_started_late_is_waited_for_and_the_group_forms(
    tmp_path, worker_env, agents, script
):
    port = free_port()
    agent = _start(tmp_path, worker_env, port, script)
    agents.append(agent)
    agent.wait_event("store.unreachable", 60)
    store = start_store(port, env_with(worker_env))
    try:
        assert agent.wait(90) == 0
    finally:
        store.kill()
        store.wait()
    assert len(agent.events("store.unreachable")) == 1
    assert agent.events("workers.started")
