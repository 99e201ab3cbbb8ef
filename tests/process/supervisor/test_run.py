"""The supervisor's start (``supervisor/run.py``): the warm pool is its first child, started
before it imports torch, under the workers' environment (after the one check that needs
nothing: the script exists), and never outlives a start that ends early. Each case runs
``run.main`` in a child process: it makes that process a child subreaper and starts
processes, which the test process must not become or keep."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# run.main with launcher.start_pool wrapped: what the process looked like when the pool was
# asked for, and the pool's pid, go to RECORD; the job's script does not exist, so the start
# ends at the preflight, after the pool started, with exit 2.
DRIVER = textwrap.dedent(
    """
    import json, os, sys
    from elastic_trainer.supervisor import run
    from elastic_trainer.supervisor.processes import procs
    from elastic_trainer.supervisor.warm import launcher

    record, argv = sys.argv[1], sys.argv[2:]
    started = launcher.start_pool

    def start_pool(cfg):
        seen = {
            "torch_imported": "torch" in sys.modules,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            "supervisor_pid": os.environ.get("ELASTIC_TRAIN_SUPERVISOR_PID"),
            "subreaper": procs.is_subreaper(),
            "pid": os.getpid(),
        }
        pool = started(cfg)
        seen["pool_pid"] = None if pool is None else pool.pid
        with open(record, "w") as f:
            json.dump(seen, f)
        return pool

    launcher.start_pool = start_pool
    claim = run.claim_store_port

    def claim_store_port(cfg):
        claimed = claim(cfg)
        with open(record + ".claim", "w") as f:
            json.dump({"torch_imported": "torch" in sys.modules, "bound": claimed is not None}, f)
        return claimed

    run.claim_store_port = claim_store_port
    code = run.main(argv)
    if not os.path.exists(record):  # it ended before the pool
        sys.exit(code)
    with open(record) as f:
        seen = json.load(f)
    if seen["pool_pid"] is not None:  # still ours, not yet reaped: main left it running
        try:
            seen["pool_after_main"] = os.waitpid(seen["pool_pid"], os.WNOHANG)[0] == 0
        except ChildProcessError:  # reaped: it ended
            seen["pool_after_main"] = False
    import psutil

    seen["children_after_main"] = [" ".join(c.cmdline()) for c in psutil.Process().children()]
    with open(record, "w") as f:
        json.dump(seen, f)
    sys.exit(code)
    """
)


def _start(tmp: Path, script: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``run.main`` in a child, as DRIVER runs it; what it recorded (empty: no pool asked)."""
    record = tmp / "record.json"
    with socket.socket() as probe:  # a port nobody listens on: this node would host there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["--job-id", "early", "--rdzv-endpoint", f"127.0.0.1:{port}", *flags, str(script)]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(record), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"},
    )
    if not record.exists():
        return done, {}
    seen = json.loads(record.read_text())
    claim = tmp / "record.json.claim"
    seen["claim"] = json.loads(claim.read_text()) if claim.exists() else None
    return done, seen


@pytest.fixture(scope="module")
def early_failure(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess, dict]:
    """A start whose snapshot folder cannot be made (its parent is a file): it ends at the
    preflight, after the pool started."""
    tmp = tmp_path_factory.mktemp("early")
    script = tmp / "train.py"
    script.write_text("")
    blocker = tmp / "a-file"
    blocker.touch()
    done, seen = _start(tmp, script, "--snapshot-dir", str(blocker / "snaps"))
    assert seen, f"the pool was never asked for: {done.stderr}"
    return done, seen


def test_a_missing_script_is_reported_before_anything_starts(tmp_path: Path) -> None:
    done, seen = _start(tmp_path, tmp_path / "no.py")
    assert done.returncode == 2 and "does not exist" in done.stderr, done.stderr
    assert seen == {}  # no pool, no guards: a typo costs one line, at once


def test_the_warm_pool_starts_before_the_supervisor_imports_torch(early_failure) -> None:
    done, seen = early_failure
    assert done.returncode == 2 and "--snapshot-dir" in done.stderr, done.stderr
    assert seen["torch_imported"] is False, seen  # its import runs beside ours, not after
    # the environment it imports torch under is the workers': malloc tuning, the guards
    assert seen["glibc_tunables"], seen
    assert seen["supervisor_pid"] == str(seen["pid"]) and seen["subreaper"], seen
    assert seen["pool_pid"] is not None, seen


def test_a_start_that_fails_after_the_pool_started_ends_the_pool(early_failure) -> None:
    done, seen = early_failure
    assert done.returncode == 2, done.stderr
    assert seen["pool_after_main"] is False, f"the warm pool outlived main's exit 2: {seen}"


def test_a_start_that_fails_after_the_pool_started_leaves_no_child(early_failure) -> None:
    """Regression: the node sentinel lived on, one per call, in a process that goes on after
    ``run.main`` returns (the test suite: each scans the process tree every 0.25 s)."""
    done, seen = early_failure
    assert done.returncode == 2, done.stderr
    assert seen["children_after_main"] == [], seen


def test_a_loopback_store_port_is_claimed_before_torch_is_imported(early_failure) -> None:
    """The agent started first on a machine wins the port: within its first moments, not
    after the seconds of ``import torch`` (which ``hosts_store`` skips for loopback)."""
    done, seen = early_failure
    assert seen["claim"] == {"torch_imported": False, "bound": True}, (seen, done.stderr)
