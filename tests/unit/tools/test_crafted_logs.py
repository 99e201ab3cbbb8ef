"""An event log is read from a folder another party may write: ``status`` and ``report``
never crash, print a traceback or pass a terminal escape through, whatever a line holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_trainer.tools.report.cli import main as report
from elastic_trainer.tools.status import main as status

TITLE = "\x1b]0;pwned\x07"  # sets the terminal's title


def _event(**fields: object) -> str:
    base = {"timestamp": "2026-01-01T00:00:00Z", "level": "info", "job_id": "j", "pid": 1}
    return json.dumps({**base, **fields})


CRAFTED = [
    _event(event="supervisor.started", node=f"{TITLE}n0", run_id="r"),
    '{"event": "job.finished", "node": ' + "[" * 100_000 + "]" * 100_000 + "}",  # a crash
    '{"event": "worker.failed", "timestamp": "2026-01-01T00:00:01Z", "round": 1' + "0" * 5000 + "}",
    _event(event="worker.failed", node={"a": 1}),  # a name that is not text
    _event(event="train.progress", node="n0", step=3, loss=float("inf")),
    _event(event="worker.failed", node="n0", error=f"{TITLE}\x1b[2Jboom", cause="error"),
    "x" * (2 << 20),
]


@pytest.mark.parametrize("command", [status, report], ids=["status", "report"])
def test_a_crafted_log_is_read_safely(tmp_path: Path, capsys, command) -> None:
    log = tmp_path / "events-n0.jsonl"
    log.write_text("\n".join(CRAFTED) + "\n")
    argv = [str(log)] if command is status else ["--no-plot", str(log)]
    code = command(argv)
    out, err = capsys.readouterr()
    assert code in (0, 2)
    assert "Traceback" not in err and err.count("\n") <= 1
    assert "\x1b" not in out + err and "\x07" not in out + err
    if command is status:
        assert code == 0 and "\\x1b]0;pwned\\x07n0" in out  # shown, escaped


def test_a_field_of_another_type_is_one_line_not_a_traceback(tmp_path: Path, capsys) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text(
        _event(event="supervisor.started", node="n0", run_id="r")
        + "\n"
        + _event(event="snapshot.saved", node="n0", step="not a number")
        + "\n"
    )
    code = status([str(log)])
    err = capsys.readouterr().err
    assert code in (0, 2) and "Traceback" not in err and err.count("\n") <= 1
