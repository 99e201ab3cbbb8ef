"""worker.failed's error_summary and job.finished's error: one line, the exception's, for any
Python worker (not only scripts under torch's @record), never a dict with a callstack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from torch.distributed.elastic.multiprocessing import ProcessFailure, Std

from elastic_trainer.supervisor.processes.console import (
    NOWHERE,
    JsonLines,
    Prefixer,
    Relay,
    RelayedLogsSpecs,
)
from elastic_trainer.supervisor.processes.tail import (
    TAIL_LINES,
    StderrTail,
    exception_line,
    message_line,
    read_file_tail,
)


def _stderr_of(script: str) -> list[str]:
    """What a Python worker that dies of ``script`` leaves on its stderr: a real traceback."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True
    )
    assert done.returncode != 0
    return done.stderr.splitlines()


def test_a_traceback_gives_its_exception_line() -> None:
    lines = _stderr_of("""
        def load():
            raise ImportError("Using the Trainer with PyTorch requires accelerate>=1.1.0")
        print("loading")
        load()
    """)
    expected = "ImportError: Using the Trainer with PyTorch requires accelerate>=1.1.0"
    assert exception_line(lines) == expected


@pytest.mark.parametrize(
    ("link", "expected"),
    [
        ("raise ValueError('bad shape') from exc", "ValueError: bad shape"),  # direct cause
        ("int('x')", "ValueError: invalid literal for int() with base 10: 'x'"),  # in handling
    ],
)
def test_a_chained_traceback_gives_the_exception_that_ended_the_process(
    link: str, expected: str
) -> None:
    lines = _stderr_of(f"""
        try:
            {{}}["missing"]
        except KeyError as exc:
            {link}
    """)
    assert exception_line(lines) == expected
    assert any(line.startswith("KeyError") for line in lines)  # the first one is there too


def test_a_multi_line_message_gives_its_first_line_not_its_last() -> None:
    lines = _stderr_of("raise RuntimeError('CUDA error: device-side assert\\nCompile with ...')")
    assert exception_line(lines) == "RuntimeError: CUDA error: device-side assert"


def test_lines_after_the_traceback_and_torchs_rank_prefix_do_not_hide_it() -> None:
    lines = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/job/train.py", line 9, in <module>',
        "[rank0]:     step()",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "W1122 12:00:01.000 torch/multiprocessing: process group destroyed",
    ]
    assert exception_line(lines) == (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )


def test_a_syntax_error_without_a_traceback_header_is_found_by_its_name() -> None:
    lines = _stderr_of("def broken(:\n    pass")
    assert exception_line(lines) == "SyntaxError: invalid syntax"


@pytest.mark.parametrize(
    "lines",
    [
        [],
        ["epoch 1 loss 0.3", "Killed"],
        ["an Error: in the middle of a sentence is no exception"],
        ["ErrorHandler started"],
    ],
)
def test_no_exception_no_summary(lines: list[str]) -> None:
    assert exception_line(lines) is None


def test_a_bare_exception_name_is_a_summary() -> None:
    assert exception_line(["working", "KeyboardInterrupt"]) == "KeyboardInterrupt"


def _record_message(tmp_path, monkeypatch) -> object:
    """torch's ProcessFailure.message for a worker that recorded a ConfigError (@record)."""
    from elastic_trainer.errors import ConfigError
    from elastic_trainer.worker.failure import record_error

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ConfigError("--lr=-1 must be positive:\npass --lr 0.001")
    except ConfigError as exc:
        record_error(exc)
    return ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path)).message


def test_an_error_file_message_is_its_message_line_in_every_shape(tmp_path, monkeypatch) -> None:
    message = _record_message(tmp_path, monkeypatch)
    assert isinstance(message, dict) and "py_callstack" in message["extraInfo"]
    line = "ConfigError: --lr=-1 must be positive:"
    assert message_line(message) == line
    assert message_line(str(message)) == line  # the repr that reached job.finished before
    assert message_line(json.dumps(message)) == line
    assert message_line("ValueError: plain\nmore") == "ValueError: plain"
    assert message_line("{not a dict") == "{not a dict"
    assert message_line({"extraInfo": {}}) is None


def test_the_tail_keeps_the_last_lines_across_reads_and_redraws() -> None:
    tail = StderrTail(max_lines=3)
    tail.feed(b"one\ntw")
    tail.feed(b"o\r 10%\r 20%\n\nthree\nunfin")
    assert tail.lines() == [" 10%", " 20%", "three", "unfin"]  # and the unfinished one
    assert len(StderrTail().lines()) == 0 and TAIL_LINES >= 32


def test_a_relay_gives_its_tail_once_what_the_worker_wrote_is_read() -> None:
    """No wait for the relay thread in the test: ``lines`` itself waits until the pipe is
    empty, as the agent needs right after a worker died."""
    relay = Relay(NOWHERE, Prefixer(b"[rank0]:"), tail=StderrTail())
    worker = os.open(relay.path, os.O_WRONLY)
    traceback = b"Traceback (most recent call last):\n  File x\nValueError: boom\n"
    for _ in range(200):
        os.write(worker, b"noise " * 100 + b"\n")
    os.write(worker, traceback)
    try:
        assert exception_line(relay.lines(timeout_s=10)) == "ValueError: boom"
    finally:
        os.close(worker)
        relay.close(0)


def _envs(n: int) -> dict[int, dict[str, str]]:
    return {i: {"RANK": str(i), "TORCHELASTIC_RUN_ID": "t"} for i in range(n)}


def _write_as_worker(path: str, text: str) -> None:
    with open(path, "w") as stream:
        stream.write(text)


@pytest.mark.parametrize("json_mode", [False, True], ids=["console", "json"])
def test_every_ranks_stderr_has_a_tail_on_the_console_filtered_or_in_a_file(
    tmp_path, json_mode: bool
) -> None:
    err_r, err_w = os.pipe()
    specs = RelayedLogsSpecs(
        template=None, consoles={"stdout": err_w, "stderr": err_w}, log_dir=str(tmp_path),
        json_fields={"node": "n"} if json_mode else None,
        redirects={2: Std.ERR}, local_ranks_filter={0, 2},
    )  # fmt: skip
    dest = specs.reify(_envs(3))
    for local_rank in range(3):
        _write_as_worker(dest.stderrs[local_rank], f"ValueError: rank {local_rank}\n")
    try:
        for local_rank in range(3):
            lines = specs.stderr_tail(local_rank)
            assert exception_line(lines) == f"ValueError: rank {local_rank}"
        assert specs.stderr_tail(7) == []
    finally:
        specs.close()
    os.set_blocking(err_r, False)
    shown = os.read(err_r, 65536)
    assert b"rank 0" in shown and b"rank 1" not in shown  # rank 1 is filtered off the console


def test_read_file_tail_reads_the_end_of_a_long_file(tmp_path) -> None:
    path = tmp_path / "stderr.log"
    path.write_text("x\n" * 100_000 + "OSError: disk full\n")
    assert read_file_tail(str(path))[-1] == "OSError: disk full"
    assert read_file_tail(str(tmp_path / "missing")) == []


def test_json_mode_tail_keeps_the_workers_text_not_the_events() -> None:
    relay = Relay(NOWHERE, JsonLines({"rank": 0}), tail=StderrTail())
    worker = os.open(relay.path, os.O_WRONLY)
    os.write(worker, b"ValueError: raw\n")
    try:
        assert relay.lines(timeout_s=10) == ["ValueError: raw"]
    finally:
        os.close(worker)
        relay.close(0)
