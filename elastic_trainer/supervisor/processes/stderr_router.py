"""In JSON mode, every line on stderr is one JSON object: also what bypasses our logging.

torch's C++ side (c10d's TCPStore warnings, with stack traces), a crashing worker's Python
traceback, a library's ``print(..., file=sys.stderr)``: all are written straight to file
descriptor 2. The supervisor puts a pipe there (its workers inherit it) and one thread copies
the pipe to the real stderr: lines that are already JSON objects pass unchanged, any other
line becomes an ``output.stderr`` event. Since the workers write through the supervisor, a
worker that dies mid-line loses nothing, and the supervisor sees the line even then.

Lines up to the pipe's atomic size (4 KiB on Linux) from different processes never mix; a
longer line written while another process writes may be split, and then arrives as text.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

EVENT = "output.stderr"
# glog-style prefixes of torch's C++ logs: [I1122 ...], [W1122 ...], [E...], [F...]
_GLOG = re.compile(r"^\[([IWEF])\d")
_LEVELS = {"I": "info", "W": "warning", "E": "error", "F": "critical"}
_READ_SIZE = 65536


def level_of(text: str) -> str:
    """The log level a raw stderr line announces (warning when it says nothing)."""
    match = _GLOG.match(text)
    return _LEVELS[match.group(1)] if match else "warning"


def render(line: bytes, fields: Mapping[str, Any]) -> bytes:
    """One stderr line -> one JSON line: itself if it already is a JSON object."""
    text = line.decode("utf-8", errors="replace").rstrip("\r\n")
    if text.startswith("{"):
        try:
            if isinstance(json.loads(text), dict):
                return text.encode("utf-8") + b"\n"
        except json.JSONDecodeError:
            pass
    event = {
        "event": EVENT,
        "text": text,
        "level": level_of(text),
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z"),
        **fields,
    }
    return json.dumps(event).encode("utf-8") + b"\n"


class StderrRouter:
    """Owns fd 2 while installed: a pipe, drained by one daemon thread to the real stderr."""

    def __init__(self, fields: Callable[[], Mapping[str, Any]]) -> None:
        self._fields = fields
        self._real = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._read_end = read_end
        self._thread = threading.Thread(target=self._pump, name="stderr-router", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._read_end, _READ_SIZE)
            except OSError:
                chunk = b""
            if not chunk:  # every writer closed its end: we are done
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._write(render(line, self._fields()))
        if pending:
            self._write(render(pending, self._fields()))
        os.close(self._read_end)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._real, view)
            view = view[written:]

    def close(self, timeout_s: float = 2.0) -> None:
        """Give fd 2 back to the real stderr and drain what is left. Writers that outlive
        us (an orphaned worker) keep the pipe open: the drain then stops at the timeout."""
        import sys

        sys.stderr.flush()
        os.dup2(self._real, 2)
        self._thread.join(timeout_s)


def install(fields: Callable[[], Mapping[str, Any]]) -> StderrRouter:
    return StderrRouter(fields)
