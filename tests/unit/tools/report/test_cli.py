"""``elastic-train report RUN``: PNG + summary from a log file or a folder; clear errors."""

from __future__ import annotations

import json
import sys

import pytest

from elastic_trainer.cli import main as cli_main
from elastic_trainer.tools.report.cli import main
from tests.unit.tools.report.test_summary import a_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_log(path, events) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + "not json\n")


def test_report_draws_a_png_and_prints_the_summary(tmp_path, capsys) -> None:
    log = tmp_path / "events.jsonl"
    write_log(log, a_run())
    out = tmp_path / "run.png"
    assert cli_main(["report", str(log), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    text = capsys.readouterr().out
    assert "restarts:    3" in text and str(out) in text


def test_a_folder_maps_to_its_events_jsonl_and_json_output(tmp_path, capsys) -> None:
    write_log(tmp_path / "events.jsonl", a_run())
    assert main([str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["restarts"] == 3 and summary["steps_redone"] == 15
    assert summary["png"] == str(tmp_path / "events.png")
    assert (tmp_path / "events.png").read_bytes().startswith(PNG_MAGIC)


def test_a_folder_merges_the_logs_of_every_node_by_time(tmp_path, capsys) -> None:
    events = a_run()
    write_log(tmp_path / "events-n0.jsonl", events[0::2])
    write_log(tmp_path / "events-n1.jsonl", events[1::2])
    assert main([str(tmp_path), "--json", "--no-plot"]) == 0
    merged = json.loads(capsys.readouterr().out)
    (tmp_path / "single").mkdir()
    write_log(tmp_path / "single" / "events.jsonl", events)
    assert main([str(tmp_path / "single"), "--json", "--no-plot"]) == 0
    single = json.loads(capsys.readouterr().out)
    for key in ("restarts", "steps_redone", "time_lost_s", "final_step", "goodput"):
        assert merged[key] == single[key], key


@pytest.mark.parametrize("make", ["missing", "empty_dir", "no_events"])
def test_bad_runs_are_one_line_and_exit_2(tmp_path, capsys, make) -> None:
    run = tmp_path / "run.jsonl"
    if make == "empty_dir":
        run = tmp_path
    elif make == "no_events":
        run.write_text("hello\nworld\n")
    assert main([str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elastic-train: error: ") and "\n" not in err


def test_unwritable_output_is_exit_2(tmp_path, capsys) -> None:
    log = tmp_path / "events.jsonl"
    write_log(log, a_run())
    assert main([str(log), "-o", str(tmp_path / "no" / "such" / "dir.png")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_without_matplotlib_the_summary_prints_and_the_plot_is_skipped(
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    write_log(tmp_path / "events.jsonl", a_run())
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "restarts:    3" in out
    assert "plot:        skipped" in out and "pip install 'elastic-train[report]'" in out
    assert main([str(tmp_path), "--json"]) == 0
    done = capsys.readouterr()
    assert json.loads(done.out)["png"] is None and "elastic-train[report]" in done.err
    assert not (tmp_path / "events.png").exists()


def test_an_abbreviated_option_is_refused_with_the_full_name(tmp_path, capsys) -> None:
    write_log(tmp_path / "events.jsonl", a_run())
    assert main([str(tmp_path), "--no-plo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "elastic-train: error: unknown option --no-plo: did you mean --no-plot?"
