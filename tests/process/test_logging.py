"""Every log line is one JSON object with the fields ops teams parse; secrets never leak."""

from __future__ import annotations

import io
import json
import logging
import re
import sys

import pytest
import structlog

from elastic_trainer.logging import STDERR, configure_logging, redact, render_console_line

REQUIRED = {"timestamp", "level", "event", "job_id", "node", "pid"}


@pytest.fixture
def json_log(tmp_path):
    import torch  # noqa: F401  # what every worker has: torch detaches its loggers on import

    path = tmp_path / "events.jsonl"
    configure_logging(fmt="json", log_file=str(path), static_fields={"job_id": "job-7"})
    yield path
    logging.getLogger().handlers.clear()


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_structlog_and_stdlib_records_share_one_json_schema(json_log) -> None:
    structlog.get_logger("elastic_trainer").info("supervisor.started", min_nodes=1)
    logging.getLogger("torch.distributed.elastic.agent").warning("rendezvous %s", "slow")
    ours, torch_line = _lines(json_log)
    assert REQUIRED <= ours.keys() and REQUIRED <= torch_line.keys()
    assert ours["job_id"] == torch_line["job_id"] == "job-7"
    assert torch_line["event"] == "log.record" and torch_line["message"] == "rendezvous slow"
    assert torch_line["logger"] == "torch.distributed.elastic.agent"
    assert ours["timestamp"].endswith("Z")


def test_a_foreign_records_text_is_its_message_never_its_event_name(json_log) -> None:
    """Regression: torch's "failed (exitcode: 1) local_rank: 0 (pid: 13186) of binary: ..."
    arrived as the ``event`` itself; dashboards switch on ``event``."""
    from elastic_trainer.contract.events import CATALOGUE

    text = "failed (exitcode: 1) local_rank: 0 (pid: 13186) of binary: /usr/bin/python"
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").error(text)
    logging.getLogger().warning("the script's own %s", "line")
    logging.getLogger("elastic_trainer.supervisor").warning("supervisor.started")
    torch_line, script_line, ours = _lines(json_log)
    assert set(CATALOGUE["log.record"]) <= torch_line.keys()
    assert (torch_line["event"], torch_line["message"], torch_line["level"]) == (
        "log.record",
        text,
        "error",
    )
    assert torch_line["logger"] == "torch.distributed.elastic.multiprocessing.api"
    assert (script_line["event"], script_line["logger"]) == ("log.record", "root")
    assert script_line["message"] == "the script's own line"
    assert ours["event"] == "supervisor.started" and "logger" not in ours


def test_credentials_in_urls_are_redacted_in_events(json_log) -> None:
    structlog.get_logger("snapshots").info(
        "snapshot.saved", url="s3://AKIAXX:hunter2@bucket/run?X-Amz-Signature=deadbeef&part=1"
    )
    (line,) = _lines(json_log)
    assert "hunter2" not in json.dumps(line) and "deadbeef" not in json.dumps(line)
    assert line["url"].startswith("s3://***@bucket/run?X-Amz-Signature=***")
    assert "part=1" in line["url"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://u:p@h/x", "https://***@h/x"),
        ("gs://bucket/path/step-1", "gs://bucket/path/step-1"),
        ("https://h/x?sig=abc&token=def&n=1", "https://h/x?sig=***&token=***&n=1"),
        ("/local/path/without/url", "/local/path/without/url"),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_reconfiguring_does_not_duplicate_lines(tmp_path) -> None:
    path = tmp_path / "log.jsonl"
    for _ in range(3):
        configure_logging(fmt="json", log_file=str(path), static_fields={"job_id": "j"})
    structlog.get_logger("elastic_trainer").info("job.finished")
    assert len(path.read_text().splitlines()) == 1
    logging.getLogger().handlers.clear()


def test_events_from_background_threads_carry_the_static_fields(json_log) -> None:
    """The snapshot writer logs from its own thread: ops must still see which node saved."""
    import threading

    from elastic_trainer.contract.events import emit

    def write() -> None:
        emit("snapshot.pruned", steps=[1], url="/x")

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    (line,) = _lines(json_log)
    assert REQUIRED <= line.keys()
    assert line["job_id"] == "job-7"


def test_every_catalogued_event_gets_the_common_fields(json_log) -> None:
    from elastic_trainer.contract.events import CATALOGUE, emit

    emitted = [name for name in CATALOGUE if name != "log.record"]  # logging writes that one
    for name in emitted:
        emit(name, **dict.fromkeys(CATALOGUE[name]))
    lines = _lines(json_log)
    assert [line["event"] for line in lines] == emitted
    assert all(REQUIRED <= line.keys() for line in lines)


class FakeTerminal(io.StringIO):
    """What a terminal is to a handler or tqdm: a stream that says it is one."""

    def isatty(self) -> bool:
        return True


def screen(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw``: ``\\r`` back to the line's start, ``ESC[K``
    erases to its end, colours dropped."""
    shown = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", raw).split("\n"):
        cells: list[str] = []
        col = 0
        for token in re.split(r"(\r|\x1b\[K)", line):
            if token == "\r":
                col = 0
            elif token == "\x1b[K":
                del cells[col:]
            else:
                cells[col : col + len(token)] = token
                col += len(token)
        shown.append("".join(cells).rstrip())
    return shown


@pytest.fixture
def console_log(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    configure_logging(fmt="console", static_fields={"job_id": "job-7"})
    yield terminal
    logging.getLogger().handlers.clear()
    STDERR.owner, STDERR.unfinished, STDERR.hide = None, "", None


def test_a_log_line_goes_above_an_unfinished_progress_bar_not_onto_it(console_log) -> None:
    """Regression: ``...?step/s]2026-11-24T21:00:13 ... worker.resources`` on one line."""
    bar = "\r[rank0]: 50%|#####     | 6/12 [00:00<?, ?step/s]"
    console_log.write(bar)
    STDERR.owner, STDERR.unfinished = object(), bar  # what a relay records for its bar
    structlog.get_logger("elastic_trainer").info("membership.changed", world_size=2)
    shown = screen(console_log.getvalue())
    assert "membership.changed" in shown[0] and "step/s" not in shown[0]
    assert shown[1] == bar.lstrip("\r")  # drawn again below the line


def test_console_keeps_resource_samples_off_and_shows_each_epochs_accuracy(
    console_log, tmp_path
) -> None:
    log = structlog.get_logger("elastic_trainer")
    log.info("worker.resources", rank=0, rss_bytes=1, cpu_percent=2.0, num_procs=1)
    log.info("train.evaluated", step=12, epoch=2, val_loss=0.41, val_accuracy=0.87, val_samples=9)
    (line,) = [line for line in screen(console_log.getvalue()) if line]
    assert "worker.resources" not in line and "{" not in line
    assert line.endswith("epoch 2: val_accuracy 87.0 %, val_loss 0.41")


def test_a_json_event_line_renders_as_the_console_shows_it() -> None:
    event = {"event": "train.evaluated", "epoch": 1, "val_accuracy": 0.5, "val_loss": 1.0,
             "level": "info", "timestamp": "2026-11-24T21:00:13Z"}  # fmt: skip
    rendered = screen(render_console_line(json.dumps(event)) or "")[0]
    assert rendered.startswith("2026-11-24T21:00:13Z [info") and "{" not in rendered
    assert "epoch 1: val_accuracy 50.0 %, val_loss 1" in rendered
    assert render_console_line(json.dumps({"event": "worker.resources", "rank": 0})) == ""
    assert render_console_line("Traceback (most recent call last):") is None
    assert render_console_line('{"not": "an event"}') is None
