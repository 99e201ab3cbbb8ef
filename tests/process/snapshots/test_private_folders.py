"""A job's run folder against another local user: the snapshot folder, its snapshots,
``owner.json`` and the event log are the job's user's alone (0700/0600) under the usual
umask, and ``--snapshot-group-access`` reaches everything that creates them (0750/0640).

The supervisor makes the event log and the snapshot folder before any worker starts
(``supervisor.run``); the workers' store makes the rest (``worker.snapshotting``).
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from elastic_trainer.contract.config import RunConfig
from elastic_trainer.contract.protocol import WorkerSettings
from elastic_trainer.supervisor import finished, run
from elastic_trainer.supervisor.cli import args
from elastic_trainer.worker import distributed
from elastic_trainer.worker.context import WorkerContext
from elastic_trainer.worker.snapshotting import open_snapshots
from snapshots.format import layout
from tests.local_users import refused_all


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)  # the usual one: 0644 files in 0755 folders, if left to it
    yield
    os.umask(previous)


@pytest.fixture
def open_place() -> Iterator[Path]:
    """A folder every user may pass through (as a home or a project folder often is):
    what keeps them out of a run folder in it is the run folder's own mode."""
    base = Path(tempfile.mkdtemp())
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _cfg(tmp_path: Path, run: Path, *flags: str, env: dict[str, str] | None = None) -> RunConfig:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    argv = ["--snapshot-dir", str(run), "--log-file", str(_log(run))]
    return args.parse([*flags, *argv, str(script)], env=env or {})


def _log(run: Path) -> Path:
    return run.parent / "events-node.jsonl"  # beside the run folder: each is made by its own


def _make_run(cfg: RunConfig) -> None:
    """The run folder as a job makes it: the supervisor's event log, its check of the folder
    and its record of a finished run; then a worker's store, with the settings the worker
    reads from its environment: the job's owner record and one snapshot."""
    run._check_log_file(cfg.worker)
    run.preflight(cfg)
    run.Supervisor(cfg)._record_finished()
    settings = WorkerSettings.from_env({**cfg.worker.to_env(), "ELASTIC_TRAIN_JOB_ID": "job"})
    url = cfg.worker.snapshot_dir or ""
    snapshots = open_snapshots(url, 1, WorkerContext(settings=settings), attempt=1)
    snapshots.store.save(1, {"w": torch.ones(4)}).result(timeout=60)
    snapshots.store.close()


def _made(run: Path) -> list[Path]:
    """The run folder, the event log and what the job made in the folder."""
    return [run, _log(run), run / finished.FINISHED_NAME, run / "owner.json",
            run / layout.step_dir(1), run / layout.manifest_path(1)]  # fmt: skip


def test_another_user_can_neither_list_a_run_folder_nor_read_what_is_in_it(
    tmp_path: Path, open_place: Path, other: pwd.struct_passwd, umask_022: None
) -> None:
    run_dir = open_place / "runs" / "job"
    _make_run(_cfg(tmp_path, run_dir))
    made = _made(run_dir)
    assert [_mode(p) for p in made] == [0o700, 0o600, 0o600, 0o600, 0o700, 0o600]
    files = [str(p) for p in made if p.is_file()]
    attempt = refused_all(other, listed=[str(run_dir)], read=files)
    assert attempt.returncode == 0, attempt.stdout + attempt.stderr


def test_group_access_reaches_the_supervisor_and_the_workers(
    tmp_path: Path, umask_022: None
) -> None:
    run_dir = tmp_path / "runs" / "job"
    cfg = _cfg(tmp_path, run_dir, "--snapshot-group-access")
    assert cfg.worker.snapshot_group_access is True
    on = {"ELASTIC_TRAIN_SNAPSHOT_GROUP_ACCESS": "true"}
    assert _cfg(tmp_path, run_dir).worker.snapshot_group_access is False
    assert _cfg(tmp_path, run_dir, env=on).worker.snapshot_group_access is True
    assert not _cfg(
        tmp_path, run_dir, "--no-snapshot-group-access", env=on
    ).worker.snapshot_group_access
    _make_run(cfg)
    assert [_mode(p) for p in _made(run_dir)] == [0o750, 0o640, 0o640, 0o640, 0o750, 0o640]
    assert _mode(run_dir.parent) == 0o750  # made for the event log


@pytest.mark.parametrize(
    ("group_access", "folder", "file"), [(False, 0o700, 0o600), (True, 0o750, 0o640)]
)
def test_a_workers_event_log_takes_the_setting_too(
    tmp_path: Path,
    umask_022: None,
    monkeypatch: pytest.MonkeyPatch,
    group_access: bool,
    folder: int,
    file: int,
) -> None:
    """A worker started without the supervisor (torchrun) makes the log it is told of."""
    log = tmp_path / "logs" / "events.jsonl"
    settings = WorkerSettings(log_file=str(log), snapshot_group_access=group_access)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)  # no group needed
    try:
        distributed.init_worker(WorkerContext(settings=settings))
    finally:  # the process's logging as it was: later tests print through structlog's own
        logging.getLogger().handlers.clear()
        structlog.reset_defaults()
    assert [_mode(log.parent), _mode(log)] == [folder, file]
