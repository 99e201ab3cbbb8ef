"""Console mode under the real CLI: worker lines carry ``[rankN]:``; --local-ranks-filter
still keeps ranks off the console; on a terminal the built-in job's progress bar redraws
behind the prefix; JSON mode stays one JSON object per line, a worker's text lines marked
with its rank."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios

import pytest

from tests.e2e.test_default_job import TINY
from tests.e2e.workers.harness import HERE, env_with

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

HELLO = str(HERE / "hello.py")


def _run(env: dict[str, str], fmt: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "elastic_trainer", "--standalone", "--log-format", fmt,
           "--nproc-per-node", "2", *flags, HELLO]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)


def test_console_mode_prefixes_every_worker_line_with_its_rank(worker_env) -> None:
    done = _run(env_with(worker_env), "console")
    assert done.returncode == 0, done.stderr[-2000:]
    out, err = done.stdout.splitlines(), done.stderr.splitlines()
    assert "[rank0]:hello out 0" in out and "[rank1]:hello out 1" in out
    assert "[rank0]:hello err 0" in err and "[rank1]:hello err 1" in err


def test_console_mode_honours_local_ranks_filter_and_the_template(worker_env) -> None:
    flags = ("--local-ranks-filter", "1", "--log-line-prefix-template", "${local_rank}|")
    done = _run(env_with(worker_env), "console", *flags)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1|hello out 1" in done.stdout.splitlines()
    assert "hello out 0" not in done.stdout and "hello err 0" not in done.stderr


def test_json_mode_stays_one_json_object_per_line(worker_env) -> None:
    done = _run(env_with(worker_env), "json")
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stderr.splitlines()]  # each line parses
    lines = {(r["text"], r.get("rank"), r.get("local_rank"))
             for r in records if r["event"] == "output.stderr"}  # fmt: skip
    assert {("hello err 0", 0, 0), ("hello err 1", 1, 1)} <= lines  # whose line it is


def _read_all(fd: int, proc: subprocess.Popen) -> bytes:
    """Everything the terminal shows until the process exits (bounded by the test timeout)."""
    out = b""
    while True:
        if select.select([fd], [], [], 1.0)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out


def test_on_a_terminal_the_progress_bar_redraws_behind_the_prefix(worker_env, tmp_path) -> None:
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    cmd = [sys.executable, "-m", "elastic_trainer", "--standalone", "--nproc-per-node", "1",
           "--snapshot-dir", str(tmp_path / "ckpt"), "--", *TINY]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env_with(worker_env), stdin=subprocess.DEVNULL,
                            stdout=terminal, stderr=terminal, cwd=tmp_path)  # fmt: skip
    os.close(terminal)
    try:
        shown = _read_all(master, proc)
        assert proc.wait(timeout=200) == 0, shown[-2000:]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    redraws = [seg for seg in shown.split(b"\r") if b"%|" in seg]
    assert len(redraws) >= 2 and all(seg.startswith(b"[rank0]:") for seg in redraws)
