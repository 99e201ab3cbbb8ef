"""The progress record a worker writes after every step (``worker.progress.ProgressFile``)."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from elastic_trainer.contract import protocol
from elastic_trainer.supervisor.core.watchdog import Progress, parse_progress
from elastic_trainer.worker.progress import ProgressFile


def test_each_report_overwrites_the_last_in_place_as_one_fixed_size_private_record(tmp_path):
    path = tmp_path / protocol.progress_file(0)
    progress = ProgressFile(str(path))
    progress.write(step=1, epoch=0, restored_step=None)
    inode = path.stat().st_ino
    progress.write(step=12345, epoch=3, restored_step=7)
    assert path.stat().st_ino == inode  # in place: no new file, no rename
    assert path.stat().st_size == protocol.PROGRESS_RECORD_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    report = parse_progress(path.read_text())
    assert isinstance(report, Progress)
    assert (report.step, report.epoch, report.restored_step) == (12345, 3, 7)


def test_a_link_in_place_of_the_record_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("not the worker's")
    path = tmp_path / protocol.progress_file(0)
    os.symlink(victim, path)
    with pytest.raises(OSError) as refused:
        ProgressFile(str(path)).write(step=1, epoch=0, restored_step=None)
    assert refused.value.errno == errno.ELOOP
    assert victim.read_text() == "not the worker's"
