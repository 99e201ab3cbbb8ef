"""The tails of what workers write: their event files, and their stderr's last lines.

``WorkerEventTail`` reads the new, complete lines of the workers' event files
(``protocol.events_file``). Each tick the observer asks for what was appended since the last
tick. Only lines ended by a newline count: a line a worker is still writing (or died writing)
is left for later, so nothing is read twice or half. Lines that are not JSON objects are
skipped.

``StderrTail`` keeps the last lines of a worker's stderr (fed by the console relay, or read
back from torch's ``stderr.log`` with ``--redirects``/``--tee``), and ``exception_line`` finds
in them the line an operator needs from a traceback: ``ImportError: ... requires
accelerate>=1.1.0``. torch's error file has it only for scripts under ``@record``; every
Python worker that dies of an exception prints its traceback to stderr.
"""

from __future__ import annotations

import ast
import collections
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from elastic_trainer.contract import protocol

_MAX_READ = 1 << 20  # per file and tick: a flood must not stall the monitor loop
TAIL_LINES = 64  # a traceback's frames plus its exception, and a few lines after it
_LINE_LIMIT = 4096  # per kept line: a progress bar without an end is not a traceback
_SUMMARY_LIMIT = 500  # what an event field gets
_TRACEBACK = "Traceback (most recent call last):"
# torch's excepthook writes ``[rank0]: `` before every line of a traceback
_RANK_PREFIX = re.compile(r"^\[[^\]\s]*\]:\s?")
# ``ValueError: bad``, ``torch.OutOfMemoryError: CUDA ...``, ``KeyboardInterrupt``
_EXCEPTION = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)(?::.*)?$"
)


class WorkerEventTail:
    """The events workers of one attempt appended since the last ``read``."""

    def __init__(self, control_dir: str, local_ranks: range) -> None:
        self._paths = [os.path.join(control_dir, protocol.events_file(r)) for r in local_ranks]
        self._offsets = dict.fromkeys(self._paths, 0)

    def read(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for path in self._paths:
            events.extend(self._read_one(path))
        return events

    def _read_one(self, path: str) -> list[dict[str, Any]]:
        try:
            with open(path, "rb") as handle:
                handle.seek(self._offsets[path])
                chunk = handle.read(_MAX_READ)
        except OSError:  # not written yet, or the attempt's folder is already gone
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offsets[path] += len(complete)
        return [e for e in map(_event_or_none, complete.splitlines()) if e is not None]


def _event_or_none(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("event"), str) else None


class StderrTail:
    """Pure: the last ``max_lines`` lines of one stream (``\\n`` and ``\\r`` end a line)."""

    def __init__(self, max_lines: int = TAIL_LINES) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._rest = b""

    def feed(self, data: bytes) -> None:
        *whole, rest = re.split(rb"[\r\n]", self._rest + data)
        self._lines.extend(_text(line) for line in whole if line.strip())
        self._rest = rest[-_LINE_LIMIT:]

    def lines(self) -> list[str]:
        return [*self._lines, *([_text(self._rest)] if self._rest.strip() else [])]


def _text(line: bytes) -> str:
    return line[:_LINE_LIMIT].decode("utf-8", "replace")


def read_file_tail(path: str, max_bytes: int = 64 * 1024) -> list[str]:
    """The last lines of a file (torch's ``stderr.log``); none if it cannot be read."""
    tail = StderrTail()
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - max_bytes))
            tail.feed(handle.read(max_bytes))
    except OSError:
        return []
    return tail.lines()


def exception_line(lines: Iterable[str]) -> str | None:
    """The exception line of the last Python traceback in ``lines`` (its first line after
    the frames, so a multi-line message or a chained exception gives the one that ended the
    process), else the last line that reads as an exception; None if there is none."""
    plain = [_RANK_PREFIX.sub("", line.rstrip("\r\n")) for line in lines]
    starts = [i for i, line in enumerate(plain) if line.strip() == _TRACEBACK]
    if starts:
        after = [line for line in plain[starts[-1] + 1 :] if line.strip()]
        found = next((line for line in after if not line[:1].isspace()), None)
        if found is not None:
            return found.strip()[:_SUMMARY_LIMIT]
    found = next((line.strip() for line in reversed(plain) if _EXCEPTION.match(line.strip())), None)
    return None if found is None else found[:_SUMMARY_LIMIT]


def message_line(message: Any) -> str | None:
    """One line of torch's error-file message: ``@record`` writes ``{"message": "ValueError:
    ...", "extraInfo": {"py_callstack": ...}}`` (a dict, or that dict as JSON or as a Python
    repr in a string); the line is its ``message``'s first line, never the dict."""
    for _ in range(4):  # a message inside a message, at most this deep
        if isinstance(message, str):
            message = _parsed(message)
        if not isinstance(message, dict):
            break
        message = message.get("message")
    if not isinstance(message, str):
        return None
    first = next((line.strip() for line in message.splitlines() if line.strip()), None)
    return None if first is None else first[:_SUMMARY_LIMIT]


def _parsed(text: str) -> Any:
    stripped = text.strip()
    if not (stripped.startswith("{") and stripped.endswith("}")):
        return text
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    try:
        return ast.literal_eval(stripped)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text
