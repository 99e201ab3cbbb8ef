"""The workers' side of the metrics: forwarded events, the tail that reads them, and a
script's own figures (``TrainingSession.log_metrics``) in ``train.progress``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from elastic_trainer.contract import protocol
from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ConfigError
from elastic_trainer.logging import configure_logging
from elastic_trainer.supervisor.processes.tail import WorkerEventTail
from elastic_trainer.worker.context import WorkerContext, WorkerSettings
from elastic_trainer.worker.progress import EventForwarder, MetricsReporter, figures_of
from elastic_trainer.worker.session import TrainingSession


@pytest.fixture(autouse=True)
def _clean():
    yield
    EventForwarder.install(None, 0)  # removes the test's forwarder
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_worker_forwards_only_the_events_the_metrics_follow(tmp_path) -> None:
    configure_logging(fmt="json", log_file=str(tmp_path / "log.jsonl"))
    EventForwarder.install(str(tmp_path), 1)
    emit("snapshot.saved", step=5, epoch=0, url="file:///s", bytes=1, stall_ms=2.0, write_ms=3.0)
    emit("session.stopping", step=5, reason="preempted", signal=None)
    lines = (tmp_path / protocol.events_file(1)).read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["snapshot.saved"]
    assert json.loads(lines[0])["stall_ms"] == 2.0 and "timestamp" in json.loads(lines[0])


def test_installing_again_replaces_the_forwarder_and_a_gone_folder_is_ignored(tmp_path) -> None:
    configure_logging(fmt="json", log_file=str(tmp_path / "log.jsonl"))
    EventForwarder.install(str(tmp_path / "gone"), 0)
    second = EventForwarder.install(str(tmp_path), 0)
    emit("snapshot.restored", step=1, saved_world_size=1, world_size=1, source="storage")
    assert second is not None
    assert len((tmp_path / protocol.events_file(0)).read_text().splitlines()) == 1


def test_the_tail_reads_each_complete_line_once(tmp_path) -> None:
    tail = WorkerEventTail(str(tmp_path), range(2))
    assert tail.read() == []
    path = tmp_path / protocol.events_file(1)
    path.write_bytes(b'{"event": "snapshot.saved", "step": 1}\nnot json\n{"event": "train.pro')
    assert tail.read() == [{"event": "snapshot.saved", "step": 1}]
    with open(path, "ab") as handle:
        handle.write(b'gress", "step": 2}\n')
    assert tail.read() == [{"event": "train.progress", "step": 2}]
    assert tail.read() == []


# ---- log_metrics -----------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reports_are_rate_limited_and_carry_rates_once_two_are_known() -> None:
    clock = Clock()
    reporter = MetricsReporter(every_s=10.0, clock=clock)
    first = reporter.report({"loss": 2.0}, step=10, epoch=0, max_steps=110, samples_per_step=8)
    assert first == {
        "loss": 2.0,
        "lr": None,
        "step": 10,
        "epoch": 0,
        "samples_per_s": None,
        "eta_s": None,
    }
    clock.now = 105.0
    assert reporter.report({"loss": 1.9}, step=15, epoch=0) is None
    clock.now = 120.0
    second = reporter.report(
        {"loss": 1.5, "acc": 0.5}, step=30, epoch=1, max_steps=110, samples_per_step=8
    )
    assert second is not None
    assert second["samples_per_s"] == 8.0 and second["eta_s"] == 80.0 and second["acc"] == 0.5


def test_figures_are_numbers_and_tensors_and_never_the_sessions_fields() -> None:
    assert figures_of({"loss": torch.tensor(0.25), "lr": 1e-3, "tokens": 7}) == {
        "loss": 0.25,
        "lr": 0.001,
        "tokens": 7.0,
    }
    with pytest.raises(ValueError, match=r"log_metrics\(step=...\): 'step' is set by the session"):
        figures_of({"step": 3})
    with pytest.raises(ValueError, match=r"log_metrics\(loss='x'\): not a number"):
        figures_of({"loss": "x"})


def _session(tmp_path) -> TrainingSession:
    model = torch.nn.Linear(2, 1)
    return TrainingSession(
        {"model": model},
        context=WorkerContext(settings=WorkerSettings(control_dir=str(tmp_path))),
        configure_logs=False,
    )


def test_log_metrics_puts_the_scripts_loss_into_train_progress(tmp_path) -> None:
    session = _session(tmp_path)
    with capture_logs() as logs:
        session.log_metrics(loss=torch.tensor(0.75), grad_norm=3.0)
        session.log_metrics(loss=0.7)  # within METRICS_EVERY_S: rate-limited
    progress = [e for e in logs if e["event"] == "train.progress"]
    assert len(progress) == 1
    assert progress[0]["loss"] == 0.75 and progress[0]["grad_norm"] == 3.0
    assert progress[0]["step"] == 0 and progress[0]["lr"] is None
    with pytest.raises(ConfigError, match="not a number"):
        session.log_metrics(loss=None)
    session.close()


class _EveryCall(TrainingSession):
    METRICS_EVERY_S = 0.0


def test_the_report_plots_a_user_scripts_logged_loss(tmp_path) -> None:
    from elastic_trainer.tools.report import plot
    from elastic_trainer.tools.report.events import load_event_log

    log = tmp_path / "events.jsonl"
    configure_logging(fmt="json", log_file=str(log))
    session = _EveryCall(
        {"model": torch.nn.Linear(2, 1)},
        context=WorkerContext(settings=WorkerSettings()),
        configure_logs=False,
    )
    for step, loss in enumerate([1.0, 0.5, 0.25], start=1):
        session.step = step
        session.log_metrics(loss=loss)
    session.close()
    events = load_event_log(str(log)).events
    _, losses = plot._series(events, "train.progress", "loss")
    assert losses == [1.0, 0.5, 0.25]
    plot.draw_report(events, str(tmp_path / "run.png"), title="user script")
    assert (tmp_path / "run.png").stat().st_size > 0
