"""A torch outside the tested range is said once at the start (GPU images carry their own)."""

from __future__ import annotations

import torch
from structlog.testing import capture_logs

from elastic_trainer.supervisor import run


def test_an_untested_torch_is_one_warning_naming_the_range(monkeypatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with capture_logs() as logs:
        run.warn_untested_torch()
    warnings = [e["warning"] for e in logs if e["event"] == "preflight.warning"]
    assert len(warnings) == 1 and warnings[0].startswith("torch 2.11.0+cu130 is outside")


def test_a_tested_torch_says_nothing(monkeypatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.14.1+cpu")
    with capture_logs() as logs:
        run.warn_untested_torch()
    assert logs == []
