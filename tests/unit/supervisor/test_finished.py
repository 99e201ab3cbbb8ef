"""The end of a job is final (supervisor/finished.py): a command started after its job
finished runs nothing and exits 0 with one line, unless asked to run it again."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

from structlog.testing import capture_logs

from elastic_trainer.supervisor import finished, run
from elastic_trainer.supervisor.cli import args
from snapshots.storage import open_storage


def _cfg(tmp_path, *extra):
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'a').write('x')\n")
    return args.parse(
        ["--job-id", "tour", "--snapshot-dir", str(tmp_path / "run"), *extra, str(script)]
    )


def test_a_finished_job_is_not_run_again_unless_asked(tmp_path):
    cfg = _cfg(tmp_path)
    run.Supervisor(cfg)._record_finished()
    recorded = json.loads((tmp_path / "run" / finished.FINISHED_NAME).read_bytes())
    assert recorded["job_id"] == "tour" and recorded["argv"][-1].endswith("train.py")
    line = run._already_finished(cfg)
    assert line is not None and "job 'tour' finished at" in line and "--resume-finished" in line
    assert (tmp_path / "run" / finished.FINISHED_NAME).exists()  # still finished
    again = _cfg(tmp_path, "--resume-finished")
    with capture_logs() as logs:
        assert run._already_finished(again) is None
    (warning,) = [e["warning"] for e in logs if e["event"] == "preflight.warning"]
    assert "--job-id NAME" in warning
    assert not (tmp_path / "run" / finished.FINISHED_NAME).exists()  # this run: not finished


def test_another_command_line_is_asking_for_more(tmp_path):
    """The built-in job stopped at --max-steps and run again without it goes on."""
    run.Supervisor(_cfg(tmp_path))._record_finished()
    cfg = _cfg(tmp_path)
    more = replace(cfg, entrypoint=replace(cfg.entrypoint, args=("--epochs", "9")))
    with capture_logs() as logs:
        assert run._already_finished(more) is None
    assert [e["event"] for e in logs] == ["preflight.warning"]
    assert not (tmp_path / "run" / finished.FINISHED_NAME).exists()


def test_another_jobs_record_a_fresh_folder_and_damage_say_nothing(tmp_path):
    cfg = _cfg(tmp_path)
    assert run._already_finished(cfg) is None
    storage = open_storage(str(tmp_path / "run"))
    storage.write(finished.FINISHED_NAME, finished.record("other", [], "2026-01-01T00:00:00Z"))
    assert run._already_finished(cfg) is None
    storage.write(finished.FINISHED_NAME, b"\x80not json")
    assert run._already_finished(cfg) is None
    assert finished.parse(b"[1, 2]") is None


def test_a_job_that_ended_while_this_node_joined_is_told_apart() -> None:
    began = time.time()
    after = {"job_id": "j", "finished_at": "2999-01-01T00:00:00.000+00:00"}
    before = {"job_id": "j", "finished_at": "2000-01-01T00:00:00.000+00:00"}
    assert finished.finished_while_joining(after, started_at=began)
    assert not finished.finished_while_joining(before, started_at=began)
    assert not finished.finished_while_joining(None, started_at=began)
    assert not finished.finished_while_joining({"job_id": "j"}, started_at=began)


def test_the_command_exits_0_with_one_line_and_runs_nothing(tmp_path):
    cfg = _cfg(tmp_path)
    run.Supervisor(cfg)._record_finished()
    argv = ["--job-id", "tour", "--snapshot-dir", str(tmp_path / "run"), "--log-format",
            "console", str(tmp_path / "train.py")]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "elastic_trainer", *argv],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "job 'tour' finished at" in done.stderr and "error=" not in done.stderr
    assert not (tmp_path / "ran").exists()
