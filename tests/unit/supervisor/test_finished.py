"""A run folder holding a finished job is not reused silently (supervisor/finished.py)."""

from __future__ import annotations

import json

from structlog.testing import capture_logs

from elastic_trainer.supervisor import finished, run
from elastic_trainer.supervisor.cli import args


def _cfg(tmp_path, *extra):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    return args.parse(
        ["--job-id", "tour", "--snapshot-dir", str(tmp_path / "run"), *extra, str(script)]
    )


def test_a_finished_jobs_folder_warns_once_naming_the_way_to_a_fresh_run(tmp_path):
    cfg = _cfg(tmp_path)
    run.Supervisor(cfg)._record_finished()
    recorded = json.loads((tmp_path / "run" / finished.FINISHED_NAME).read_bytes())
    assert recorded["job_id"] == "tour" and recorded["argv"][-1].endswith("train.py")
    with capture_logs() as logs:
        run.preflight(cfg)
    warnings = [e["warning"] for e in logs if e["event"] == "preflight.warning"]
    assert len(warnings) == 1
    assert "job 'tour', which finished at" in warnings[0] and "--job-id NAME" in warnings[0]
    assert not (tmp_path / "run" / finished.FINISHED_NAME).exists()  # this run: not finished
    with capture_logs() as logs:
        run.preflight(cfg)
    assert "preflight.warning" not in [e["event"] for e in logs]


def test_a_fresh_folder_and_a_damaged_record_say_nothing(tmp_path):
    cfg = _cfg(tmp_path)
    with capture_logs() as logs:
        run.preflight(cfg)
    (tmp_path / "run" / finished.FINISHED_NAME).write_bytes(b"\x80not json")
    with capture_logs() as later:
        run.preflight(cfg)
    assert "preflight.warning" not in [e["event"] for e in logs + later]
    assert finished.parse(b"[1, 2]") is None
