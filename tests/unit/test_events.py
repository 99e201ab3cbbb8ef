"""The event catalogue is an API: emit() refuses unknown names, the README documents all."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from elastic_trainer import events

README = Path(__file__).resolve().parents[2] / "README.md"


def test_emit_logs_a_catalogued_event_with_its_fields() -> None:
    with capture_logs() as logs:
        events.emit(
            "group.restarting", reason="error", restart_count=1, restarts_left=2, backoff_s=0.0
        )
    assert logs == [
        {
            "event": "group.restarting",
            "log_level": "info",
            "reason": "error",
            "restart_count": 1,
            "restarts_left": 2,
            "backoff_s": 0.0,
        }
    ]


def test_emit_refuses_names_outside_the_catalogue() -> None:
    with pytest.raises(KeyError, match=r"not in elastic_trainer\.events\.CATALOGUE"):
        events.emit("supervisor.startd")


def test_names_are_dotted_lowercase() -> None:
    for name in events.CATALOGUE:
        assert re.fullmatch(r"[a-z_]+\.[a-z_]+", name), name


def test_readme_documents_every_event() -> None:
    text = README.read_text()
    missing = [name for name in events.CATALOGUE if f"`{name}`" not in text]
    assert not missing, f"README.md event table lacks: {missing}"
