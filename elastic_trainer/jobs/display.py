"""Progress people can follow: a tqdm bar on a terminal, ``train.progress`` events otherwise.

Only rank 0 reports. On a terminal the bar replaces the progress events *on the terminal*;
a ``--log-file`` still receives them, so ``elastic-train report`` can draw the loss curve.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from elastic_trainer.contract.events import emit
from elastic_trainer.jobs.recipe import ProgressMeter
from elastic_trainer.logging import STDERR

PROGRESS_EVENT = "train.progress"


class _DropProgressEvents(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        return not (isinstance(msg, dict) and msg.get("event") == PROGRESS_EVENT)


def _hide_progress_events_on_terminal() -> None:
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if stream is not None and getattr(stream, "isatty", lambda: False)():
            handler.addFilter(_DropProgressEvents())


def _tqdm_or_none() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # no bar without tqdm: the progress events still reach the terminal
        return None
    return tqdm


class Progress:
    """Rank 0's progress display; a no-op on other ranks."""

    def __init__(
        self,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        every_s: float,
        stream: Any = None,
    ) -> None:
        stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.meter = ProgressMeter(total_steps=total_steps, every_s=every_s)
        self.meter.start(start_step)
        self.bar = None
        tqdm = _tqdm_or_none()
        if enabled and tqdm is not None and getattr(stream, "isatty", lambda: False)():
            _hide_progress_events_on_terminal()
            self.bar = tqdm(
                total=total_steps, initial=start_step, unit="step", file=stream, dynamic_ncols=True
            )
            if stream is sys.stderr:
                # A log line erases the bar and is written above it, the bar redrawn below
                # (tqdm.write's way), instead of landing on the end of the unfinished bar.
                STDERR.hide = lambda: tqdm.external_write_mode(file=stream)

    def step(
        self, *, step: int, epoch: int, loss: float, lr: float, samples: int, force: bool = False
    ) -> None:
        if not self.enabled:
            return
        # Progress events go to the log file even under a bar; the bar updates every step.
        report = self.meter.update(
            step=step, epoch=epoch, loss=loss, lr=lr, samples=samples, force=force
        )
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", lr=f"{lr:.4g}", refresh=False)
            if report is not None and report["samples_per_s"] is not None:
                self.bar.set_postfix(
                    epoch=epoch,
                    loss=f"{loss:.4f}",
                    lr=f"{lr:.4g}",
                    samples_s=f"{report['samples_per_s']:.0f}",
                )
        if report is not None:
            emit(PROGRESS_EVENT, **report)

    def close(self) -> None:
        if self.bar is not None:
            STDERR.hide = None
            self.bar.close()
