"""JSON mode: whatever reaches file descriptor 2 leaves as one JSON object per line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from elastic_trainer.supervisor.processes import stderr_router


@pytest.mark.parametrize(
    ("line", "level"),
    [
        ("[W1122 16:48:50.123 TCPStore.cpp:125] recvValue failed", "warning"),
        ("[E1122 16:48:50.123 ProcessGroupGloo.cpp:9] boom", "error"),
        ("Traceback (most recent call last):", "warning"),
    ],
)
def test_raw_lines_become_output_events(line, level) -> None:
    event = json.loads(stderr_router.render(line.encode() + b"\n", {"job_id": "j", "pid": 1}))
    assert event["event"] == "output.stderr" and event["text"] == line
    assert (event["level"], event["job_id"], event["pid"]) == (level, "j", 1)
    assert event["timestamp"].endswith("Z")


def test_json_objects_pass_unchanged() -> None:
    line = b'{"event": "job.finished", "pid": 7}'
    assert stderr_router.render(line + b"\n", {"pid": 1}) == line + b"\n"
    # a JSON value that is not an object is still text
    assert json.loads(stderr_router.render(b"[1, 2]\n", {}))["text"] == "[1, 2]"


def test_a_process_and_its_children_write_only_json_through_the_router() -> None:
    """Raw writes to fd 2 (as C++ does), a child process's traceback, our own JSON line and
    an unterminated last line all leave as JSON objects, in a real process."""
    program = textwrap.dedent(
        """
        import os, subprocess, sys
        from elastic_trainer.supervisor.processes import stderr_router
        router = stderr_router.install(lambda: {"job_id": "j", "node": "n", "pid": os.getpid()})
        os.write(2, b"[W1122 00:00:00.000 TCPStore.cpp:1] native warning\\n")
        print('{"event": "supervisor.started", "pid": 1}', file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-c", "raise RuntimeError('child failed')"])
        os.write(2, b"no newline at the end")
        router.close()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    events = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    texts = [e.get("text") for e in events]
    assert "[W1122 00:00:00.000 TCPStore.cpp:1] native warning" in texts
    assert "RuntimeError: child failed" in texts
    assert texts[-1] == "no newline at the end"
    assert {"event": "supervisor.started", "pid": 1} in events
    assert all({"job_id", "node", "pid"} <= e.keys() for e in events if "text" in e)
