"""A plain script (no progress reports, no checkpoints) SIGKILLed once redoes everything it
did: the supervisor and ``elastic-train report`` say the loss is unknown, with the bound the
supervisor knows (the attempt's run time and the restart), never "0.0 s lost"."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.workers.harness import HERE, env_with, free_port, start_agent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PLAIN = str(HERE / "plain_killed_once.py")
STEPS, STEP_TIME, DIE_AT = 30, 0.1, 15  # the first attempt runs ~1.5 s, then is redone


def test_a_plain_script_killed_once_lost_an_unknown_amount_with_a_bound(
    tmp_path, worker_env, agents
) -> None:
    argv = ["--nproc-per-node", "1", "--max-restarts", "1", PLAIN, "--steps", str(STEPS),
            "--step-time", str(STEP_TIME), "--die-at", str(DIE_AT),
            "--marker", str(tmp_path / "died")]  # fmt: skip
    agent = start_agent(tmp_path, "n0", argv, env_with(worker_env), port=free_port())
    agents.append(agent)
    assert agent.wait(150) == 0, agent.stderr_file.read_text()[-3000:]
    assert [e["signal"] for e in agent.events("worker.failed")] == ["SIGKILL"]

    assert not agent.events("recovery.completed")  # nothing says when the first step was
    (restart,) = agent.events("recovery.unmeasured")
    assert restart["cause"] == "signal"
    assert restart["steps_lost"] is None and restart["time_lost_s"] is None  # not 0
    assert restart["ran_s"] >= DIE_AT * STEP_TIME  # the work that was redone fits the bound
    assert restart["time_lost_max_s"] >= restart["ran_s"] + restart["restart_s"] - 0.002

    finished = agent.events("job.finished")[-1]
    assert finished["status"] == "succeeded" and finished["restarts"] == 1
    assert finished["goodput"] is None and finished["goodput_estimated"] is True
    assert finished["steps_lost"] is None and finished["time_lost_s"] is None
    assert finished["time_lost_max_s"] == pytest.approx(restart["time_lost_max_s"])
    assert 0 < finished["goodput_max"] <= 1  # the workers' running share: only a bound

    report = subprocess.run(
        [sys.executable, "-m", "elastic_trainer", "report", str(agent.log_file), "--no-plot"],
        env=env_with(worker_env), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    bound = f"at most {restart['time_lost_max_s']:.1f} s: the attempt ran {restart['ran_s']:.1f} s"
    assert f"time lost:   unknown ({bound} before the failure" in report.stdout, report.stdout
    assert "steps redone unknown" in report.stdout
    assert "status:      succeeded" in report.stdout
    assert f"goodput:     unknown, at most {100 * finished['goodput_max']:.1f}%" in report.stdout
