"""The entrypoint preflight forked from a real warm pool (``WarmPool.run``), and its fallback
to a fresh interpreter. The test process stands in for the supervisor, a child subreaper."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
from structlog.testing import capture_logs

from elastic_trainer.contract.config import Entrypoint
from elastic_trainer.supervisor.cli import preflight
from elastic_trainer.supervisor.processes import procs
from elastic_trainer.supervisor.warm.launcher import WarmPool
from tests import ROOT

pytestmark = pytest.mark.timeout(120)

# Warns with what it sees: how many objects its interpreter froze (the pool's gc.freeze
# before a fork; a fresh interpreter froze none) and its parent.
REPORTS = """
    import gc, os

    def preflight(argv, world_sizes):
        return [f"frozen={gc.get_freeze_count() > 0} parent={os.getppid()} sizes={world_sizes}"]
"""


@pytest.fixture
def pool(monkeypatch):
    if not procs.become_subreaper():
        pytest.skip("needs Linux: the pool's forks are re-parented to a child subreaper")
    monkeypatch.delenv("ELASTIC_TRAIN_SUPERVISOR_PID", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    started = WarmPool.start([])
    try:
        yield started
    finally:
        started.close()
        procs.become_subreaper(False)


def _entry(tmp_path) -> Entrypoint:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(REPORTS))
    return Entrypoint(script=str(path))


def test_with_a_warm_pool_the_preflight_is_forked_from_it(pool, tmp_path, monkeypatch):
    def no_fresh_interpreter(*args, **kwargs):
        raise AssertionError(f"started afresh: {args}")

    monkeypatch.setattr(subprocess, "run", no_fresh_interpreter)
    with capture_logs():
        warnings = preflight.run(_entry(tmp_path), [2, 4], pool=pool)
    assert warnings == [f"frozen=True parent={os.getpid()} sizes=[2, 4]"]


def test_a_pool_that_cannot_fork_leaves_the_preflight_to_a_fresh_interpreter(pool, tmp_path):
    pool.proc.kill()
    pool.proc.wait()
    with capture_logs() as logs:
        warnings = preflight.run(_entry(tmp_path), [1], pool=pool)
    assert warnings == [f"frozen=False parent={os.getpid()} sizes=[1]"]
    assert [e["event"] for e in logs] == ["warm_pool.unavailable"]  # said once, as for workers
