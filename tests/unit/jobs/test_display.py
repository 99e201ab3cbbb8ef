"""The built-in job's progress bar on a fake_stderr: log lines go above it, never onto it."""

from __future__ import annotations

import logging
import sys

import pytest
import structlog

from elastic_trainer.jobs.display import Progress
from elastic_trainer.logging import STDERR, configure_logging
from tests.process.test_logging import FakeTerminal, screen


@pytest.fixture
def fake_stderr(monkeypatch):
    """stderr a terminal; set in the test itself, as pytest sets its own for each phase."""
    fake = FakeTerminal()
    yield lambda: monkeypatch.setattr(sys, "stderr", fake) or fake
    logging.getLogger().handlers.clear()
    STDERR.hide = None


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_each_event_is_a_line_of_its_own_between_bar_updates(fake_stderr, fmt) -> None:
    terminal = fake_stderr()
    configure_logging(fmt=fmt)
    progress = Progress(enabled=True, total_steps=4, start_step=0, every_s=3600.0)
    log = structlog.get_logger("elastic_trainer")
    for step in (1, 2):
        progress.step(step=step, epoch=0, loss=1.0, lr=0.1, samples=8)
        log.info("snapshot.saved", step=step)
    progress.step(step=3, epoch=1, loss=1.0, lr=0.1, samples=8)
    log.info("train.evaluated", step=3, epoch=1, val_loss=0.5, val_accuracy=0.25, val_samples=8)
    progress.close()
    shown = [line for line in screen(terminal.getvalue()) if line]
    events = [line for line in shown if "step/s" not in line]
    assert len(events) == 3, shown  # each on a line of its own, none glued to the bar
    assert all("%|" not in line for line in events)
    assert "step/s" in shown[-1]  # the bar, last, redrawn below the lines
    if fmt == "console":
        assert events[-1].endswith("epoch 1: val_accuracy 25.0 %, val_loss 0.5")
