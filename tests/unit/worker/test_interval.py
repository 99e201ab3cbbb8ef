"""``--snapshot-every auto``: Young-Daly from measured figures (worker/interval.py), agreed by
every rank, and the session saving on it."""

from __future__ import annotations

import math
import signal

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs
from torch import nn

from elastic_trainer.contract import protocol
from elastic_trainer.supervisor.cli import args
from elastic_trainer.supervisor.core.ledger import Ledger
from elastic_trainer.worker import interval as I
from elastic_trainer.worker.context import WorkerContext, WorkerSettings
from elastic_trainer.worker.session import TrainingSession


@pytest.fixture(autouse=True)
def _clean():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_young_daly_is_the_square_root_of_twice_cost_times_mtbf_within_bounds():
    # 1 s per snapshot, a failure every 4 h, 0.1 s steps: sqrt(2 * 1 * 14400) s = 169.7 s
    assert I.young_daly_steps(cost_s=1.0, mtbf_s=14_400, step_s=0.1) == round(
        math.sqrt(2 * 14_400) / 0.1
    )
    assert I.young_daly_steps(cost_s=1e-6, mtbf_s=60, step_s=1.0) == I.MIN_EVERY
    assert I.young_daly_steps(cost_s=60.0, mtbf_s=1e9, step_s=0.001) == I.MAX_EVERY


def test_auto_starts_at_the_default_and_moves_only_on_measurements_beyond_the_hysteresis():
    auto = I.Interval.of("auto")
    assert (auto.every, auto.auto, auto.mtbf_s) == (I.FIRST_EVERY, True, I.PRIOR_MTBF_S)
    assert auto.observed(cost_s=None, step_s=0.1).every == I.FIRST_EVERY  # no save measured
    # sqrt(2 * 0.02 * 14400) / 0.1 = 240 steps
    moved = auto.observed(cost_s=0.02, step_s=0.1)
    assert moved.every == 240
    # one slow step barely moves the smoothed step time
    assert moved.observed(cost_s=None, step_s=1.0).step_s == pytest.approx(0.19)
    assert moved.observed(cost_s=0.021, step_s=0.1).every == 240  # within 20 %: kept
    assert I.Interval.of(7).observed(cost_s=5.0, step_s=0.1).every == 7  # fixed: never moves
    assert I.Interval.of(7).due(14, last_saved=10) and not I.Interval.of(7).due(13, 10)
    assert moved.due(250, last_saved=10) and not moved.due(249, last_saved=10)


def test_auto_on_the_command_line_and_in_the_workers_environment():
    assert args.parse(["--snapshot-every", "auto", "x.py"]).worker.snapshot_every == "auto"
    assert (
        args.parse(["x.py"], env={"ELASTIC_TRAIN_SNAPSHOT_EVERY": "auto"}).worker.snapshot_every
        == "auto"
    )
    settings = WorkerSettings(snapshot_every="auto", mtbf_s=120.0)
    assert WorkerSettings.from_env(settings.to_env()) == settings
    with pytest.raises(Exception, match="--snapshot-every"):
        args.parse(["--snapshot-every", "often", "x.py"])


def test_the_supervisor_observes_the_mtbf_from_failures_not_joins():
    ledger = Ledger()
    assert ledger.mtbf_s(100.0) is None
    ledger.failed(cause="node_lost", now=1.0, world_size=2)
    ledger.failed(cause="error", now=1.5, world_size=2)  # the same cascade
    assert ledger.mtbf_s(100.0) == 100.0


def test_a_session_on_auto_saves_at_the_interval_its_measurements_give(tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # failures all the time: the interval falls to its minimum after the first snapshot
    settings = WorkerSettings(control_dir=str(control), snapshot_every="auto", mtbf_s=1e-9)
    x = torch.randn(4, 3)
    with capture_logs() as logs:
        session = TrainingSession(
            {"model": model, "optimizer": optimizer},
            context=WorkerContext(settings=settings),
            snapshot_dir=str(tmp_path / "snapshots"),
            configure_logs=False,
        )
        for _ in range(I.FIRST_EVERY + 2 * I.MIN_EVERY + 1):
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            session.step_done()
        session.close()
    saved = [e["step"] for e in logs if e["event"] == "snapshot.saved"]
    assert saved[:3] == [I.FIRST_EVERY, I.FIRST_EVERY + I.MIN_EVERY, I.FIRST_EVERY + 20]
    (chosen,) = [e for e in logs if e["event"] == "snapshot.interval"]
    assert chosen["every"] == I.MIN_EVERY and chosen["step"] == I.FIRST_EVERY
    assert chosen["tier"] == "storage"
    assert protocol.snapshot_interval("AUTO") == "auto"


def test_the_sharded_tiers_copies_keep_within_their_budget_of_the_step_time():
    # a copy that stalls 30 ms, steps of 100 ms: within 2 % means one copy per 15 steps
    assert I.budget_steps(cost_s=0.03, step_s=0.1) == 15
    assert I.budget_steps(cost_s=0.0001, step_s=0.1) == 1  # cheap: every step
    assert I.budget_steps(cost_s=100.0, step_s=0.001) == I.MAX_MEMORY_EVERY
    memory = I.Interval.memory()
    assert (memory.every, memory.auto) == (1, True)
    chosen = memory.observed(cost_s=0.03, step_s=0.1)
    assert chosen.every == 15
    # what the copies then cost: one 30 ms stall per 15 steps of 100 ms
    assert 0.03 / (chosen.every * 0.1) <= I.MEMORY_BUDGET
    assert protocol.memory_interval("auto") == "auto" and protocol.memory_interval("0") == 0
    assert (
        args.parse(["--memory-snapshot-every", "auto", "x.py"]).worker.memory_snapshot_every
        == "auto"
    )
